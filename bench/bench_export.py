"""Peak memory of `python -m pipeline.export` against the model size and its largest tensor.

Two sources, each exported in a fresh subprocess that records its resident memory (Linux
`/proc/self/status`): `VmRSS` once the export's modules are imported (the baseline) and
`VmHWM` (peak resident set) at the end; the figure is the peak above the baseline. The TP ranks
of the `hf` round trip are processes of their own: their largest peak (`ru_maxrss` of the
children) is printed next to the same figure for a tiny model (their baseline: interpreter,
torch, megatron-core, process group).

- `hf --tp 2`: a random Qwen3 Hugging Face folder stored in bf16 (default about 360 MB:
  vocab 65536, hidden 1024, 4 layers), exported through our model sharded over 2 TP ranks.
- `checkpoint`: a real training checkpoint (`pipeline.train`, ZeRO-3, TP=2 x DP=2, fp32, one
  step; default about 450 MB of fp32 weights: vocab 32768), exported to bf16.

The target (issue 9): peak above baseline < 1.5 x the largest tensor in fp32 + a few hundred
MB, whatever the model size. `--code-root` measures another checkout (e.g. the code before
streaming) on the same models.

    .venv/bin/python bench/bench_export.py [--vocab 65536] [--ckpt-vocab 32768] [--hidden 1024]
        [--layers 4] [--work DIR] [--keep] [--code-root PATH] [--skip-checkpoint]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# Runs in the measured subprocess: import what an export imports, read the baseline, export.
PROBE = r"""
import json, resource, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])
import torch, safetensors.torch, huggingface_hub, deepspeed.utils.zero_to_fp32  # noqa
from pipeline import checkpoint, export
from pipeline.model import hf as hf_io  # noqa
from pipeline.model import Qwen3  # noqa
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
base = status("VmRSS")
rc = export.main(sys.argv[2:])
print(json.dumps({"rc": rc, "base": base, "peak": status("VmHWM"),
                  "children_peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def measure(code_root: Path, argv: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(code_root))
    r = subprocess.run([sys.executable, "-c", PROBE, str(code_root), *argv], env=env,
                       capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise SystemExit(f"export {' '.join(argv)} failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    out = json.loads(lines[-1])
    if out["rc"] != 0:
        raise SystemExit(f"export {' '.join(argv)} exited {out['rc']}:\n{r.stderr[-3000:]}")
    return out


def tensor_sizes(folder: Path) -> tuple[int, int, int]:
    """(bytes as stored, largest tensor's bytes as stored, largest tensor's numel) of an HF
    folder."""
    from safetensors import safe_open
    total = largest = numel = 0
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                sl = st.get_slice(k)
                n = 1
                for d in sl.get_shape():
                    n *= d
                size = n * {"F32": 4, "BF16": 2, "F16": 2}[sl.get_dtype()]
                total += size
                if size > largest:
                    largest, numel = size, n
    return total, largest, numel


def mb(n: float) -> str:
    return f"{n / 2 ** 20:8.1f} MB"


def report(name: str, res: dict, model_bytes: int, largest_numel: int, child_base=None) -> None:
    above = res["peak"] - res["base"]
    fp32_largest = largest_numel * 4
    target = 1.5 * fp32_largest + 300 * 2 ** 20
    print(f"{name}: peak above baseline {mb(above)} = {above / model_bytes:.2f}x the model "
          f"({mb(model_bytes).strip()}), {above / fp32_largest:.2f}x its largest tensor in fp32 "
          f"({mb(fp32_largest).strip()}); target < 1.5x largest fp32 + 300 MB = "
          f"{mb(target).strip()}: {'ok' if above < target else 'OVER'}")
    if child_base is not None:
        print(f"{'':>{len(name)}}  TP ranks: largest peak {mb(res['children_peak'])} "
              f"(same export of a tiny model: {mb(child_base).strip()}; difference "
              f"{mb(res['children_peak'] - child_base).strip()})")


def train_checkpoint(work: Path, code_root: Path, vocab: int, hidden: int, layers: int) -> Path:
    """One training step of a Qwen3-shaped model, ZeRO-3, TP=2 x DP=2, fp32; returns the
    checkpoint root."""
    import numpy as np

    from pipeline.parallel import free_port
    from shard_fixtures import random_samples, write_shards
    rng = np.random.default_rng(0)
    write_shards(str(work / "data"), {"train": random_samples(rng, 16, vocab_size=64,
                                                              max_length=24)},
                 samples_per_shard=8)
    heads = hidden // 128
    (work / "run.yaml").write_text(f"""\
run_dir: {work / 'run'}
model:
  inline: {{vocab_size: {vocab}, hidden_size: {hidden}, intermediate_size: {hidden * 11 // 4},
           num_layers: {layers}, num_attention_heads: {heads},
           num_key_value_heads: {max(2, heads // 2)}, head_dim: 128,
           max_position_embeddings: 64}}
data: {{dir: {work / 'data'}, num_workers: 0, shuffle_buffer: 4}}
optim: {{lr: 1.0e-3, warmup_steps: 0}}
train: {{max_steps: 1, micro_batch_size: 1, precision: fp32, zero_stage: 3,
        tensor_parallel_size: 2}}
checkpoint: {{interval: 0, keep: 1}}
wandb: {{mode: disabled}}
""")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(code_root))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4",
                        "--master_port", str(free_port()), "-m", "pipeline.train", "--config",
                        str(work / "run.yaml")], cwd=code_root, env=env, capture_output=True,
                       text=True, timeout=3600)
    root = work / "run" / "checkpoints"
    if not (root / "latest").is_file():
        raise SystemExit(f"training failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return root


def main() -> int:
    import warnings
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--vocab", type=int, default=65536, help="vocab of the hf source")
    ap.add_argument("--ckpt-vocab", type=int, default=32768, help="vocab of the checkpoint")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (heads of 128)")
    ap.add_argument("--layers", type=int, default=4, help="transformer layers")
    ap.add_argument("--work", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    ap.add_argument("--code-root", default=str(ROOT),
                    help="checkout whose pipeline.export is measured")
    ap.add_argument("--skip-checkpoint", action="store_true",
                    help="only the hf round trip (no training run)")
    args = ap.parse_args()
    if args.hidden % 128 or args.hidden < 256 or args.layers < 1 or args.vocab < 256:
        print("error: --hidden must be a multiple of 128 (>= 256), --layers >= 1, "
              "--vocab >= 256", file=sys.stderr)
        return 2
    code = Path(args.code_root).resolve()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        import torch
        import transformers

        from tiny_qwen3 import make_tiny_qwen3
        transformers.utils.logging.disable_progress_bar()
        heads = args.hidden // 128
        src = make_tiny_qwen3(work / "src", seed=0, vocab_size=args.vocab,
                              hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                              num_hidden_layers=args.layers, num_attention_heads=heads,
                              num_key_value_heads=max(2, heads // 2), head_dim=128,
                              torch_dtype="bfloat16")
        tiny = make_tiny_qwen3(work / "tiny", seed=0)
        from transformers import Qwen3ForCausalLM
        m = Qwen3ForCausalLM.from_pretrained(str(src), dtype=torch.bfloat16)
        m.save_pretrained(str(src))          # stored in bf16, as released models are
        del m
        size, _, numel = tensor_sizes(src)
        print(f"code: {code}; hf source: {mb(size).strip()} bf16, largest tensor {numel:,} "
              f"elements ({mb(numel * 2).strip()} bf16, {mb(numel * 4).strip()} fp32)")
        base_child = measure(code, [str(tiny), str(work / "tiny-out"), "--tp", "2"])
        res = measure(code, [str(src), str(work / "out-hf"), "--tp", "2"])
        report("hf --tp 2     ", res, size, numel, base_child["children_peak"])
        if not args.skip_checkpoint:
            root = train_checkpoint(work / "ckpt", code, args.ckpt_vocab, args.hidden,
                                    args.layers)
            out = work / "out-ckpt"
            res = measure(code, [str(root), str(out), "--dtype", "bfloat16"])
            fp32_size = tensor_sizes(out)[0] * 2
            _, _, numel = tensor_sizes(out)
            print(f"checkpoint: {mb(fp32_size).strip()} fp32 weights (ZeRO-3, TP 2 x DP 2), "
                  f"largest tensor {numel:,} elements ({mb(numel * 4).strip()} fp32)")
            report("checkpoint    ", res, fp32_size, numel)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
