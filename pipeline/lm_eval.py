"""Benchmarks through EleutherAI's lm-evaluation-harness: our model as a harness model type.

    python -m pipeline.lm_eval --model HF_DIR_OR_CHECKPOINT --tasks gsm8k,humaneval,...
        [--mode refusion|ar] [decoding options of pipeline.generate: --gen-length, --slot-size,
        --num-blocks, --slot-threshold, --token-threshold, --temperature, --exact-cache, --seed,
        --dtype, --device, --tokenizer, --batch-size N] [harness options: --limit N,
        --output DIR, --include-path DIR, --log-samples, --num-fewshot N,
        --apply-chat-template, --fewshot-as-multiturn, --system-instruction TEXT,
        --confirm-run-unsafe-code (the harness's underscore spellings are accepted too)]
    python -m pipeline.lm_eval run --model refusion --model_args pretrained=PATH,mode=ar,...
        [any option of the harness's own `lm_eval run`]     (also: `refusion-lm-eval ...`)

Owns: `RefusionLM`, the harness model class registered as `refusion`, and the CLI above.
Must not touch: the decoding algorithms (`pipeline.inference.decoding`), model loading
(`pipeline.inference.loading.load_for_inference`), task definitions and metrics (the harness's).

The harness (lm-eval 0.4.x) asks a model for three things:
- `generate_until(context, {"until": [...], ...})`: the context is encoded as
  `pipeline.generate --raw` encodes text (SentencePiece BOS in front when the tokenizer has
  one), except that special-token strings in it become their ids (`RefusionLM.tok_encode`),
  left-truncated to `max_length - gen_length` tokens, decoded in batches of `--batch-size` with
  `pipeline.generate.decode_batch` (the same call as `python -m pipeline.generate`: refusion
  plan-and-infill or ar), the text cut at the first occurrence of any `until` string. The
  generation length is `--gen-length` (verify authors / correct: rounded up to whole slots),
  not the task's `max_gen_toks`, and the sampling options are ours, not the task's
  `temperature`/`do_sample` (the authors' harness class does the same: a fixed generation
  region per run).
- `loglikelihood(context, continuation)` -> `(sum of log p(continuation token | prefix),
  is_greedy)`: AR scoring with the causal forward (ReFusion trains clean tokens on next-token
  prediction), contexts and continuations split as the harness's `TemplateLM` does, batched
  with right padding (padding is its own segment), log-softmax in float32 (float64 for a
  float64 model); `is_greedy` = every continuation token is the argmax.
- `loglikelihood_rolling(text)`: the harness's rolling windows of `max_length` tokens, each
  scored as above, summed.
`max_length` is the model's `max_position_embeddings`. With `--apply-chat-template` the
harness renders its chat turns with `apply_chat_template` (Hugging Face tokenizers: the
tokenizer's template, exactly what `pipeline.generate` does for a prompt; SentencePiece: the
data pipeline's `<|user|> ... <|assistant|>` layout) and the result is encoded as above.

The results file (`--output`) carries, in `config.refusion`, the decoding settings and the
generation figures of the run: prompts, tokens, forwards, seconds, TPF (generated tokens /
forwards) and TPS (generated tokens / decode wall seconds), measured after one untimed warm-up
decode as in `pipeline.generate`. Sampling (`--temperature` > 0) depends on the batch a prompt
lands in (see `pipeline.generate`); greedy decoding does not. `--seed` is the decoding seed; the
harness's own seeds (few-shot sampling) keep its defaults.

The harness has no plugin entry point for model types in lm-eval 0.4.13: the bare `lm_eval`
command cannot see `refusion`; `python -m pipeline.lm_eval run ...` (or the `refusion-lm-eval`
script) is the harness's CLI with `refusion` registered, and `import pipeline.lm_eval` does the
same for `lm_eval.simple_evaluate(model="refusion", ...)` in Python.
Exit codes: 0 done; 2 usage or input error (one line on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

try:
    import lm_eval.models  # noqa: F401  (the harness's own model names, before we add ours)
except ImportError as _e:  # the optional `eval` extra
    if __name__ == "__main__":
        print(f"error: lm-evaluation-harness is not installed ({_e}); "
              f"pip install 'refusion-pipeline[eval]'", file=sys.stderr)
        sys.exit(2)
    raise
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from pipeline.common.cli import DTYPES, UsageError, hidden_alias
from pipeline.inference.cli import (DECODING_DEFAULTS, add_decoding_args, check_decoding_args,
                                    decode_batch, lossless_note, warm_up)
from pipeline.inference.loading import load_for_inference

HARNESS_COMMANDS = ("run", "ls", "validate")
_log = logging.getLogger(__name__)


def _as_bool(v) -> bool:
    if isinstance(v, str):
        if v.strip().lower() in ("1", "true", "yes"):
            return True
        if v.strip().lower() in ("0", "false", "no", ""):
            return False
        raise UsageError(f"expected true/false, got {v!r}")
    return bool(v)


def cut_at_stop(text: str, until) -> str:
    """`text` up to (excluding) the earliest occurrence of any non-empty string of `until`
    (a string or a list of strings; None = no stop)."""
    if isinstance(until, str):
        until = [until]
    cut = len(text)
    for s in until or ():
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


@register_model("refusion")
class RefusionLM(TemplateLM):
    """Our Qwen3 (`pipeline.model.Qwen3`, TP=1) as an lm-evaluation-harness model.

    Args (all also accepted as strings, as the harness's `--model_args` gives them):
        pretrained: HF folder or training checkpoint (`pipeline.inference.loading.load_for_inference`).
        mode: "refusion" (plan-and-infill) or "ar" (left to right) for `generate_until`.
        gen_length, slot_size, num_blocks, slot_threshold, token_threshold, temperature,
            exact_cache, seed, verify: decoding options, as `python -m pipeline.generate`
            (defaults: its defaults).
        batch_size: prompts decoded / sequences scored together (int).
        dtype: "float32" | "bfloat16" | "float16" | "float64" (parameter dtype; None: bf16 on
            CUDA, fp32 on the CPU).
        device: "auto" / None (CUDA when available, else the CPU), "cpu", "cuda", "cuda:N".
            CUDA asked for where there is none falls back to the CPU with a warning (the
            harness CLI passes cuda:0 by default, as it does for its own HF model).
        tokenizer: tokenizer path (None: the model's).
        max_batch_size: accepted (the harness passes it) and unused.

    Raises:
        UsageError: bad paths, out-of-range options, unknown dtype, `batch_size=auto`.
    """

    def __init__(self, pretrained=None, mode: str = "refusion",
                 gen_length=DECODING_DEFAULTS["gen_length"],
                 slot_size=DECODING_DEFAULTS["slot_size"],
                 num_blocks=DECODING_DEFAULTS["num_blocks"],
                 slot_threshold=DECODING_DEFAULTS["slot_threshold"],
                 token_threshold=DECODING_DEFAULTS["token_threshold"],
                 temperature=DECODING_DEFAULTS["temperature"],
                 exact_cache=DECODING_DEFAULTS["exact_cache"], seed=DECODING_DEFAULTS["seed"],
                 batch_size=DECODING_DEFAULTS["batch_size"], dtype=None, device=None,
                 verify=DECODING_DEFAULTS["verify"], tokenizer=None, max_batch_size=None,
                 **kwargs):
        super().__init__()
        if kwargs:
            raise UsageError(f"--model_args: unknown key(s) {', '.join(sorted(kwargs))} for "
                             f"model refusion")
        if pretrained is None:
            raise UsageError("--model_args: pretrained=PATH (HF folder or checkpoint) is needed")
        if mode not in ("refusion", "ar"):
            raise UsageError(f"mode {mode!r}: expected refusion or ar")
        if dtype is not None and str(dtype) not in DTYPES:
            raise UsageError(f"dtype {dtype!r}: expected one of {', '.join(sorted(DTYPES))}")
        try:
            bs = int(batch_size) if batch_size is not None else DECODING_DEFAULTS["batch_size"]
        except ValueError:
            raise UsageError(f"batch_size {batch_size!r}: give an integer (no 'auto' for "
                             f"model refusion)")
        try:
            s = SimpleNamespace(
                model=str(pretrained), mode=mode, gen_length=int(gen_length),
                slot_size=int(slot_size), num_blocks=int(num_blocks),
                slot_threshold=float(slot_threshold),
                token_threshold=None if token_threshold is None else float(token_threshold),
                temperature=float(temperature), exact_cache=_as_bool(exact_cache),
                seed=int(seed), batch_size=bs, dtype=None if dtype is None else str(dtype),
                verify=str(verify),
                tokenizer=tokenizer)
        except ValueError as e:
            raise UsageError(f"--model_args: {e}")
        check_decoding_args(s, refusion=mode == "refusion")
        if mode == "refusion" and lossless_note(s):   # here: both lm_eval entry points
            print(lossless_note(s), file=sys.stderr)
        # The harness CLI passes cuda:0 by default, also on a CPU machine.
        device = pick_device(device, cuda_fallback=True)
        if s.dtype is None:
            s.dtype = "bfloat16" if device.type == "cuda" else "float32"
        self.settings = s
        self.loaded = _load(s.model, s.tokenizer, DTYPES[s.dtype], device)
        self._device = device
        tok = self.loaded.tokenizer
        self._spm = hasattr(tok, "sp")
        # The harness reads `tokenizer` for its chat-template and tokenizer metadata.
        self.tokenizer = None if self._spm else tok.tok
        self._stats = Counter()
        self._forwards = Counter()
        self._warmed = False

    # ---------------------------------------------------------------- harness properties
    @property
    def eot_token_id(self) -> int:
        return self.loaded.eos_id

    @property
    def prefix_token_id(self) -> int:
        """Context of an empty-context request and of the first rolling window: the
        SentencePiece BOS when there is one, else EOS (Qwen3 has no BOS; as the harness's HF
        model)."""
        bos = self.loaded.tokenizer.info.bos_id
        return bos if (self._spm and bos is not None) else self.loaded.eos_id

    @property
    def max_length(self) -> int:
        return int(self.loaded.model.cfg.max_position_embeddings)

    @property
    def batch_size(self) -> int:
        return self.settings.batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(self.loaded.tokenizer.path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        """Token ids of prompt text as the harness renders it (no chat wrapping added here).

        Special-token strings in it become their ids, as the harness's own HF model encodes
        (a chat-templated context holds the template's markers as text): Hugging Face
        tokenizers parse their special tokens; for SentencePiece the turn strings `<|user|>` /
        `<|assistant|>` become their pieces and the text between is encoded as text (so a
        rendered one-turn chat equals `Tokenizer.prompt_ids`). Text without special strings
        encodes as `pipeline.generate --raw` does; the SentencePiece BOS goes in front unless
        `add_special_tokens` is False.
        """
        tok = self.loaded.tokenizer
        if not self._spm:
            return self.tokenizer.encode(string, add_special_tokens=False)
        import re
        from pipeline.tokenizer import SPM_ASSISTANT, SPM_USER
        turns = {SPM_USER: tok.user_id, SPM_ASSISTANT: tok.assistant_id}
        ids = []
        for part in re.split("(" + "|".join(map(re.escape, turns)) + ")", string):
            if part in turns:
                ids.append(turns[part])
            elif part:
                ids.extend(tok.encode(part))
        if add_special_tokens is not False and tok.info.bos_id is not None:
            ids = [tok.info.bos_id] + ids
        return ids

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt=True) -> str:
        """Chat turns as prompt text: the HF tokenizer's template (as `pipeline.generate` and
        the data pipeline wrap a query), or for SentencePiece `<|user|>text<|assistant|>text...`
        (system text goes in front)."""
        if not self._spm:
            return self.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt)
        from pipeline.tokenizer import SPM_ASSISTANT, SPM_USER
        out = []
        for m in chat_history:
            tag = {"user": SPM_USER, "assistant": SPM_ASSISTANT}.get(m["role"], "")
            out.append(tag + m["content"])
        if add_generation_prompt:
            out.append(SPM_ASSISTANT)
        return "".join(out)

    # ---------------------------------------------------------------- scoring
    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """Score `[(cache_key | None, context_ids, continuation_ids)]` with the causal forward.

        The input is `(context + continuation)[-(max_length + 1):][:-1]`; the logits at its
        last `len(continuation)` positions score the continuation. Returns per request
        `(sum of log-probabilities: float, every token the argmax: bool)`, in request order.
        """
        from pipeline.model import gather_logits
        model = self.loaded.model
        order = sorted(range(len(requests)),
                       key=lambda i: -len(requests[i][1]) - len(requests[i][2]))
        out: list = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            idx = order[start:start + self.batch_size]
            inps, conts = [], []
            for i in idx:
                _, ctx, cont = requests[i]
                if len(cont) > self.max_length:
                    raise UsageError(f"a continuation of {len(cont)} tokens exceeds the "
                                     f"model's {self.max_length} positions")
                inps.append((list(ctx) + list(cont))[-(self.max_length + 1):][:-1])
                conts.append(list(cont))
            t = max(len(x) for x in inps)
            ids = torch.zeros(len(inps), t, dtype=torch.long)
            seg = torch.zeros(len(inps), t, dtype=torch.long)
            for b, x in enumerate(inps):
                ids[b, :len(x)] = torch.tensor(x)
                seg[b, :len(x)] = 1
            pos = torch.arange(t).expand(len(inps), t)
            dev = self._device
            # Hidden states, then the output layer only at each row's continuation positions
            # (the full logits of a batch of long sequences would be gigabytes).
            hidden = model(ids.to(dev), pos.to(dev), segment_ids=seg.to(dev), return_hidden=True)
            for b, i in enumerate(idx):
                n, c = len(inps[b]), conts[b]
                if not c:
                    out[i] = (0.0, True)
                    continue
                logits = gather_logits(model.head_logits(hidden[b, n - len(c):n]))
                wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
                lp = F.log_softmax(logits.to(wide), dim=-1)
                target = torch.tensor(c, device=lp.device)
                score = lp.gather(-1, target[:, None])[:, 0].sum().item()
                greedy = bool((lp.argmax(-1) == target).all())
                out[i] = (score, greedy)
                key = requests[i][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, out[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts: the harness's disjoint rolling windows of
        `max_length` tokens after `prefix_token_id`, each scored by `_loglikelihood_tokens`."""
        from lm_eval import utils
        windows, owner = [], []
        for r, (text,) in enumerate(req.args for req in requests):
            for w in map(utils.make_disjoint_window, utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text, add_special_tokens=False),
                    prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None,) + w)
                owner.append(r)
        scores = self._loglikelihood_tokens(windows)
        totals = [0.0] * len(requests)
        for r, (lp, _) in zip(owner, scores):
            totals[r] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decode every request's context with our decoder (module docstring); returns the
        decoded texts cut at the request's `until` strings, in request order."""
        s = self.settings
        g = s.gen_length
        if s.mode == "refusion":
            g = -(-g // s.slot_size) * s.slot_size
        keep = self.max_length - g
        if keep < 1:
            raise UsageError(f"--gen-length {g} leaves no room for a prompt in the model's "
                             f"{self.max_length} positions")
        prompts = []
        for req in requests:
            ids = self.tok_encode(req.args[0])
            prompts.append(ids[-keep:] if ids else [self.prefix_token_id])
        if prompts and not self._warmed:
            warm_up(self.loaded, prompts[0])
            self._warmed = True
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        texts: list = [None] * len(prompts)
        for start in range(0, len(order), s.batch_size):
            idx = order[start:start + s.batch_size]
            out = decode_batch(self.loaded, [prompts[i] for i in idx], s)
            self._stats["seconds"] += out.seconds
            for j, i in enumerate(idx):
                self._stats["prompts"] += 1
                self._stats["tokens"] += len(out.tokens[j])
                self._forwards.update(out.forwards[j])
                text = cut_at_stop(self.loaded.decode(out.tokens[j]),
                                   requests[i].args[1].get("until"))
                texts[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return texts

    def generation_figures(self) -> dict:
        """Totals over every `generate_until` call so far: prompts, tokens (generated, through
        EOS), forwards (per-prompt, summed; and by kind), seconds (decode wall time), tpf,
        tps (tokens per second)."""
        tokens, secs = self._stats["tokens"], self._stats["seconds"]
        forwards = sum(self._forwards.values())
        return {"mode": self.settings.mode, "prompts": self._stats["prompts"], "tokens": tokens,
                "forwards": forwards, "forwards_by_kind": dict(self._forwards),
                "seconds": secs, "tpf": tokens / forwards if forwards else 0.0,
                "tps": tokens / secs if secs else 0.0}

    def get_model_info(self) -> dict:
        """Added by the harness to the results' `config`: our settings and speed figures."""
        settings = {k: getattr(self.settings, k) for k in (
            "model", "mode", "gen_length", "slot_size", "num_blocks", "slot_threshold",
            "token_threshold", "temperature", "exact_cache", "verify", "seed", "batch_size",
            "dtype", "tokenizer")}
        settings["device"] = str(self._device)
        return {"refusion": {"settings": settings, "generation": self.generation_figures()}}


def pick_device(spec, cuda_fallback: bool = False) -> torch.device:
    """The device a `--device` value names: "auto" / None = CUDA when available, else the CPU;
    "cpu"; "cuda" / "cuda:N". CUDA asked for where there is none: the CPU with a warning when
    `cuda_fallback`, else UsageError (also raised for an unknown value)."""
    spec = "auto" if spec is None else str(spec).strip().lower()
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"--device {spec}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        if not cuda_fallback:
            raise UsageError(f"--device {spec}: CUDA is not available here")
        _log.warning("device %s: CUDA is not available here; using the cpu", spec)
        return torch.device("cpu")
    return device


def _load(model, tokenizer, dtype, device):
    """`load_for_inference` on `device` (moved there after loading where `load_for_inference`
    takes no device), stdout kept clean (DeepSpeed prints while consolidating a checkpoint)."""
    import inspect
    with contextlib.redirect_stdout(sys.stderr):
        if "device" in inspect.signature(load_for_inference).parameters:
            return load_for_inference(model, tokenizer, dtype, device=device)
        loaded = load_for_inference(model, tokenizer, dtype)
    loaded.model.to(device)
    return loaded


# -------------------------------------------------------------------------------------------
# CLI


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str | None):
    """The harness's task index (its built-in tasks plus `include_path`); building it reads
    every task definition (seconds), so it is kept per process."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=include_path)


def resolve_tasks(spec: str | None, include_path: str | None) -> list[str]:
    """Task names (or YAML paths) of a comma-separated `--tasks` value, each checked against
    the harness's index. Raises UsageError naming the first unknown task (with near names)."""
    import difflib
    names = [t.strip() for t in (spec or "").split(",") if t.strip()]
    if not names:
        raise UsageError("--tasks: give one or more task names (comma-separated; "
                         "`python -m pipeline.lm_eval ls tasks` lists them)")
    if include_path is not None and not Path(include_path).is_dir():
        raise UsageError(f"--include_path {include_path}: not a folder")
    tm = task_manager(include_path)
    out = []
    for name in names:
        if name.endswith(".yaml"):
            if not Path(name).is_file():
                raise UsageError(f"--tasks {name}: no such file")
            out.append(str(Path(name).absolute()))
            continue
        matched = tm.match_tasks([name])
        if not matched:
            near = difflib.get_close_matches(name, tm.all_tasks, n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            where = f" or in {include_path}" if include_path else ""
            raise UsageError(f"--tasks {name}: no such task in lm-eval{where}{hint}")
        out.extend(m for m in matched if m not in out)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pipeline.lm_eval",
        description="Run lm-evaluation-harness tasks on a ReFusion model (our decoder for "
                    "generation, AR scoring for log-likelihoods). `python -m pipeline.lm_eval "
                    "run ...` is the harness's own CLI with --model refusion available.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder or training checkpoint")
    p.add_argument("--mode", choices=("refusion", "ar"), default="refusion",
                   help="generation: plan-and-infill (refusion) or left-to-right (ar)")
    add_decoding_args(p)
    if "--device" not in p._option_string_actions:
        p.add_argument("--device", default="auto",
                       help="auto (CUDA when available), cpu, cuda or cuda:N")
    # The harness's options, same meaning as `lm_eval run`, in this project's spelling (dashes);
    # the harness's underscore spelling is accepted too (hidden aliases).
    h = p.add_argument_group("lm-evaluation-harness options")
    h.add_argument("--tasks", default=None, help="comma-separated task names or YAML files")
    h.add_argument("--limit", type=float, default=None,
                   help="examples per task (an integer count, or a fraction < 1)")
    for name, kw in (("num-fewshot", dict(type=int, default=None, help="few-shot examples")),
                     ("output", dict(dest="output_path", default=None, metavar="DIR",
                                     help="folder (or .json) for the results")),
                     ("log-samples", dict(action="store_true", help="also save every sample")),
                     ("include-path", dict(default=None, help="folder of extra task YAMLs")),
                     ("apply-chat-template", dict(nargs="?", const=True, default=False,
                                                  help="render prompts with the chat template")),
                     ("fewshot-as-multiturn", dict(action="store_true",
                                                   help="few-shot examples as chat turns (with "
                                                        "--apply-chat-template)")),
                     ("system-instruction", dict(default=None, help="system prompt text")),
                     ("confirm-run-unsafe-code", dict(action="store_true",
                                                      help="allow tasks that execute "
                                                           "model-written code (humaneval, "
                                                           "mbpp)"))):
        dest = kw.pop("dest", name.replace("-", "_"))
        h.add_argument(f"--{name}", dest=dest, **kw)
        old = "--output_path" if name == "output" else f"--{name.replace('-', '_')}"
        alias = {k: v for k, v in kw.items() if k in ("type", "action", "nargs", "const",
                                                      "metavar")}
        hidden_alias(h, old, dest=dest, **alias)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in HARNESS_COMMANDS:
        return harness_main(argv)
    args = build_parser().parse_args(argv)
    from lm_eval.utils import setup_logging
    setup_logging(logging.WARNING)
    try:
        check_decoding_args(args, refusion=args.mode == "refusion")
        if args.limit is not None and not args.limit > 0:
            raise UsageError(f"--limit {args.limit} must be > 0")
        pick_device(args.device)
        if args.output_path is None and args.log_samples:
            raise UsageError("--log-samples needs --output")
        tasks = resolve_tasks(args.tasks, args.include_path)
        model_args = {"pretrained": str(args.model), "mode": args.mode,
                      **{k: getattr(args, k) for k in (
                          "gen_length", "slot_size", "num_blocks", "slot_threshold",
                          "token_threshold", "temperature", "exact_cache", "verify", "seed",
                          "dtype", "tokenizer")}}
        results = evaluate(model_args, tasks, args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if results is None:
        return 0
    from lm_eval.utils import make_table
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    fig = results["config"]["refusion"]["generation"]
    if fig["prompts"]:
        print(f"=== {fig['mode']}: {fig['prompts']} prompts, {fig['tokens']} tokens, "
              f"{fig['forwards']} forwards, TPF {fig['tpf']:.2f}, TPS {fig['tps']:.1f}")
    return 0


def evaluate(model_args: dict, tasks: list[str], args) -> dict | None:
    """`lm_eval.simple_evaluate(model="refusion", ...)` with the harness flags of `args`, and
    the results (and samples with `--log_samples`) written by the harness's
    `EvaluationTracker` under `--output_path`. Returns the results dict (samples removed)."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    tracker = EvaluationTracker(output_path=args.output_path) if args.output_path else None
    limit = args.limit
    if limit is not None and limit >= 1:
        limit = int(limit)
    with contextlib.redirect_stdout(sys.stderr):
        try:
            results = simple_evaluate(
                model="refusion", model_args=model_args, tasks=tasks,
                num_fewshot=args.num_fewshot, batch_size=args.batch_size, device=args.device,
                limit=limit, log_samples=args.log_samples, evaluation_tracker=tracker,
                system_instruction=args.system_instruction,
                apply_chat_template=args.apply_chat_template,
                fewshot_as_multiturn=args.fewshot_as_multiturn,
                task_manager=task_manager(args.include_path),
                confirm_run_unsafe_code=args.confirm_run_unsafe_code)
        except ValueError as e:  # e.g. the model's own option checks, the harness's task checks
            raise UsageError(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if results is None:
        return None
    samples = results.pop("samples", None)
    if tracker is not None:
        tracker.save_results_aggregated(results=results,
                                        samples=samples if args.log_samples else None)
        if args.log_samples:
            for name in results["configs"]:
                tracker.save_results_samples(task_name=name, samples=samples[name])
    return results


def harness_main(argv=None) -> int:
    """The harness's own CLI (`lm_eval run|ls|validate ...`) with `--model refusion`
    registered (this module is imported). Console script: `refusion-lm-eval`. Returns the
    exit code: 0, or 2 after one line on stderr for a bad `--model_args` of ours (the
    harness's own errors are reported its way)."""
    from lm_eval.__main__ import cli_evaluate
    argv = list(sys.argv[1:] if argv is None else argv)
    saved = sys.argv
    sys.argv = ["lm_eval"] + argv
    try:
        cli_evaluate()
    except UsageError as e:  # our model's option checks
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
