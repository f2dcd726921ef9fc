"""`python data_prep/train_tokenizer.py`: train a SentencePiece BPE tokenizer for ReFusion.

Owns: training a SentencePiece model on any input `data_prep/shard.py` reads (same
`--input` values, same record normalization), with the pieces the pipeline needs:
ids 0..3 = `<pad>`, `<unk>`, `<s>` (bos), `</s>` (eos), then `<|mask|>`, `<|user|>`,
`<|assistant|>` as single pieces (user-defined symbols), byte fallback (every string
encodes), identity normalization and no whitespace folding (code round-trips exactly:
`decode(encode(s)) == s`).
Must not touch: shards (shard.py), the Hugging Face path (pipeline/tokenizer.py).

Training text: each text document, each query/response pair as `query + response` and each
chat conversation as its messages' contents in order (roles left out), cut
at line boundaries into pieces of about `--piece-chars` characters (SentencePiece drops
"sentences" longer than its max_sentence_length). Training is deterministic for the same
inputs and options (no sentence shuffling; the first `--max-sentences` pieces are used).
"""
from __future__ import annotations

import errno
import hashlib
import io
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: import the repository's data_prep package
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import fsspec

from pipeline.common.cli import EXIT_DISK_FULL, EXIT_USAGE

from data_prep.sources import (Fields, InputError, OneLineParser, TextFile, iter_records,
                               normalize, resolve_inputs, url_to_fs)
from pipeline.tokenizer import SPM_ASSISTANT, SPM_MASK, SPM_USER


def training_pieces(inputs: list[str], fmt: str = "auto", fields: Fields = Fields(),
                    piece_chars: int = 2000):
    """Yield training strings from `inputs` (see module docstring); skips bad records silently.

    Raises InputError for an input that matches nothing.
    """
    for source in resolve_inputs(inputs):
        for _, raw in iter_records(source, fmt, fields):
            norm = normalize(raw, fmt, fields)
            if norm[0] == "skip":
                continue
            if norm[0] == "chat":
                texts = norm[2::2]  # the contents (roles are not text)
            elif isinstance(norm[1], TextFile):  # a large text file, read in blocks
                try:
                    norm[1].scan(b"")
                except (OSError, ValueError):
                    continue
                texts = (piece for piece, _ in norm[1].pieces(
                    lambda t, start: (min(len(t), start + piece_chars), True), piece_chars))
            else:
                texts = norm[1:]
            buf, n = [], 0
            for text in texts:
                for line in text.splitlines(keepends=True):
                    buf.append(line)
                    n += len(line)
                    if n >= piece_chars:
                        yield "".join(buf)
                        buf, n = [], 0
            if buf:
                yield "".join(buf)


def train(inputs: list[str], output: str, vocab_size: int = 8000, fmt: str = "auto",
          fields: Fields = Fields(), max_sentences: int = 200_000, piece_chars: int = 2000,
          character_coverage: float = 0.9999, threads: int = 2) -> dict:
    """Train and write the model to `output` (local path or fsspec URL, written atomically).

    Returns `{"path", "vocab_size", "sha256", "seconds", "pieces"}`. Raises InputError for
    missing inputs and ValueError when there is no training text.
    """
    import sentencepiece as spm
    t0 = time.time()
    pieces = list(training_pieces(inputs, fmt, fields, piece_chars))[:max_sentences]
    if not pieces:
        raise ValueError("no training text in the inputs (every record was skipped)")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(pieces), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        user_defined_symbols=[SPM_MASK, SPM_USER, SPM_ASSISTANT],
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True,
        max_sentence_length=4 * piece_chars + 16, character_coverage=character_coverage,
        input_sentence_size=0, shuffle_input_sentence=False, num_threads=threads,
        minloglevel=2)
    data = model.getvalue()
    fs, path = fsspec.core.url_to_fs(output)
    parent = path.rsplit("/", 1)[0] if "/" in path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
    if fs.exists(path):
        fs.rm(path)
    fs.mv(tmp, path)
    return {"path": output, "vocab_size": vocab_size, "sha256": hashlib.sha256(data).hexdigest(),
            "seconds": time.time() - t0, "pieces": len(pieces)}


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit code (0 ok, 2 user error)."""
    p = OneLineParser(prog="train_tokenizer.py", description=__doc__.split("\n")[0])
    p.add_argument("--input", action="append", required=True, metavar="PATH_GLOB_URL|stdlib",
                   help="same inputs as shard.py (repeatable)")
    p.add_argument("--output", required=True, help="model file to write, e.g. tok/spm.model")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--format", choices=("auto", "qa", "text", "chat"), default="auto")
    p.add_argument("--max-sentences", type=int, default=200_000,
                   help="train on at most this many text pieces (the first ones)")
    p.add_argument("--piece-chars", type=int, default=2000)
    p.add_argument("--query-field", default="query")
    p.add_argument("--response-field", default="response")
    p.add_argument("--text-field", default="text")
    p.add_argument("--messages-field", default="messages")
    args = p.parse_args(argv)
    if args.vocab_size < 16:
        p.error("--vocab-size must be >= 16")
    fields = Fields(args.query_field, args.response_field, args.text_field, args.messages_field)
    try:
        url_to_fs(args.output, "--output")  # a missing fsspec package: say so before training
        info = train(args.input, args.output, args.vocab_size, args.format, fields,
                     args.max_sentences, args.piece_chars)
    except (InputError, ValueError) as e:
        print(f"train_tokenizer.py: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # as data_prep/shard.py
            print(f"train_tokenizer.py: error: --output {args.output}: {os.strerror(e.errno)}",
                  file=sys.stderr)
            return EXIT_DISK_FULL
        raise
    except RuntimeError as e:  # SentencePiece refuses, e.g. vocab larger than the text allows
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        print(f"train_tokenizer.py: error: sentencepiece: {msg}", file=sys.stderr)
        return EXIT_USAGE
    print(f"train_tokenizer.py: wrote {info['path']} (vocab {info['vocab_size']}, "
          f"{info['pieces']} training pieces, {info['seconds']:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
