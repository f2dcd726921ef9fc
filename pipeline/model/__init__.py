"""The Qwen3 model ReFusion trains, as a package: one file per concern.

- `config.py`: `ModelConfig` (the network's shape);
- `qwen3.py`: the network (`Qwen3`, megatron-core tensor-parallel layers) and `gather_logits`;
- `attention.py`: masks, packed-sequence kernels, `attention(q, k, v, plan)`;
- `linear_ce.py`: the output layer fused with the weighted cross-entropy (training loss);
- `kv_cache.py`: the reorderable decoding cache `KVCache`;
- `tp.py`: the tensor-parallel table (native names, Hugging Face names, split dims, shapes);
- `hf.py`: Hugging Face folders <-> native per-rank tensors (load, merge, write);
- `init.py`: seeded random initialisation, identical across layouts;
- `weights.py`: copying tensors into a model (ZeRO-3 aware) and the meta-device build;
- `flops.py`: parameter counts, FLOPs per token and per packed batch (MFU, HFU), device peaks.

The names below are the package's public API; import the rest from its module.
"""
from pipeline.model.config import ATTENTION_KINDS, ModelConfig
from pipeline.model.flops import (PEAK_BF16_TFLOPS, flops_per_token, num_parameters,
                                  peak_tflops_of_device, segment_lengths, training_flops)
from pipeline.model.kv_cache import KVCache
from pipeline.model.qwen3 import Qwen3, gather_logits

__all__ = ["ATTENTION_KINDS", "ModelConfig", "PEAK_BF16_TFLOPS", "flops_per_token",
           "num_parameters", "peak_tflops_of_device", "segment_lengths", "training_flops",
           "KVCache", "Qwen3", "gather_logits"]
