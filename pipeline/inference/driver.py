"""The batched decoding driver: one model forward per step serving every active row of a
decode (`_run`), the host-to-device packing of a forward's inputs (`_pack`), the CUDA-graphed
AR step (`_GraphedStep`). The decoders' API and AR program are `pipeline.inference.decoding`'s,
the other row programs, which say what each row feeds and reads, `pipeline.inference.plan_infill`'s
and `left_to_right`'s (their protocol: `pipeline.inference.rows`), the decisions read from the
logits `pipeline.inference.decisions`'.

Batch layout of a forward: row b feeds `carry_b + request_b` (carry: tokens encoded and
committed ahead of the request: the prompt at the first forward, slots re-encoded with
`exact_cache`, a correction or bonus token), right-padded to the longest row; rows that have
finished leave the batch (`KVCache.select_rows`). Every tensor the model and the KV cache see
is on the model's device (the cache in the model's dtype); the logits stay there and are freed
before the next forward (a program keeps copies of the single rows it needs later: verify
"correct")."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.inference.decisions import decide, plan_needs


def _model_device(model) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _gather(logits: torch.Tensor) -> torch.Tensor:
    from pipeline.model import gather_logits
    return gather_logits(logits)


# --------------------------------------------------------------------------------------------
# The batched driver: one forward per step serving every active row.


@dataclass
class _Batch:
    """One forward's inputs on the device, from one host-to-device copy.

    ids, positions: LongTensor[B, T]; mask: BoolTensor[B, 1, T, T] among the new tokens (None =
    causal: no row's request carries a mask); committed: LongTensor[B_prev, N] of the previous
    forward's commit index (None: nothing to commit); index: `NeedPlan.index` of the forward's
    decisions."""

    ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None
    committed: torch.Tensor | None
    index: torch.Tensor | None


def _pack(committed: torch.Tensor | None, ids: torch.Tensor, positions: torch.Tensor,
          mask: torch.Tensor | None, device: torch.device,
          index: torch.Tensor | None = None) -> _Batch:
    """Copy a forward's host tensors to `device` as one byte buffer (one transfer, no stall:
    `host_to_device`) and split it there into views. Host inputs: committed `LongTensor[B', N]`
    or None, ids/positions `LongTensor[B, T]`, mask `BoolTensor[B, T, T]` or None, index
    `LongTensor[N']` or None."""
    from pipeline.model.kv_cache import host_to_device
    ints = [x.reshape(-1) for x in (committed, ids, positions, index) if x is not None]
    parts = [torch.cat(ints).view(torch.uint8)]
    if mask is not None:
        parts.append(mask.reshape(-1).view(torch.uint8))
    buf = host_to_device(torch.cat(parts) if len(parts) > 1 else parts[0], device)
    n_int = sum(x.numel() for x in ints)
    flat = buf[:8 * n_int].view(torch.int64)
    o = 0
    if committed is not None:
        o = committed.numel()
        dev_committed = flat[:o].view(committed.shape)
    b, t = ids.shape
    return _Batch(ids=flat[o:o + b * t].view(b, t),
                  positions=flat[o + b * t:o + 2 * b * t].view(b, t),
                  mask=(buf[8 * n_int:].view(torch.bool).view(b, 1, t, t)
                        if mask is not None else None),
                  committed=dev_committed if committed is not None else None,
                  index=flat[o + 2 * b * t:] if index is not None else None)


class _GraphedStep:
    """A CUDA graph of the forward of one new token per row (the AR step), over the cache at its
    full storage width (`KVCache.fixed_width`), so every replay has the same shapes.

    Built at a step whose eager forward it also runs: the eager logits are that step's result,
    and the graph's replay must reproduce them (else `ok` is False and the caller stays eager).
    Valid while the cache's storage is unchanged (`version`) and for its batch size."""

    def __init__(self, model, cache, ids: torch.Tensor, positions: torch.Tensor):
        self.cache, self.version = cache, cache.version
        self.ids, self.positions = ids.clone(), positions.clone()
        dev = ids.device
        cache.fixed_width = True
        try:
            self.first = _gather(model(self.ids, self.positions, kv_cache=cache))
            side = torch.cuda.Stream(dev)          # warm-up on a side stream, as torch advises
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                model(self.ids, self.positions, kv_cache=cache)
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = _gather(model(self.ids, self.positions, kv_cache=cache))
            self.graph.replay()   # rewrites this step's keys/values: the same values
            self.ok = bool(torch.allclose(self.out.float(), self.first.float(), rtol=1e-2,
                                          atol=1e-2))
        finally:
            cache.fixed_width = False

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.cache.begin(1)   # host bookkeeping of the step (pending entries); storage unchanged
        self.graph.replay()
        return self.out.clone()


def _forward(model, batch: _Batch, cache, graphs: dict | None) -> torch.Tensor:
    """Logits `[B, T, V]` of one batched forward; through a CUDA graph when `graphs` is a dict
    (CUDA, the caller asked for it) and the step is one token per row without a mask."""
    if graphs is None or graphs.get("off") or batch.mask is not None or batch.ids.shape[1] != 1:
        return _gather(model(batch.ids, batch.positions, attention_mask=batch.mask,
                             kv_cache=cache))
    cache.reserve(cache.width + 1)
    g = graphs.get("step")
    if g is not None and g.version == cache.version:
        return g(batch.ids, batch.positions)
    why = None
    try:
        g = _GraphedStep(model, cache, batch.ids, batch.positions)
        if g.ok:
            graphs["step"] = g
            return g.first
        why = "its replay did not reproduce the eager logits"
    except Exception as e:   # e.g. an operation that cannot be captured
        why = f"capture failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    graphs.clear()
    graphs["off"] = True   # for the rest of this decode
    import logging
    logging.getLogger("pipeline.inference").warning(
        "decoding: no CUDA graph for the AR step: %s; decoding on without it", why)
    return _gather(model(batch.ids, batch.positions, kv_cache=cache))


_ALL = object()


def _run(model, rows: list, programs: list, max_len: int, temperature: float,
         generator, cuda_graph: bool = False) -> int:
    """Drive the row programs to completion; returns the number of forward calls.

    Per forward, the host builds the `_Batch` inputs, copies them in one transfer (`_pack`),
    commits on the device and runs the model (the mask over the cache is built on the device,
    `Qwen3.forward`); the rows' decisions (`decide` at `temperature` with `generator`) come
    back in one transfer. `cuda_graph` (CUDA only): replay one-token-per-row steps from a
    captured graph (`_GraphedStep`)."""
    from pipeline.model import KVCache

    device = _model_device(model)
    cache = KVCache.for_model(model, batch_size=len(rows), capacity=max_len)
    graphs = {} if cuda_graph and device.type == "cuda" else None
    reqs: dict = {}   # row -> its program's pending `_Request` (pipeline.inference.rows)
    for b, prog in enumerate(programs):
        try:
            reqs[b] = next(prog)
        except StopIteration:
            pass
    calls = 0
    order = list(range(len(rows)))  # order[i] = the row held by cache row i
    # The last forward's commit index, not yet applied: LongTensor[B, N], or _ALL (every row
    # commits all it was fed, in order: `KVCache.commit()` with no index to check or move).
    committed = None
    while reqs:
        keep = None
        if len(reqs) < len(order):
            # Finished rows leave the batch: later forwards carry only active rows.
            keep = [i for i, b in enumerate(order) if b in reqs]
            order = [order[i] for i in keep]
        B = len(order)
        slot = {b: i for i, b in enumerate(order)}
        feeds = {}
        for b, req in reqs.items():
            row = rows[b]
            feeds[b] = (len(row.carry), row.carry + req.tokens,
                        row.carry_positions + req.positions)
        T = max(len(f[1]) for f in feeds.values())
        ids_rows, pos_rows = [[0] * T for _ in range(B)], [[0] * T for _ in range(B)]
        for b, (nc, toks, pos) in feeds.items():
            ids_rows[slot[b]][:len(toks)] = toks
            pos_rows[slot[b]] = list(pos) + [pos[-1]] * (T - len(toks))
        intra = None
        if any(req.mask is not None for req in reqs.values()):
            # Every fed token may see all of its row's cache; among the new tokens: causal,
            # the request's own mask, padding query positions see only themselves.
            intra = torch.eye(T, dtype=torch.bool).expand(B, T, T).clone()
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            for b, (nc, toks, _) in feeds.items():
                t = len(toks)
                m = intra[slot[b], :t, :t]
                m.copy_(causal[:t, :t])
                if reqs[b].mask is not None:
                    m[nc:, nc:] = reqs[b].mask
        needs = plan_needs([(slot[b] * T + feeds[b][0], reqs[b].need) for b in order])
        batch = _pack(None if committed is _ALL else committed,
                      torch.tensor(ids_rows, dtype=torch.long),
                      torch.tensor(pos_rows, dtype=torch.long), intra, device, needs.index)
        if committed is _ALL:
            cache.commit()
        elif committed is not None:
            cache.commit(committed, on_device=batch.committed)
        if keep is not None:
            cache.select_rows(torch.tensor(keep, dtype=torch.long))
        with torch.no_grad():
            logits = _forward(model, batch, cache, graphs)
            decisions = decide(logits, needs, batch.index, temperature, generator)
        del logits   # only the decisions (and copies the programs take) outlive the forward
        calls += 1
        index = [[] for _ in range(B)]
        nxt: dict = {}
        for b, d in zip(order, decisions):
            row, req, nc = rows[b], reqs[b], feeds[b][0]
            row.forwards[req.kind] += 1
            row.carry_last = row.carry_positions[-1] if nc else -1
            row.carry, row.carry_positions = [], []
            try:
                nxt[b] = programs[b].send(d)
            except StopIteration:
                pass
            d.release()
            index[slot[b]] = list(range(nc)) + [nc + i for i in row.commit]
            row.commit = []
        n = max(len(i) for i in index)
        committed = None
        if n and all(i == list(range(T)) for i in index):
            committed = _ALL   # every row commits its whole feed in order (AR steps)
        elif n:
            committed = torch.tensor([i + [-1] * (n - len(i)) for i in index], dtype=torch.long)
        reqs = nxt
    return calls
