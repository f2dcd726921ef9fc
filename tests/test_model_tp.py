"""pipeline.model at TP=2 (2 gloo processes) against transformers' Qwen3ForCausalLM.

One spawn covers logits (natural, permuted, padded/packed; flex vs sdpa), gradients, the KV cache and the
per-rank state dicts, to pay the process start-up once. The checkpoint has an odd vocab (511
rows), so TP=2 also exercises vocab padding (512 rows, one zero row).
"""
import torch

from distributed import run_distributed
from tiny_qwen3 import make_tiny_qwen3

ATOL = 1e-4
VOCAB = 511


def _inputs():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    labels = torch.randint(0, VOCAB, (2, 16), generator=g)
    pos = torch.arange(16).expand(2, 16)
    perm = torch.stack([torch.randperm(16, generator=g) for _ in range(2)])
    seg = torch.tensor([[1] * 10 + [0] * 6, [1] * 7 + [2] * 9])
    seg_pos = torch.tensor([list(range(16)), list(range(7)) + list(range(9))])
    return ids, labels, pos, perm, seg, seg_pos


def _greedy(model, prompt, steps):
    from pipeline.model import KVCache, gather_logits
    cache = KVCache.for_model(model, 1, prompt.shape[1] + steps)
    ids, out, start = prompt, [], 0
    for _ in range(steps):
        logits = gather_logits(model(ids, torch.arange(start, start + ids.shape[1])[None],
                                     kv_cache=cache))
        cache.commit()
        start += ids.shape[1]
        ids = logits[:, -1:, :VOCAB].argmax(-1)
        out.append(int(ids))
    return out


def _body(rank, world_size, ckpt, tied_ckpt):
    from pipeline.model.hf import config_from_hf, load_hf_into_model, native_state_dict
    from pipeline.model import Qwen3, gather_logits
    from pipeline.parallel import init_distributed
    torch.manual_seed(0)
    info = init_distributed(tensor_parallel_size=2)
    cfg = config_from_hf(ckpt, tp_size=2)
    model = Qwen3(cfg, init_weights=False)
    load_hf_into_model(model, ckpt)
    ids, labels, pos, perm, seg, seg_pos = _inputs()
    out = {"tp_rank": info.tp_rank, "vocab": cfg.vocab_size,
           "embed_shape": tuple(model.embed_tokens.weight.shape)}
    with torch.no_grad():
        out["natural"] = gather_logits(model(ids, pos))
        out["permuted"] = gather_logits(model(ids, perm))
        out["packed"] = gather_logits(model(ids, seg_pos, segment_ids=seg))
        out["greedy"] = _greedy(model, ids[:1, :5], 10)
        # attention=flex on packed, padded rows with reorganized positions, with the dense-mask
        # builder disabled: equals the sdpa forward of the same rank.
        import pipeline.model.attention as pm
        reorg = torch.stack([torch.randperm(16, generator=torch.Generator().manual_seed(7)),
                             torch.cat((torch.randperm(7), torch.randperm(9)))])
        model.cfg.attention = "sdpa"
        out["sdpa_reorg"] = gather_logits(model(ids, reorg, segment_ids=seg))
        dense = pm.build_attention_mask
        pm.build_attention_mask = None  # calling it would raise TypeError
        model.cfg.attention = "flex"
        out["flex_reorg"] = gather_logits(model(ids, reorg, segment_ids=seg))
        pm.build_attention_mask = dense
        model.cfg.attention = "auto"
    logits = gather_logits(model(ids, pos))[..., :VOCAB]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    out["loss"] = loss.item()
    out["grads"] = {k: p.grad.clone() for k, p in model.named_parameters()}
    out["state"] = native_state_dict(model)
    # Tied head at TP=2: the head's vocab partition is the embedding's.
    tied = Qwen3(config_from_hf(tied_ckpt, tp_size=2), init_weights=False)
    load_hf_into_model(tied, tied_ckpt)
    with torch.no_grad():
        out["tied"] = gather_logits(tied(ids, pos))
    return out


def test_tp2_matches_transformers(tmp_path):
    from transformers import Qwen3ForCausalLM
    from pipeline.model.hf import config_from_hf, merge_tp_state_dicts
    ckpt = make_tiny_qwen3(tmp_path / "hf", seed=3, vocab_size=VOCAB)
    tied_ckpt = make_tiny_qwen3(tmp_path / "tied", seed=4, vocab_size=VOCAB,
                                tie_word_embeddings=True, num_hidden_layers=1)
    results = run_distributed(_body, world_size=2, args=(str(ckpt), str(tied_ckpt)))
    assert [r["tp_rank"] for r in results] == [0, 1]
    assert results[0]["vocab"] == 512 and results[0]["embed_shape"] == (256, 64)

    hf = Qwen3ForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    ids, labels, pos, perm, seg, seg_pos = _inputs()
    with torch.no_grad():
        ref_nat = hf(input_ids=ids, position_ids=pos).logits
        ref_perm = hf(input_ids=ids, position_ids=perm).logits
    for r in results:
        assert r["natural"].shape == (2, 16, 512)
        assert (r["natural"][..., :VOCAB] - ref_nat).abs().max().item() <= ATOL
        assert (r["permuted"][..., :VOCAB] - ref_perm).abs().max().item() <= ATOL
        # The padded vocab row is zero in the embedding and the head: its logit is exactly 0.
        assert r["natural"][..., VOCAB:].abs().max().item() == 0.0
        assert (r["flex_reorg"] - r["sdpa_reorg"]).abs().max().item() <= 1e-5
        with torch.no_grad():
            for row, spans in ((0, [(0, 10)]), (1, [(0, 7), (7, 16)])):
                for a, b in spans:
                    ref = hf(input_ids=ids[row:row + 1, a:b],
                             position_ids=seg_pos[row:row + 1, a:b]).logits[0]
                    assert (r["packed"][row, a:b, :VOCAB] - ref).abs().max().item() <= ATOL

    tied = Qwen3ForCausalLM.from_pretrained(tied_ckpt, dtype=torch.float32)
    with torch.no_grad():
        ref_tied = tied(input_ids=ids, position_ids=pos).logits
    for r in results:
        assert (r["tied"][..., :VOCAB] - ref_tied).abs().max().item() <= ATOL

    # Greedy KV-cached decoding at TP=2 == transformers generate.
    prompt = ids[:1, :5]
    gen = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                      do_sample=False, pad_token_id=0, eos_token_id=None)
    assert results[0]["greedy"] == results[1]["greedy"] == gen[0, 5:].tolist()

    # Gradients: TP=2 shards merged == transformers' (single-process) gradients.
    loss = torch.nn.functional.cross_entropy(hf(input_ids=ids).logits.flatten(0, 1),
                                             labels.flatten())
    loss.backward()
    assert abs(results[0]["loss"] - loss.item()) <= 1e-5
    cfg = config_from_hf(ckpt, tp_size=2)
    merged = merge_tp_state_dicts([r["grads"] for r in results], cfg, vocab_rows=VOCAB)
    hf_grads = {k: p.grad for k, p in hf.named_parameters()}
    assert set(merged) == set(hf_grads)
    for k, g in merged.items():
        assert torch.allclose(g, hf_grads[k], atol=1e-5, rtol=1e-4), k
    # Replicated q/k norm weights get the full (all-reduced) gradient on both ranks.
    name = "layers.0.self_attn.q_norm.weight"
    assert torch.equal(results[0]["grads"][name], results[1]["grads"][name])

    # Per-rank weights merged back == the checkpoint's tensors, bit for bit.
    weights = merge_tp_state_dicts([r["state"] for r in results], cfg, vocab_rows=VOCAB)
    hf_state = hf.state_dict()
    assert set(weights) == set(hf_state)
    for k, w in weights.items():
        assert torch.equal(w, hf_state[k]), k
