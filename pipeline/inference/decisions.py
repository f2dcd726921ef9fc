"""What the row programs read from a forward's logits, computed on the logits' device.

Owns: choosing tokens from logits (`_sample`: argmax, or Gumbel-max sampling) and the softmax
probability of given tokens (`_token_probs`).
Must not touch: the decoding algorithms (`pipeline.inference.decoding`), the model, the cache.
"""
from __future__ import annotations

import torch


def _token_probs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Softmax probability of `ids` under `logits`, computed on the logits' device (float64
    for a float64 model, else float32: no full-vocabulary copy to the host).
    `logits: FloatTensor[..., V]`, `ids: LongTensor[...]` -> CPU `DoubleTensor[...]`."""
    x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    ids = ids.to(x.device)
    lp = x.gather(-1, ids[..., None])[..., 0] - torch.logsumexp(x, -1)
    return lp.exp().double().cpu()


def _sample(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """Argmax of `logits / temperature + Gumbel noise` (= a sample from softmax(logits / T)),
    computed in float64 (low-precision Gumbel-max hurts quality: arXiv 2409.02908); plain argmax
    when temperature == 0. `logits: FloatTensor[..., V]` -> `LongTensor[...]`."""
    if temperature <= 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape, dtype=torch.float64, generator=generator,
                   device=logits.device).clamp_(min=1e-300)
    return (logits.double() / temperature - torch.log(-torch.log(u))).argmax(-1)
