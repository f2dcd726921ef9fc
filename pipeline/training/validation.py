"""The validation loss: one pass over a split, weighted like the training loss but over the whole
split, so the figure depends on the weights, the split, the seed and the objective only (not on
the data-parallel size or the micro-batch size).

Owns: `loss_sums` / `loss_figures` (the additive parts of a micro-batch's loss and the figures
of their total; `source_sums`, the same per data source), `validation_loss` (one process:
`pipeline.evaluate`, the experiment) and `run_validation` (the trainer's pass over every
data-parallel rank). Must not touch: the loss itself (`pipeline.objective`), loader internals,
logging.
"""
from __future__ import annotations

from typing import Callable

import torch


def loss_sums(stats: dict) -> torch.Tensor:
    """The additive parts of one micro-batch's hybrid loss, from `hybrid_loss`'s stats.

    Returns:
        FloatTensor[5] (float64, on the stats' device): [sum of AR cross-entropy over AR
        tokens, AR tokens, sum of weighted MDM cross-entropy, segments (the MDM term's
        normalizer), real tokens]. Sums over micro-batches (and ranks) give the loss of the
        union, whatever the batching: see `loss_figures`.
    """
    ar_t = stats["ar_tokens"].double()
    seg = stats["num_segments"].to(ar_t.device).double()
    return torch.stack([stats["ar_loss"].double() * ar_t, ar_t,
                        stats["mdm_loss"].double() * seg, seg,
                        stats["real_tokens"].to(ar_t.device).double()])


def source_sums(stats: dict) -> torch.Tensor:
    """The additive per-source parts of one micro-batch, from `hybrid_loss(..., num_sources=S)`'s
    stats: DoubleTensor[2S] = [CE sum over each source's labelled tokens x S, those tokens x S]
    (`pipeline.training.metrics.source_losses` turns summed halves into per-source losses)."""
    return torch.cat([stats["ce_sum_by_source"].double(), stats["labelled_by_source"].double()])


def loss_figures(sums, cfg=None, prefix: str = "val_") -> dict:
    """Loss figures of a data set from summed `loss_sums`, weighted as the training loss of a
    micro-batch is (docs/METHOD.md "Loss of a micro-batch"), over the whole set instead of one
    micro-batch:
    AR = sum AR CE / AR tokens, MDM = sum weighted MDM CE / segments,
    loss = ar_weight * AR + mdm_weight * MDM (an empty term is 0).

    Args:
        sums: FloatTensor[5] or sequence of 5 floats (see `loss_sums`).
        cfg: `pipeline.objective.ObjectiveConfig` (term weights); default the paper's.
        prefix: key prefix.

    Returns:
        {prefix+"loss", prefix+"ar_loss", prefix+"mdm_loss"} (nats; None when the set had no
        labelled token) and prefix+"tokens" (real tokens, int).
    """
    from pipeline.objective import ObjectiveConfig
    cfg = cfg or ObjectiveConfig()
    ar_sum, ar_t, mdm_sum, seg, tokens = (float(v) for v in sums)
    ar = ar_sum / ar_t if ar_t else 0.0
    mdm = mdm_sum / seg if seg else 0.0
    some = bool(ar_t or seg)
    return {f"{prefix}loss": cfg.ar_weight * ar + cfg.mdm_weight * mdm if some else None,
            f"{prefix}ar_loss": ar if some else None, f"{prefix}mdm_loss": mdm if some else None,
            f"{prefix}tokens": int(round(tokens))}


@torch.no_grad()
def validation_loss(model, data_dir: str, split: str = "val", micro_batch_size: int = 4,
                    max_batches: int = 0, seed: int = 0, objective_cfg=None,
                    row_length: int | None = None, pack: bool = False,
                    packing: str = "best_fit", shuffle_buffer: int = 1000) -> dict:
    """Hybrid loss of the split (manifest order, one pass), weighted by tokens and segments
    (`loss_figures`), so the figure does not depend on `micro_batch_size` (up to float
    summation order) and equals the trainer's validation of the same weights, seed, objective
    and row length on any data-parallel size.

    Args:
        model: `pipeline.model.Qwen3` (eval mode).
        data_dir: shard folder (ARCHITECTURE.md "Shard format").
        split: manifest split name.
        micro_batch_size: rows per micro-batch.
        max_batches: stop after this many micro-batches (0 = the whole split).
        seed: objective seed (which slots are masked: a pure function of seed and sample key).
        objective_cfg: `ObjectiveConfig` of the run (default: the paper's).
        row_length: tokens per row, the run's (`data.max_length`, `Plan.row_length`); None =
            the manifest's max_length. Objective mode "dual" drops the masked copies a sample
            cannot fit in a row, so its figures depend on it.
        pack, packing, shuffle_buffer: the run's `data.pack`, `data.packing`,
            `data.shuffle_buffer` (which samples share a row; with `max_batches`, which ones
            are seen).

    Returns:
        {"val_loss", "val_ar_loss", "val_mdm_loss", "val_batches", "val_tokens"} (losses in
        nats; tokens = real tokens seen) and "loss_by_source" ({source name: mean CE over
        its labelled tokens, unweighted, or None}; `pipeline.training.metrics.source_losses`).

    Raises:
        pipeline.data.DataError: unreadable folder or split, `row_length` shorter than the
            manifest's max_length.
    """
    from pipeline.data import build_loader, read_manifest
    from pipeline.objective import hybrid_loss
    from pipeline.training.metrics import source_losses, source_names
    if row_length is None:
        row_length = int(read_manifest(data_dir)["max_length"])
    loader = build_loader(data_dir, split, micro_batch_size, int(row_length), seed=seed,
                          num_workers=0, objective_cfg=objective_cfg, pack=pack, packing=packing,
                          shuffle_buffer=shuffle_buffer, shuffle=False, infinite=False,
                          vocab_size=model.cfg.vocab_size)
    dev = next(model.parameters()).device
    sums = torch.zeros(5, dtype=torch.float64, device=dev)
    names = source_names(loader)
    by_src = torch.zeros(2 * len(names), dtype=torch.float64, device=dev)
    n = 0
    for batch in loader:
        if max_batches and n >= max_batches:
            break
        dual = {k: batch[k].to(dev) for k in ("copy_id", "clean_limit") if k in batch}
        logits = model(batch["input_ids"].to(dev), batch["position_ids"].to(dev),
                       segment_ids=batch["segment_ids"].to(dev), **dual)   # dual: mode "dual"
        _, stats = hybrid_loss(logits.float(), batch, objective_cfg, num_sources=len(names))
        sums += loss_sums(stats)
        by_src += source_sums(stats)
        n += 1
    by_src = by_src.cpu().tolist()
    return {**loss_figures(sums.cpu(), objective_cfg), "val_batches": n,
            "loss_by_source": source_losses(by_src[:len(names)], by_src[len(names):], names)}


@torch.no_grad()
def run_validation(engine, make_loader: Callable, micro_batch_size: int, row_length: int,
                   tp_size: int, objective_cfg, device, limit: int = 0,
                   progress: Callable[[], None] | None = None) -> dict:
    """The trainer's validation pass (collective over the world).

    Each data-parallel rank evaluates its share of the split (`make_loader()`: a one-pass
    loader in manifest order for this DP rank; every sample is seen once over the ranks
    whatever the DP size), up to `limit` micro-batches per rank (0 = the whole split). Every
    rank runs the same number of forwards (ZeRO-3 gathers weights collectively): a rank out of
    batches while another still has one evaluates an all-padding batch, which adds nothing.
    The sums are all-reduced; TP ranks of a DP group repeat their group's sums (divided out).

    Args:
        engine: the DeepSpeed engine (called like the model, with `.module.head_logits`,
            `eval()` / `train()`).
        make_loader: builds this rank's validation loader (attribute `pad_id`).
        micro_batch_size, row_length: shape of an all-padding batch (rows x tokens).
        tp_size: tensor-parallel size. objective_cfg: `ObjectiveConfig` of the run.
        device: where batches go. limit: micro-batches per rank at most (0 = all).
        progress: called before each micro-batch (the hang watchdog's progress tick).
    Returns:
        {"val_loss", "val_ar_loss", "val_mdm_loss", "val_tokens"} (`loss_figures`),
        "val_batches" (micro-batches this rank evaluated) and "loss_by_source" (as
        `validation_loss`'s, over every rank; the sources are the loader's `source_names`).
    """
    import torch.distributed as dist
    from pipeline.objective import collate, hybrid_loss
    from pipeline.training.metrics import source_losses, source_names
    engine.eval()
    n = 0
    loader = make_loader()
    names = source_names(loader)
    S = len(names)
    # [loss_sums (5), source_sums (2S)]: one all-reduce at the end
    sums = torch.zeros(5 + 2 * S, dtype=torch.float64, device=device)
    it = iter(loader)
    while limit == 0 or n < limit:
        if progress is not None:
            progress()
        batch = next(it, None)
        have = torch.tensor([0.0 if batch is None else 1.0], device=device)
        dist.all_reduce(have, op=dist.ReduceOp.MAX)
        if have.item() == 0:
            break
        if batch is None:
            batch = collate([[] for _ in range(micro_batch_size)], row_length, loader.pad_id)
        b = {k: (v.to(device, non_blocking=True) if hasattr(v, "to") else v)
             for k, v in batch.items()}
        hidden = engine(b["input_ids"], b["position_ids"], segment_ids=b["segment_ids"],
                        copy_id=b.get("copy_id"), clean_limit=b.get("clean_limit"),
                        return_hidden=True)
        _, stats = hybrid_loss(hidden, b, objective_cfg, head=engine.module.head_logits,
                               num_sources=S)
        sums += torch.cat([loss_sums(stats), source_sums(stats)])
        n += 1
    dist.all_reduce(sums)
    engine.train()
    sums = (sums / tp_size).cpu()
    src = sums[5:].tolist()
    return {**loss_figures(sums[:5], objective_cfg), "val_batches": n,
            "loss_by_source": source_losses(src[:S], src[S:], names)}
