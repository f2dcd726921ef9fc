"""Plots and a short summary of a training run: `python -m pipeline.report RUN_DIR [--out DIR]`.

Owns: reading `<run_dir>/metrics.jsonl` (the trainer's log, ARCHITECTURE.md "Training job")
and drawing it. Must not touch: training, the metrics format (the trainer writes it).

Reading: one JSON object per line; a resumed run re-appends the steps after its checkpoint,
so the last line per (kind, step) wins (`read_metrics`). Lines of other kinds are ignored.
Writes into `--out` (default: RUN_DIR):
- `loss.png`: training loss, its AR and MDM terms, and the validation loss with its terms,
  against the optimizer step (one panel each).
- `throughput.png`: tokens/s, MFU and peak memory against the step (a panel only for the
  figures the run logged: MFU is null on CPU).
- `sources.png`: per data source, the training and validation loss (`loss_by_source` of
  the train and val lines) against the step, and the realized token share (cumulative
  `tokens_by_source` over cumulative tokens, from the first step that logged them) against the
  target share (`target_share_by_source`); "not logged" panels for a run without them.
- `summary.md`: steps, first/last loss (window means), last validation losses, mean tokens/s,
  and a per-source table (target and realized share, last losses).
Figures are drawn with matplotlib's headless Agg backend. Several runs can share one figure
(`plot_loss({name: metrics, ...})`; used by `pipeline.experiment`, which also draws with
`pyplot` and `save_figure`).
Exit codes: 0 done; 2 missing, empty or malformed metrics file (one line on stderr).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from pipeline.common.cli import EXIT_USAGE, hidden_alias

# Training figures: (metrics key, panel title); validation figures likewise.
LOSS_PANELS = (("loss", "training loss"), ("ar_loss", "training AR term"),
               ("mdm_loss", "training MDM term"))
VAL_KEYS = (("val_loss", "loss"), ("val_ar_loss", "AR term"), ("val_mdm_loss", "MDM term"))
THROUGHPUT_PANELS = (("tokens_per_s", "tokens/s (per step, all ranks)", 1.0),
                     ("mfu", "MFU (%)", 100.0),
                     ("peak_memory_bytes", "peak memory (GiB)", 1.0 / 2 ** 30))


class ReportError(ValueError):
    """A missing, empty or malformed metrics file (one-line message naming it)."""


def read_metrics(path: str | os.PathLike) -> dict[str, list[dict]]:
    """Read a trainer's `metrics.jsonl`, keeping the last line per (kind, step).

    Args:
        path: the JSONL file.

    Returns:
        {kind: [record, ...] sorted by step} for every kind present ("train", "val").

    Raises:
        ReportError: the file is missing or empty, a line is not a JSON object with "kind"
            and an integer "step" (the message names file and line number).
    """
    p = Path(path)
    if not p.is_file():
        raise ReportError(f"{p}: no metrics file (has the run logged a step yet?)")
    last: dict[tuple[str, int], dict] = {}
    with open(p, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                # A run killed mid-write leaves a truncated last line: skip only that one.
                if not line.endswith("\n"):
                    continue
                raise ReportError(f"{p}:{n}: not a JSON line") from None
            if (not isinstance(rec, dict) or not isinstance(rec.get("kind"), str)
                    or not isinstance(rec.get("step"), int)):
                raise ReportError(f"{p}:{n}: a metrics line needs \"kind\" and an integer \"step\"")
            last[(rec["kind"], rec["step"])] = rec
    if not last:
        raise ReportError(f"{p}: the metrics file is empty")
    out: dict[str, list[dict]] = {}
    for (kind, _), rec in sorted(last.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        out.setdefault(kind, []).append(rec)
    return out


def series(records: list[dict], key: str, scale: float = 1.0) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over `records`, skipping records where it is absent, null or
    not finite (e.g. MFU on CPU, the MDM term of an AR run is kept: it is a logged 0)."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            xs.append(int(r["step"]))
            ys.append(float(v) * scale)
    return xs, ys


def pyplot():
    """`matplotlib.pyplot` on the headless Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: str | os.PathLike) -> None:
    """Write a matplotlib figure as PNG (90 dpi) atomically (temporary file in the same folder,
    then rename)."""
    from pipeline.common.atomic_io import atomic_path
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png", dpi=90)


def plot_loss(runs: dict[str, dict[str, list[dict]]], path: str | os.PathLike) -> dict:
    """Draw training and validation losses of one or more runs into one PNG.

    Args:
        runs: {run label: `read_metrics` result}.
        path: PNG to write.

    Returns:
        The plotted data: {panel title: {run label: (steps, values)}} (only series with at
        least one point; losses in nats).
    """
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    plotted: dict = {}
    panels = list(LOSS_PANELS) + [(None, "validation loss")]
    for ax, (key, title) in zip(axes.flat, panels):
        for label, m in runs.items():
            if key is not None:
                xs, ys = series(m.get("train", []), key)
                if xs:
                    ax.plot(xs, ys, label=label, linewidth=1)
                    plotted.setdefault(title, {})[label] = (xs, ys)
            else:
                for vkey, vname in VAL_KEYS:
                    xs, ys = series(m.get("val", []), vkey)
                    if xs:
                        name = f"{label}: {vname}" if len(runs) > 1 else vname
                        ax.plot(xs, ys, marker="o", markersize=3, label=name, linewidth=1)
                        plotted.setdefault(title, {})[name] = (xs, ys)
        _dress(ax, title, "nats / token", title in plotted)
    fig.tight_layout()
    save_figure(fig, Path(path))
    plt.close(fig)
    return plotted


def _dress(ax, title: str, ylabel: str, drawn: bool) -> None:
    """Title, step axis, grid and legend of a panel of curves against the step ("not logged"
    in its middle when nothing was drawn)."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)


def plot_throughput(metrics: dict[str, list[dict]], path: str | os.PathLike) -> dict:
    """Draw tokens/s, MFU (%) and peak memory (GiB) per step, one panel per logged figure.

    Returns:
        {panel title: (steps, values)} of the panels drawn (values in the panel's unit).
    """
    plt = pyplot()
    train = metrics.get("train", [])
    drawn = [(t, series(train, k, s)) for k, t, s in THROUGHPUT_PANELS]
    drawn = [(t, xy) for t, xy in drawn if xy[0]]
    fig, axes = plt.subplots(1, max(1, len(drawn)), figsize=(5 * max(1, len(drawn)), 3.6),
                             squeeze=False)
    for ax, (title, (xs, ys)) in zip(axes.flat, drawn):
        ax.plot(xs, ys, linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if not drawn:
        axes.flat[0].text(0.5, 0.5, "no throughput logged", ha="center", va="center")
    fig.tight_layout()
    save_figure(fig, Path(path))
    plt.close(fig)
    return dict(drawn)


def _source_names(records: list[dict], *keys: str) -> list[str]:
    """Source names in order of first appearance in the records' dict fields `keys`."""
    names: dict[str, None] = {}
    for r in records:
        for k in keys:
            if isinstance(r.get(k), dict):
                names.update(dict.fromkeys(r[k]))
    return list(names)


def _by_source(records: list[dict], key: str, name: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `record[key][name]`, skipping records without a finite number."""
    return series([{"step": r["step"], "v": (r.get(key) or {}).get(name)} for r in records
                   if isinstance(r.get(key), dict)], "v")


def realized_shares(train: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """Realized token share of each source after each step: cumulative `tokens_by_source[name]`
    over the cumulative tokens of all sources, over the train records that logged
    `tokens_by_source` (in step order). Returns {name: (steps, shares in [0, 1])}."""
    recs = [r for r in train if isinstance(r.get("tokens_by_source"), dict)]
    names = _source_names(recs, "tokens_by_source")
    cum = dict.fromkeys(names, 0)
    total = 0
    out: dict[str, tuple[list[int], list[float]]] = {n: ([], []) for n in names}
    for r in recs:
        for n, v in r["tokens_by_source"].items():
            cum[n] += int(v)
            total += int(v)
        if total:
            for n in names:
                out[n][0].append(int(r["step"]))
                out[n][1].append(cum[n] / total)
    return out


def plot_sources(metrics: dict[str, list[dict]], path: str | os.PathLike) -> dict:
    """Draw the per-source losses and the realized against the target token shares.

    Returns:
        {"loss by source": {label: (steps, nats)}, "token share by source": {label: (steps,
        shares)}} with labels `train: <name>`, `val: <name>`, `<name>` (realized) and
        `<name> target` (only series with at least one point).
    """
    plt = pyplot()
    train, val = metrics.get("train", []), metrics.get("val", [])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    plotted: dict = {}
    loss_ax, share_ax = axes
    names = _source_names(train + val, "tokens_by_source", "loss_by_source")
    color = {n: f"C{i % 10}" for i, n in enumerate(names)}   # one colour per source
    for what, recs, key, style in (("train", train, "loss_by_source", {"markersize": 2}),
                                   ("val", val, "loss_by_source",
                                    {"markersize": 4, "linestyle": "--"})):
        for name in names:
            xs, ys = _by_source(recs, key, name)
            if xs:
                loss_ax.plot(xs, ys, label=f"{what}: {name}", linewidth=1, marker="o",
                             color=color[name], **style)
                plotted.setdefault("loss by source", {})[f"{what}: {name}"] = (xs, ys)
    for name, (xs, ys) in realized_shares(train).items():
        if xs:
            share_ax.plot(xs, ys, label=name, linewidth=1, color=color[name])
            plotted.setdefault("token share by source", {})[name] = (xs, ys)
            txs, tys = _by_source(train, "target_share_by_source", name)
            if txs:
                share_ax.plot(txs, tys, linestyle="--", color=color[name], linewidth=1,
                              label=f"{name} target")
                plotted["token share by source"][f"{name} target"] = (txs, tys)
    for ax, title, unit in ((loss_ax, "loss by source", "nats / labelled token"),
                            (share_ax, "token share by source", "cumulative share of tokens")):
        _dress(ax, title, unit, title in plotted)
    fig.tight_layout()
    save_figure(fig, Path(path))
    plt.close(fig)
    return plotted


def _source_table(metrics: dict[str, list[dict]]) -> list[str]:
    """Markdown table of the sources: target share, realized share, last train and val loss."""
    train, val = metrics.get("train", []), metrics.get("val", [])
    shares = realized_shares(train)
    names = _source_names(train + val, "tokens_by_source", "loss_by_source")
    if not names:
        return []

    def last(recs, key, name):
        _, ys = _by_source(recs, key, name)
        return f"{ys[-1]:.4f}" if ys else "n/a"
    lines = ["", "| source | target share | realized share | last train loss | last val loss |",
             "|---|---|---|---|---|"]
    for n in names:
        real = shares.get(n, ([], []))[1]
        target = last(train, "target_share_by_source", n)
        lines.append(f"| {n} | {target} | {f'{real[-1]:.4f}' if real else 'n/a'} | "
                     f"{last(train, 'loss_by_source', n)} | {last(val, 'loss_by_source', n)} |")
    return lines


def _window_mean(values: list[float], first: bool) -> tuple[float, int]:
    n = max(1, min(10, len(values) // 4))
    w = values[:n] if first else values[-n:]
    return sum(w) / len(w), n


def summary_markdown(metrics: dict[str, list[dict]], run_dir: str) -> str:
    """A short Markdown summary: steps, loss at start and end (window means), validation."""
    train, val = metrics.get("train", []), metrics.get("val", [])
    lines = [f"# Run summary: `{run_dir}`", ""]
    if train:
        lines.append(f"- training steps logged: {len(train)} (steps {train[0]['step']}.."
                     f"{train[-1]['step']})")
        for key, title in LOSS_PANELS:
            _, ys = series(train, key)
            if ys:
                a, n = _window_mean(ys, True)
                b, _ = _window_mean(ys, False)
                lines.append(f"- {title}: mean of first {n} logged steps {a:.3f} -> "
                             f"mean of last {n} {b:.3f}")
        for key, title, scale in THROUGHPUT_PANELS:
            _, ys = series(train, key, scale)
            if ys:
                lines.append(f"- {title}: mean {sum(ys) / len(ys):.4g}, last {ys[-1]:.4g}")
        last = train[-1]
        for key in ("consumed_samples", "consumed_tokens"):
            if key in last:
                lines.append(f"- {key.replace('_', ' ')} at the last step: {last[key]}")
    else:
        lines.append("- no training steps logged")
    if val:
        v = val[-1]
        terms = ", ".join(f"{name} {v[k]:.4f}" for k, name in VAL_KEYS
                          if isinstance(v.get(k), (int, float)))
        lines.append(f"- validation at step {v['step']}: {terms}")
    lines += _source_table(metrics)
    lines += ["", "Figures: `loss.png` (losses), `throughput.png` (tokens/s, MFU, memory), "
                  "`sources.png` (per-source losses, token shares).", ""]
    return "\n".join(lines)


def report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> dict:
    """Write loss.png, throughput.png, sources.png and summary.md for a run.

    Args:
        run_dir: folder holding `metrics.jsonl`.
        out_dir: where to write (default `run_dir`).

    Returns:
        {"loss": plot_loss's data, "throughput": plot_throughput's data, "sources":
        plot_sources's data, "files": [paths]}.

    Raises:
        ReportError: see `read_metrics`.
    """
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir
    metrics = read_metrics(run_dir / "metrics.jsonl")
    out.mkdir(parents=True, exist_ok=True)
    loss = plot_loss({run_dir.name or str(run_dir): metrics}, out / "loss.png")
    thr = plot_throughput(metrics, out / "throughput.png")
    src = plot_sources(metrics, out / "sources.png")
    text = summary_markdown(metrics, str(run_dir))
    from pipeline.common.atomic_io import write_text
    write_text(out / "summary.md", text)
    files = [str(out / n) for n in ("loss.png", "throughput.png", "sources.png", "summary.md")]
    return {"loss": loss, "throughput": thr, "sources": src, "files": files}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.report",
                                description="Plot a training run's metrics.jsonl.")
    p.add_argument("run_dir", help="run folder holding metrics.jsonl")
    p.add_argument("--output", dest="out", default=None, help="output folder (default: RUN_DIR)")
    hidden_alias(p, "--out", dest="out")
    args = p.parse_args(argv)
    try:
        res = report(args.run_dir, args.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"error: {args.out or args.run_dir}: cannot write: {e.strerror or e}",
              file=sys.stderr)
        return EXIT_USAGE
    print("report: " + ", ".join(res["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
