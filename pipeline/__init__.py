"""ReFusion training pipeline: Qwen3 with megatron-core tensor parallelism, DeepSpeed ZeRO,
the hybrid AR + MDM objective, plan-and-infill decoding (layout: ARCHITECTURE.md).

Importing the package filters, once per process, the third-party warnings that say nothing a
user can act on: megatron-core's notice that Transformer Engine and Apex (optional CUDA
extensions) are absent, printed at import of its optimizer modules; torch 2.13's
FutureWarnings about the collectives DeepSpeed 0.19 calls (`reduce_scatter_tensor`,
`all_gather_into_tensor`), which come back once per ZeRO bucket (hundreds of lines per step at
8B).
"""
import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", category=FutureWarning, message=r"`torch\.distributed\."
                        r"(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated")
