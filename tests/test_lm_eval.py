"""pipeline.lm_eval: our model inside EleutherAI's lm-evaluation-harness, offline.

Tasks are YAML definitions over small JSONL files the tests write (`dataset_path: json`), on the
tiny checkpoints of tests/test_generate.py. Oracles: `python -m pipeline.generate` (the same
decoder, called as users call it) for generations; transformers' Qwen3ForCausalLM logits with
`log_softmax` for log-likelihoods; the harness's own metrics over values the test knows.
"""
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from test_generate import make_spm_model_folder  # noqa: E402
from tiny_qwen3 import make_tiny_qwen3  # noqa: E402

QUESTIONS = ["def load(fp):", "class JSONDecoder(object):", "import sys", "x"]
MC = [{"question": "def load(fp):", "choices": ["return", "pass", "x = 1"], "label": 0},
      {"question": "import", "choices": ["sys", "os"], "label": 1}]
DECODE = ["--gen-length", "16", "--slot-size", "4", "--num-blocks", "2",
          "--slot-threshold", "0.1", "--token-threshold", "0.1"]
CHAT = {"hf": ["Write a function.", "What is 2 + 2?"], "spm": QUESTIONS[:2]}  # chat test


def _lm_eval(capsys, argv):
    from pipeline.lm_eval import main
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _write_jsonl(path, records):
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def _gen_task(folder, name, data, until):
    (folder / f"{name}.yaml").write_text(json.dumps({
        "task": name, "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
        "output_type": "generate_until", "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}", "generation_kwargs": {"until": until},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                         "higher_is_better": True}]}))


def _read_output(out_dir, task):
    (res,) = Path(out_dir).rglob("results_*.json")
    (samples,) = Path(out_dir).rglob(f"samples_{task}_*.jsonl")
    return (json.loads(res.read_text()),
            sorted((json.loads(line) for line in samples.read_text().splitlines()),
                   key=lambda s: s["doc_id"]))


def _cut(text, until):
    return min((text[:text.find(s)] for s in until if s in text), key=len, default=text)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tp1):
    """The SPM tiny model, the AR generations of `pipeline.generate --raw` for QUESTIONS,
    and a task folder: `tiny_gen` (stops chosen inside the first AR generation, the first
    doc's target = its AR answer), `tiny_mc` (multiple choice) and `tiny_chat_hf` /
    `tiny_chat_spm` (the CHAT questions). One folder: the harness indexes its built-in tasks
    anew for every --include_path (`pipeline.lm_eval.task_manager` keeps one index per path)."""
    root = tmp_path_factory.mktemp("lm_eval")
    folder = make_spm_model_folder(root / "model")
    prompts = root / "prompts.jsonl"
    _write_jsonl(prompts, [{"prompt": q} for q in QUESTIONS])
    ar = [r["text"] for r in _generate(["--model", str(folder), "--prompts", str(prompts),
                                                "--mode", "ar", "--raw"] + DECODE)]
    k = len(ar[0]) // 2
    assert k >= 1, ar
    until = [ar[0][k:k + 2], "\n"]
    answers = [_cut(ar[0], until)] + ["no such answer"] * (len(QUESTIONS) - 1)
    tasks = root / "tasks"
    tasks.mkdir()
    _write_jsonl(root / "gen.jsonl", [{"question": q, "answer": a}
                                      for q, a in zip(QUESTIONS, answers)])
    _gen_task(tasks, "tiny_gen", root / "gen.jsonl", until)
    _write_jsonl(root / "mc.jsonl", MC)
    (tasks / "tiny_mc.yaml").write_text(json.dumps({
        "task": "tiny_mc", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(root / "mc.jsonl")}},
        "test_split": "test", "output_type": "multiple_choice",
        "doc_to_text": "Q: {{question}}\nA:", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    for kind, qs in CHAT.items():
        _write_jsonl(root / f"chat_{kind}.jsonl", [{"question": q, "answer": "a"} for q in qs])
        _gen_task(tasks, f"tiny_chat_{kind}", root / f"chat_{kind}.jsonl", ["\n\n\n\n"])
    return SimpleNamespace(root=root, folder=folder, prompts=prompts, tasks=tasks, until=until,
                           answers=answers, ar=ar)


def _generate(argv) -> list[dict]:
    """`python -m pipeline.generate ARGV --json` in this process: its per-prompt results."""
    import contextlib
    import io
    from pipeline.generate import main
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv + ["--json"]) == 0
    return json.loads(buf.getvalue())["results"]


def _hf_logprobs(folder, ids):
    """log_softmax of transformers' Qwen3 logits for one unpadded sequence: FloatTensor[T, V]."""
    from transformers import Qwen3ForCausalLM
    model = _hf_logprobs.cache.get(str(folder))
    if model is None:
        model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        _hf_logprobs.cache[str(folder)] = model
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)


_hf_logprobs.cache = {}


@pytest.mark.parametrize("mode", ["ar", "refusion"])
def test_generations_equal_pipeline_generate_and_results_carry_settings(setup, capsys, mode,
                                                                         tmp_path):
    results = _generate(["--model", str(setup.folder), "--prompts", str(setup.prompts),
                         "--mode", mode, "--raw"] + DECODE)
    expected = [r["text"] for r in results]
    if mode == "ar":
        assert expected == setup.ar
    rc, out, err = _lm_eval(capsys, ["--model", str(setup.folder), "--mode", mode] + DECODE + [
        "--tasks", "tiny_gen,tiny_mc", "--include_path", str(setup.tasks), "--batch_size", "3",
        "--output_path", str(tmp_path), "--log_samples"])
    assert rc == 0, err
    doc, samples = _read_output(tmp_path, "tiny_gen")
    got = [s["resps"][0][0] for s in samples]
    cut = [_cut(t, setup.until) for t in expected]
    assert got == cut
    if mode == "ar":  # the stop sequences did cut, and exact match scored the known answer
        assert cut[0] != expected[0] and cut[0] == setup.answers[0]
    em = sum(c == a for c, a in zip(cut, setup.answers)) / len(cut)
    assert doc["results"]["tiny_gen"]["exact_match,none"] == pytest.approx(em)
    if mode == "ar":
        assert em == pytest.approx(1 / len(QUESTIONS))
    # Our settings and speed figures beside the harness's metrics.
    ours = doc["config"]["refusion"]
    assert ours["settings"]["mode"] == mode and ours["settings"]["gen_length"] == 16
    assert ours["settings"]["slot_size"] == 4 and ours["settings"]["num_blocks"] == 2
    assert ours["settings"]["slot_threshold"] == 0.1 and ours["settings"]["batch_size"] == 3
    g = ours["generation"]
    assert g["prompts"] == len(QUESTIONS)
    assert g["tokens"] == sum(r["tokens"] for r in results)
    assert g["forwards"] == sum(r["forwards"] for r in results)
    assert g["tpf"] == pytest.approx(g["tokens"] / g["forwards"])
    assert g["tps"] == pytest.approx(g["tokens"] / g["seconds"]) and g["tps"] > 0
    assert f"TPF {g['tpf']:.2f}" in out and "tiny_gen" in out


def test_loglikelihoods_equal_log_softmax_of_transformers_logits(setup, capsys, tmp_path):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(setup.folder / "tokenizer.model"))
    bos = sp.bos_id()
    rc, _, err = _lm_eval(capsys, ["--model", str(setup.folder), "--mode", "ar",
                                   "--tasks", "tiny_mc", "--include_path", str(setup.tasks),
                                   "--batch_size", "4", "--output_path", str(tmp_path),
                                   "--log_samples"])
    assert rc == 0, err
    doc, samples = _read_output(tmp_path, "tiny_mc")
    correct = []
    n = 0
    for s, rec in zip(samples, MC):
        scores = []
        for j, choice in enumerate(rec["choices"]):
            args = s["arguments"][f"gen_args_{j}"]
            ctx, cont = args["arg_0"], args["arg_1"]
            assert ctx == f"Q: {rec['question']}\nA:" and cont == " " + choice
            # The harness's split: continuation ids = ids(ctx + cont) after ids(ctx).
            ctx_ids = [bos] + sp.encode(ctx)
            whole = [bos] + sp.encode(ctx + cont)
            cont_ids = whole[len(ctx_ids):]
            lp = _hf_logprobs(setup.folder, whole)
            rows = lp[len(ctx_ids) - 1:len(whole) - 1]
            want = rows.gather(-1, torch.tensor(cont_ids)[:, None]).sum().item()
            greedy = bool((rows.argmax(-1) == torch.tensor(cont_ids)).all())
            got, got_greedy = s["resps"][j][0]
            assert float(got) == pytest.approx(want, rel=1e-4, abs=1e-4)
            assert (got_greedy == "True") == greedy
            scores.append(want)
            n += 1
        correct.append(float(max(range(len(scores)), key=scores.__getitem__) == rec["label"]))
    assert n == 5
    assert doc["results"]["tiny_mc"]["acc,none"] == pytest.approx(sum(correct) / len(correct))


def test_loglikelihood_rolling_and_greedy_flag(setup, monkeypatch):
    """Whole-text scoring (one window, and several windows when max_length is small) and a
    continuation that is the model's own greedy choice."""
    from lm_eval import utils
    from pipeline.lm_eval import RefusionLM
    lm = RefusionLM(pretrained=str(setup.folder), mode="ar", batch_size=2)
    sp = lm.loaded.tokenizer.sp
    bos = sp.bos_id()
    texts = ["def dumps(obj, *, skipkeys=False):", "import json\nprint(json.dumps([1, 2]))"]
    req = [SimpleNamespace(args=(t,)) for t in texts]
    for t, got in zip(texts, lm.loglikelihood_rolling(req)):
        ids = [bos] + sp.encode(t)
        lp = _hf_logprobs(setup.folder, ids)
        want = lp[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).sum().item()
        assert got == pytest.approx(want, rel=1e-4)
    monkeypatch.setattr(RefusionLM, "max_length", property(lambda self: 8))
    t = texts[1]
    windows = list(map(utils.make_disjoint_window, utils.get_rolling_token_windows(
        token_list=sp.encode(t), prefix_token=bos, max_seq_len=8, context_len=1)))
    assert len(windows) > 2
    want = 0.0
    for ctx, pred in windows:
        seq = (ctx + pred)[-9:]
        lp = _hf_logprobs(setup.folder, seq[:-1] + [seq[-1]])
        want += lp[len(seq) - 1 - len(pred):len(seq) - 1].gather(
            -1, torch.tensor(pred)[:, None]).sum().item()
    (got,) = lm.loglikelihood_rolling([SimpleNamespace(args=(t,))])
    assert got == pytest.approx(want, rel=1e-4)
    monkeypatch.undo()
    # Greedy flag: the continuation is the model's own two greedy tokens.
    ctx = [bos] + sp.encode("def load(fp):")
    seq = list(ctx)
    for _ in range(2):
        seq.append(int(_hf_logprobs(setup.folder, seq)[-1].argmax()))
    ((score, greedy), (_, other)) = lm._loglikelihood_tokens(
        [(None, ctx, seq[len(ctx):]), (None, ctx, [seq[len(ctx)], (seq[-1] + 1) % 400])])
    assert greedy is True and other is False
    lp = _hf_logprobs(setup.folder, seq)
    assert score == pytest.approx(lp[len(ctx) - 1, seq[-2]].item() + lp[len(ctx), seq[-1]].item(),
                                  rel=1e-4)


@pytest.mark.parametrize("kind", ["hf", "spm"])
def test_chat_template_as_pipeline_generate(setup, capsys, tmp_path, kind):
    """--apply_chat_template: the harness's chat turn, rendered by our apply_chat_template and
    encoded, decodes what `pipeline.generate` (chat-wrapped prompts) decodes. HF: a Qwen3
    tokenizer folder (its template); SentencePiece: the data pipeline's turn pieces."""
    if kind == "hf":
        folder = make_tiny_qwen3(tmp_path / "qwen", seed=3, with_tokenizer=True, hidden_size=16,
                                 head_dim=8, intermediate_size=32, num_attention_heads=2,
                                 num_key_value_heads=1)
        rendered = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    else:
        folder, rendered = setup.folder, "<|user|>{}<|assistant|>"
    qs, task = CHAT[kind], f"tiny_chat_{kind}"
    _write_jsonl(tmp_path / "p.jsonl", [{"prompt": q} for q in qs])
    expected = [r["text"] for r in _generate([
        "--model", str(folder), "--prompts", str(tmp_path / "p.jsonl"), "--mode", "ar",
        "--gen-length", "6"])]
    rc, _, err = _lm_eval(capsys, ["--model", str(folder), "--mode", "ar", "--gen-length", "6",
                                   "--tasks", task, "--include_path", str(setup.tasks),
                                   "--apply_chat_template", "--output_path",
                                   str(tmp_path / "out"), "--log_samples"])
    assert rc == 0, err
    doc, samples = _read_output(tmp_path / "out", task)
    assert [s["arguments"]["gen_args_0"]["arg_0"] for s in samples] == [
        rendered.format(q) for q in qs]
    assert [s["resps"][0][0] for s in samples] == [_cut(t, ["\n\n\n\n"]) for t in expected]
    assert doc["config"]["refusion"]["settings"]["mode"] == "ar"


def test_harness_cli_runs_model_refusion(setup, tmp_path, capsys):
    """`python -m pipeline.lm_eval run --model refusion --model_args ...` is the harness's CLI."""
    from pipeline.lm_eval import main
    assert main(["run", "--model", "refusion", "--model_args",
                 f"pretrained={setup.folder},mode=refusion,gen_length=8,slot_size=4,"
                 f"num_blocks=1,token_threshold=0.2", "--tasks", "tiny_gen",
                 "--include_path", str(setup.tasks), "--limit", "2",
                 "--output_path", str(tmp_path)]) == 0
    (res,) = tmp_path.rglob("results_*.json")
    doc = json.loads(res.read_text())
    ours = doc["config"]["refusion"]
    assert ours["settings"]["gen_length"] == 8 and ours["settings"]["num_blocks"] == 1
    assert ours["settings"]["token_threshold"] == 0.2 and ours["generation"]["prompts"] == 2
    assert doc["results"]["tiny_gen"]["sample_len"] == 2


@pytest.mark.parametrize("extra, message", [
    ([], "--tasks: give one or more task names"),
    (["--tasks", "tiny_gen,tiny_gn"], "--tasks tiny_gn: no such task"),
    (["--tasks", "gsm8kk"], "did you mean gsm8k"),
    (["--tasks", "tiny_mc", "--num-blocks", "3"], "--num-blocks 3 must divide"),
    (["--tasks", "tiny_mc", "--model", "/nonexistent/model"], "--model /nonexistent/model"),
    (["--tasks", "tiny_mc", "--include_path", "/nonexistent/tasks"], "/nonexistent/tasks: not a"),
    (["--tasks", "tiny_mc", "--device", "gpu"], "--device gpu: expected auto, cpu, cuda"),
])
def test_bad_tasks_and_options_exit_2_with_one_line(setup, capsys, extra, message):
    rc, _, err = _lm_eval(capsys, ["--model", str(setup.folder), "--include_path",
                                   str(setup.tasks)] + extra)
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1, err
