"""pipeline.report: metrics.jsonl -> loss.png, throughput.png, sources.png, summary.md.

The PNGs are checked as files (signature, decodable, size) and by the data the plot drew,
compared with a metrics.jsonl written here (not by pixels).
"""
import json

import numpy as np

import pytest

from pipeline import report as rep

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _train(step, loss, resumed=False):
    return {"kind": "train", "step": step, "loss": loss, "ar_loss": loss / 2,
            "mdm_loss": loss / 2 + (100.0 if resumed else 0.0), "lr": 1e-3, "grad_norm": 1.0,
            "tokens_per_s": 1000.0 + step, "tflops_per_device": 0.1, "mfu": None,
            "peak_memory_bytes": 2 ** 30 * step, "consumed_samples": 4 * step,
            "consumed_tokens": 1024 * step, "step_time_s": 1.0, "skipped": False}


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def _check_png(path):
    import matplotlib.image as mpimg
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    img = mpimg.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100


def test_report_plots_the_last_line_per_kind_and_step(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # Steps 1..6, then a resume from step 4 re-appends 5 and 6 (the first 5, 6 are stale).
    recs = [_train(s, 10.0 - s, resumed=s in (5, 6)) for s in range(1, 7)]
    recs.append({"kind": "val", "step": 3, "val_loss": 7.5, "val_ar_loss": 3.5,
                 "val_mdm_loss": 4.0, "val_batches": 2})
    recs += [_train(5, 4.0), _train(6, 3.0)]
    recs.append({"kind": "val", "step": 6, "val_loss": 5.5, "val_ar_loss": 2.5,
                 "val_mdm_loss": 3.0, "val_batches": 2})
    _write(run / "metrics.jsonl", recs, tail='{"kind": "train", "st')  # killed mid-write
    out = tmp_path / "figs"
    res = rep.report(run, out)

    _check_png(out / "loss.png")
    _check_png(out / "throughput.png")
    loss = res["loss"]
    steps = [1, 2, 3, 4, 5, 6]
    assert loss["training loss"]["run"] == (steps, [9.0, 8.0, 7.0, 6.0, 4.0, 3.0])
    assert loss["training AR term"]["run"] == (steps, [4.5, 4.0, 3.5, 3.0, 2.0, 1.5])
    # The stale (pre-resume) MDM values +100 must not be plotted.
    assert loss["training MDM term"]["run"][1] == [4.5, 4.0, 3.5, 3.0, 2.0, 1.5]
    assert loss["validation loss"]["loss"] == ([3, 6], [7.5, 5.5])
    assert loss["validation loss"]["MDM term"] == ([3, 6], [4.0, 3.0])
    thr = res["throughput"]
    assert thr["tokens/s (per step, all ranks)"] == (steps, [1001.0, 1002.0, 1003.0, 1004.0,
                                                             1005.0, 1006.0])
    assert thr["peak memory (GiB)"] == (steps, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    assert "MFU (%)" not in thr  # null on CPU: no panel
    summary = (out / "summary.md").read_text()
    assert "steps 1..6" in summary
    assert "validation at step 6: loss 5.5000, AR term 2.5000, MDM term 3.0000" in summary


def test_cli_writes_into_run_dir_by_default(tmp_path, capsys):
    run = tmp_path / "r"
    run.mkdir()
    _write(run / "metrics.jsonl", [_train(s, 5.0 / s) for s in (1, 2)])
    assert rep.main([str(run)]) == 0
    for name in ("loss.png", "throughput.png", "sources.png", "summary.md"):
        assert (run / name).is_file()
    assert str(run / "loss.png") in capsys.readouterr().out


def test_several_runs_share_the_loss_figure(tmp_path):
    a = {"train": [_train(s, 4.0) for s in (1, 2, 3)]}
    b = {"train": [_train(s, 2.0) for s in (1, 2)]}
    plotted = rep.plot_loss({"ar": a, "refusion": b}, tmp_path / "loss.png")
    _check_png(tmp_path / "loss.png")
    assert plotted["training loss"] == {"ar": ([1, 2, 3], [4.0] * 3), "refusion": ([1, 2], [2.0] * 2)}
    assert "validation loss" not in plotted


@pytest.mark.parametrize("content,needle", [
    (None, "no metrics file"),
    ("", "the metrics file is empty"),
    ("\n\n", "the metrics file is empty"),
    ("not json\n{}\n", "metrics.jsonl:1: not a JSON line"),
    ('{"kind": "train"}\n', "metrics.jsonl:1: a metrics line needs"),
])
def test_bad_metrics_file_is_one_line_and_exit_2(tmp_path, capsys, content, needle):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert rep.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "loss.png").exists()


def test_sources_plot_and_table_from_per_source_fields(tmp_path):
    """sources.png draws each source's train and val loss and the realized token share
    (cumulative tokens_by_source / cumulative tokens, computed here by hand) against the target;
    summary.md's table has the last values. A source may be absent from a step (0 tokens, null
    loss)."""
    run = tmp_path / "run"
    run.mkdir()
    toks = [{"web": 30, "code": 10}, {"web": 10, "code": 0}, {"web": 20, "code": 30}]
    losses = [{"web": 3.0, "code": 4.0}, {"web": 2.5, "code": None}, {"web": 2.0, "code": 3.5}]
    recs = []
    for s, (t, lo) in enumerate(zip(toks, losses), 1):
        recs.append(dict(_train(s, 5.0), tokens_by_source=t, loss_by_source=lo,
                         target_share_by_source={"web": 0.75, "code": 0.25}))
    recs.append({"kind": "val", "step": 3, "val_loss": 2.0, "val_ar_loss": 1.0,
                 "val_mdm_loss": 1.0, "val_batches": 2,
                 "loss_by_source": {"web": 1.75, "code": 2.25}})
    _write(run / "metrics.jsonl", recs)
    res = rep.report(run)
    _check_png(run / "sources.png")
    assert str(run / "sources.png") in res["files"]
    src = res["sources"]
    assert src["loss by source"]["train: web"] == ([1, 2, 3], [3.0, 2.5, 2.0])
    assert src["loss by source"]["train: code"] == ([1, 3], [4.0, 3.5])   # null skipped
    assert src["loss by source"]["val: code"] == ([3], [2.25])
    cum_web, cum_all = np.cumsum([30, 10, 20]), np.cumsum([40, 10, 50])
    steps, web = src["token share by source"]["web"]
    assert steps == [1, 2, 3]
    np.testing.assert_allclose(web, cum_web / cum_all)
    np.testing.assert_allclose(src["token share by source"]["code"][1], 1 - cum_web / cum_all)
    assert src["token share by source"]["web target"] == ([1, 2, 3], [0.75] * 3)
    summary = (run / "summary.md").read_text()
    assert "| web | 0.7500 | 0.6000 | 2.0000 | 1.7500 |" in summary
    assert "| code | 0.2500 | 0.4000 | 3.5000 | 2.2500 |" in summary


def test_sources_plot_of_one_source_and_of_a_run_without_the_fields(tmp_path):
    one = {"train": [dict(_train(s, 2.0), tokens_by_source={"data": 100},
                          loss_by_source={"data": 2.0}, target_share_by_source={"data": 1.0})
                     for s in (1, 2)]}
    got = rep.plot_sources(one, tmp_path / "one.png")
    _check_png(tmp_path / "one.png")
    assert got["token share by source"] == {"data": ([1, 2], [1.0, 1.0]),
                                            "data target": ([1, 2], [1.0, 1.0])}
    assert "| data | 1.0000 | 1.0000 | 2.0000 | n/a |" in rep.summary_markdown(one, "r")
    old = {"train": [_train(1, 2.0)]}   # a run logged before per-source accounting
    assert rep.plot_sources(old, tmp_path / "old.png") == {}
    _check_png(tmp_path / "old.png")
    assert "| source |" not in rep.summary_markdown(old, "r")
