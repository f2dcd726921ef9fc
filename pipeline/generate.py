"""Decoding CLI: text in, text out, with tokens, forwards, TPF and TPS per prompt.

    python -m pipeline.generate --model HF_DIR_OR_CHECKPOINT (--prompt TEXT | --prompts FILE.jsonl)
        [--mode refusion|ar] [--gen-length N] [--slot-size K] [--num-blocks B]
        [--slot-threshold X] [--token-threshold Y] [--temperature T] [--batch-size N]
        [--exact-cache] [--verify authors|correct|draft_ahead|draft_every]
        [--mask-attention causal|bidirectional] [--raw]
        [--tokenizer PATH]
        [--device auto|cpu|cuda[:N]] [--dtype float32|bfloat16|float16|float64]
        [--seed S] [--json] [--output FILE]

Owns: this command's options (prompts, mode, output), batching and printing. Must not touch:
the decoding algorithms (`pipeline.inference.decoding`), loading (`pipeline.inference.loading`),
the decoding options shared with the other CLIs (`pipeline.inference.cli`).

`--model` is a Hugging Face Qwen3 folder, or a training checkpoint (a step folder or a
checkpoint root, recognised by `pipeline.checkpoint`; its fp32 master weights are consolidated
one tensor at a time straight into the model, no Hugging Face folder is written).
`--device auto` (default) decodes on CUDA when available (`cuda:<LOCAL_RANK mod GPUs>`), else
on the CPU; the parameter dtype defaults to bfloat16 on CUDA, float32 on the CPU (`--dtype`).
The model is built on the meta device and materialized on the target device in that dtype. The tokenizer comes from the model folder: Hugging Face tokenizer files, else a
SentencePiece `tokenizer.model`; `--tokenizer` overrides. Prompts are wrapped as the data
pipeline wraps queries (`pipeline.tokenizer`: the chat template, or `<s> <|user|> query
<|assistant|>` for SentencePiece); `--raw` feeds the text as is (continuation). The mask and
EOS ids are the tokenizer's.

`--gen-length` is an upper bound on generated tokens; in refusion mode it is rounded up to a
multiple of `--slot-size` (the generation region is whole slots, docs/METHOD.md), so
`--gen-length 10 --slot-size 4` may give 12 tokens.
Sampling (`--temperature` > 0) draws from one generator per batch, seeded by `--seed`, so a
prompt's sample depends on the batch it is decoded in (`--batch-size`, the other prompts and
their order) as well as on the seed; greedy decoding (temperature 0) does not.
`--prompts FILE.jsonl`: one JSON object per line with a "prompt" (or "query") string.
`--json` / `--output FILE`: {"settings": the model and decoding options used (mode, gen_length,
slot_size, num_blocks, thresholds, temperature, seed, exact_cache, verify, ...), "summary",
"results"}.
TPS = a prompt's generated tokens / wall seconds of its batch (tokens per second), measured
after one short untimed warm-up decode, the device synchronized before each clock reading.
Exit codes: 0 done; 2 usage or input error (one line on stderr).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

from pipeline.common.cli import EXIT_USAGE, UsageError, hidden_alias
from pipeline.inference.cli import (add_decoding_args, check_decoding_args, check_json_out,
                                    decode_batch, decoding_settings, load_model_from_args,
                                    lossless_note, read_prompts_jsonl, warm_up)
from pipeline.inference.loading import prompt_ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.generate",
                                description="Decode prompts with a ReFusion model.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder or training checkpoint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt text")
    src.add_argument("--prompts", help="JSONL file, one {\"prompt\": ...} per line")
    p.add_argument("--mode", choices=("refusion", "ar"), default="refusion",
                   help="plan-and-infill (refusion) or left-to-right (ar) decoding")
    p.add_argument("--raw", action="store_true", help="feed prompts as plain text")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--output", dest="json_out", default=None, metavar="FILE",
                   help="also write the JSON document to this file")
    hidden_alias(p, "--json-out", dest="json_out")
    add_decoding_args(p)
    args = p.parse_args(argv)
    try:
        check_decoding_args(args, refusion=args.mode == "refusion")
        if args.mode == "refusion" and lossless_note(args):
            print(lossless_note(args), file=sys.stderr)
        check_json_out(args.json_out)
        if args.prompt is not None:
            texts = [args.prompt]
        else:
            texts = []
            for n, rec in enumerate(read_prompts_jsonl(args.prompts), 1):
                t = rec.get("prompt", rec.get("query"))
                if not isinstance(t, str):
                    raise UsageError(f"{args.prompts}: record {n} has no \"prompt\" string")
                texts.append(t)
        # Libraries print progress to stdout (DeepSpeed's consolidation, its logger): keep
        # stdout for our output only.
        with contextlib.redirect_stdout(sys.stderr):
            loaded = load_model_from_args(args)
        results, seconds = [], 0.0
        warm_up(loaded, prompt_ids(loaded, texts[0], args.raw))
        for i in range(0, len(texts), args.batch_size):
            chunk = texts[i:i + args.batch_size]
            ids = [prompt_ids(loaded, t, args.raw) for t in chunk]
            try:
                out = decode_batch(loaded, ids, args)
            except ValueError as e:
                raise UsageError(str(e))
            seconds += out.seconds
            for j, t in enumerate(chunk):
                results.append({"prompt": t, "text": loaded.decode(out.tokens[j]),
                                "token_ids": out.tokens[j], **out.stats(j)})
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    total_tokens = sum(r["tokens"] for r in results)
    total_forwards = sum(r["forwards"] for r in results)
    summary = {"mode": args.mode, "prompts": len(results), "tokens": total_tokens,
               "forwards": total_forwards, "seconds": seconds,
               "tpf": total_tokens / total_forwards if total_forwards else 0.0,
               "tps": total_tokens / seconds if seconds else 0.0}
    doc = {"settings": decoding_settings(args, args.mode), "summary": summary,
           "results": results}
    if args.json_out:
        from pipeline.common.atomic_io import write_json
        write_json(args.json_out, doc)
    if args.json:
        print(json.dumps(doc, indent=1))
        return 0
    for r in results:
        print(f"=== prompt: {r['prompt'][:200]!r}")
        print(r["text"])
        print(f"--- tokens {r['tokens']}  forwards {r['forwards']} "
              f"{dict(r['forwards_by_kind'])}  TPF {r['tpf']:.2f}  TPS {r['tps']:.1f}")
    print(f"=== {args.mode}: {len(results)} prompts, {total_tokens} tokens, "
          f"{total_forwards} forwards, TPF {summary['tpf']:.2f}, TPS {summary['tps']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
