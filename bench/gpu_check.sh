#!/usr/bin/env bash
# bench/gpu_check.sh: the one prepared GPU check (issue 9, section 6). Not a test; CI never needs it.
#
#   bash bench/gpu_check.sh                    # one CUDA GPU (an H200 takes about 6-8 minutes)
#   GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh  # reduced CPU smoke mode: tiny model, same steps
#
# No network. On one GPU it:
#  1. writes a folder of random packed-training shards (rows of 4096 tokens, Qwen3's vocabulary);
#  2. trains a Qwen3-8B-shaped model with fewer layers (hidden size, heads, vocabulary of 8B;
#     GPU_CHECK_LAYERS layers) for GPU_CHECK_STEPS steps through the real trainer
#     (`python -m pipeline.train`: DeepSpeed ZeRO-3, DP=1, bf16, activation checkpointing,
#     packed rows) once per attention kernel (`model.attention=sdpa`, `varlen`, `flex`) and
#     prints tokens/s, MFU and peak memory of each (the steps after the first
#     GPU_CHECK_WARMUP), and the time of the final checkpoint save;
#  3. prints the agreement of each kernel's logits and gradients with sdpa's on one packed
#     batch (bench/attention_check.py attention_parity; skipped when that is not in the tree);
#  4. runs bench/bench_train_step.py on the same GPU and data (its reference-style padded step
#     and our packed plain-torch step) and prints the trainer's tokens/s as a ratio of the
#     reference-style step's;
#  5. decodes with the sdpa run's checkpoint in refusion and ar modes (bench/bench_decoding.py
#     --device cuda): TPF and tokens/s (random weights: TPF only shows the mechanics); on the GPU
#     the median of 3 timed decodes per setting, so that one-time costs of a first decode (e.g.
#     per-shape kernel planning: the cache width grows every step) do not set the figure.
# The closing block "GPU check summary" is what README's "GPU figures" quotes.
#
# Without CUDA (and without GPU_CHECK_SMOKE=1) it prints one error line and exits 2.
# A part that cannot run in this tree (e.g. no model.attention option) prints one line saying
# so and the check goes on; a part that fails prints the tail of its log. Exit status: 0 when
# every part that ran succeeded, 1 otherwise.
#
# Knobs (environment): PYTHON (default .venv/bin/python), GPU_CHECK_LAYERS (4),
# GPU_CHECK_STEPS (8), GPU_CHECK_WARMUP (2), GPU_CHECK_MICRO_BATCH (2),
# GPU_CHECK_ATTENTION ("sdpa varlen flex"), GPU_CHECK_LIMIT_S (470: every part is given only
# the time left until then, and a part with less than 30 s left is skipped with one line, so
# the whole check ends within about 8 minutes), GPU_CHECK_WORKDIR (default: a fresh folder under
# /dev/shm when it has 40 GB free, else under $TMPDIR; removed at the end unless
# GPU_CHECK_KEEP=1). Disk: each 4-layer run writes a checkpoint of about 28 GB (deleted as
# soon as it has been used).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
die() { printf 'bench/gpu_check.sh: error: %s\n' "$*" >&2; exit 2; }
say() { printf '%s\n' "$*" | tee -a "$REPORT"; }
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
stamp() { printf '[gpu_check +%ss] %s\n' "$(elapsed)" "$*"; }   # progress, not in the summary

PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
PYTHON=$(command -v "$PYTHON" || printf %s "$PYTHON")
[ -x "$PYTHON" ] || die "PYTHON=$PYTHON is not executable (make venv, or set PYTHON)"
SMOKE=${GPU_CHECK_SMOKE:-0}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 WANDB_MODE=disabled \
       HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}

if [ "$SMOKE" = 1 ]; then
  export DS_ACCELERATOR=cpu
  DEVICE=cpu; GPU_NAME="CPU (smoke mode)"
  LAYERS=2; SEQ=128; STEPS=${GPU_CHECK_STEPS:-3}; WARMUP=${GPU_CHECK_WARMUP:-1}
  MBS=${GPU_CHECK_MICRO_BATCH:-2}; ATTNS=${GPU_CHECK_ATTENTION:-sdpa flex}
  BASE_PRESET=configs/model/tiny.yaml; NTRAIN=64
  BENCH_STEPS=2; GEN=16; PROMPTS=2; DECODE_REPEATS=1; LIMIT=${GPU_CHECK_LIMIT_S:-400}
else
  GPU_NAME=$("$PYTHON" -c 'import sys, torch
if not torch.cuda.is_available(): sys.exit(1)
print(torch.cuda.get_device_name(0))' 2>/dev/null) \
    || die "no CUDA device visible (torch.cuda.is_available() is False in $PYTHON); this check needs one GPU (GPU_CHECK_SMOKE=1 runs the reduced CPU smoke mode)"
  DEVICE=cuda
  LAYERS=${GPU_CHECK_LAYERS:-4}; SEQ=4096; STEPS=${GPU_CHECK_STEPS:-8}; WARMUP=${GPU_CHECK_WARMUP:-2}
  MBS=${GPU_CHECK_MICRO_BATCH:-2}; ATTNS=${GPU_CHECK_ATTENTION:-sdpa varlen flex}
  BASE_PRESET=configs/model/qwen3_8b.yaml; NTRAIN=600
  BENCH_STEPS=4; GEN=128; PROMPTS=8; DECODE_REPEATS=3; LIMIT=${GPU_CHECK_LIMIT_S:-470}
fi
[ "$STEPS" -gt "$WARMUP" ] 2>/dev/null || die "GPU_CHECK_STEPS=$STEPS must exceed GPU_CHECK_WARMUP=$WARMUP"

if [ -n "${GPU_CHECK_WORKDIR:-}" ]; then
  WORK=$GPU_CHECK_WORKDIR; mkdir -p "$WORK" || die "cannot create GPU_CHECK_WORKDIR=$WORK"
else
  base=${TMPDIR:-/tmp}
  shm_free_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')
  [ "$SMOKE" != 1 ] && [ "${shm_free_kb:-0}" -gt 41943040 ] && base=/dev/shm
  WORK=$(mktemp -d "$base/gpu_check.XXXXXX") || die "cannot create a work folder under $base"
  [ "${GPU_CHECK_KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
fi
REPORT=$WORK/report.txt; : > "$REPORT"
FAILED=0
left() { echo $(( LIMIT - $(elapsed) )); }   # seconds left for the next part
over_budget() {  # $1 = part name; true (and one line) when less than 30 s are left
  if [ "$(left)" -lt 30 ]; then
    say "$1: skipped (GPU_CHECK_LIMIT_S=$LIMIT s nearly spent)"; return 0
  fi
  return 1
}
fail() {  # $1 = part, $2 = log
  FAILED=1; say "$1: FAILED (log tail below)"; tail -n 25 "$2" | sed 's/^/    /'
}

# ---- 1. data and model preset -------------------------------------------------------------
DATA=$WORK/data
PRESET=$WORK/model.yaml
sed -E "s/^num_layers:.*/num_layers: $LAYERS/; s/^vocab_size:.*/vocab_size: 151936/" \
  "$BASE_PRESET" > "$PRESET"   # Qwen3's embedding rows (the tokenizer has 151671 ids)
"$PYTHON" - "$DATA" "$SEQ" "$NTRAIN" "$WORK/tokenizer" > "$WORK/data.log" 2>&1 <<'EOF' || die "writing the random shards failed: $(tail -n 3 "$WORK/data.log")"
import sys
import numpy as np
sys.path.insert(0, "tests")
from shard_fixtures import random_samples, write_shards
from tiny_qwen3 import REFUSION_TOKENS, qwen_tokenizer_dir
from transformers import AutoTokenizer
from pipeline.tokenizer import load_tokenizer
out, seq, n, tokdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# the real Qwen3 tokenizer (+ the ReFusion tokens), so that decoding finds a tokenizer
tok = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
tok.add_special_tokens({"additional_special_tokens": list(REFUSION_TOKENS)})
tok.save_pretrained(tokdir)
info = load_tokenizer(tokdir).info
rng = np.random.default_rng(0)
# random ordinary ids (below the special ones); one query/response per sample, 1/16 to 1/2 of a
# row long, so packing puts 2-8 samples in a row
kw = dict(vocab_size=info.pad_id, max_length=seq // 2, min_length=seq // 16, max_segments=1,
          slot_sizes=(4, 8, 16, 32), max_prompt=max(4, seq // 32))
write_shards(out, {"train": random_samples(rng, n, **kw), "val": random_samples(rng, 16, **kw)},
             samples_per_shard=100, tokenizer=info.to_json(), max_length=seq)
EOF
stamp "random shards written"
ATTN_KEY=model.attention
"$PYTHON" -c 'import dataclasses, sys
from pipeline.config import ModelSection
sys.exit(0 if "attention" in {f.name for f in dataclasses.fields(ModelSection)} else 1)' 2>/dev/null \
  || ATTN_KEY=""
NPARAMS=$("$PYTHON" -c "from pipeline.model import ModelConfig
c = ModelConfig.from_yaml('$PRESET'); h, i, L, d = c.hidden_size, c.intermediate_size, c.num_layers, c.head_dim
layer = h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) + 3 * h * i + 2 * h + 2 * d
print(c.vocab_size * h * (1 if c.tie_word_embeddings else 2) + L * layer + h)")
say "GPU check on $GPU_NAME, $(date -u +%Y-%m-%d), torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
say "model: $(basename "$BASE_PRESET") shape with $LAYERS layers ($(awk -v n="$NPARAMS" 'BEGIN{printf "%.2fB", n/1e9}') parameters); packed rows of $SEQ tokens, micro-batch $MBS, DP=1, bf16, ZeRO-3, activation checkpointing; work folder $WORK"

# ---- 2. the real trainer, once per attention kernel ---------------------------------------
run_trainer() {  # $1 = attention kind ("" = the model's default)
  local kind=$1 name=${1:-default} run=$WORK/run_${1:-default}
  local cfg=$WORK/run_$name.yaml log=$WORK/run_$name.log
  cat > "$cfg" <<EOF
run_dir: $run
model: {preset: $PRESET}
init: {source: random}
data: {dir: $DATA, max_length: $SEQ, pack: true, num_workers: 2, shuffle_buffer: 64}
optim: {lr: 1.0e-5, warmup_steps: 0, impl: torch}
train: {max_steps: $STEPS, micro_batch_size: $MBS, grad_accum_steps: 1, precision: bf16,
        zero_stage: 3, activation_checkpointing: true, tensor_parallel_size: 1,
        log_interval: 1, eval_interval: 0}
checkpoint: {interval: 0, keep: 1, resume: false}
wandb: {mode: disabled}
EOF
  local override=()
  [ -n "$kind" ] && override=("$ATTN_KEY=$kind")
  env -u RANK -u WORLD_SIZE -u LOCAL_RANK MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
    timeout "$(left)" "$PYTHON" -m pipeline.train --config "$cfg" "${override[@]}" > "$log" 2>&1
  local rc=$?
  stamp "trainer run attention=$name finished (exit $rc)"
  if [ $rc -ne 0 ]; then fail "train attention=$name (exit $rc)" "$log"; return 1; fi
  "$PYTHON" - "$run/metrics.jsonl" "$WARMUP" "$log" "$name" "$WORK/train_$name.json" <<'EOF' | tee -a "$REPORT"
import json, re, sys
path, warmup, log, name, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
steps = {}
for line in open(path):
    m = json.loads(line)
    if m.get("kind") == "train":
        steps[m["step"]] = m
timed = [steps[s] for s in sorted(steps)[warmup:]]
secs = sum(m["step_time_s"] for m in timed)
toks = sum(m["tokens_per_s"] * m["step_time_s"] for m in timed)
mfus = [m["mfu"] for m in timed if m.get("mfu") is not None]
peak = max(m["peak_memory_bytes"] for m in steps.values())
saved = re.findall(r"checkpoint step \d+ saved in ([0-9.]+) s", open(log).read())
r = {"attention": name, "steps": len(timed), "tokens_per_s": toks / secs,
     "mfu": sum(mfus) / len(mfus) if mfus else None, "peak_memory_gib": peak / 2 ** 30,
     "save_s": float(saved[-1]) if saved else None, "loss_last": timed[-1]["loss"]}
json.dump(r, open(out, "w"))
mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
save = f"{r['save_s']:.1f} s" if r["save_s"] is not None else "n/a"
print(f"train attention={name:<8} {r['tokens_per_s']:>10.0f} tokens/s | MFU {mfu:>6} | peak memory "
      f"{r['peak_memory_gib']:.1f} GiB | {len(timed)} timed steps | loss {r['loss_last']:.3f} | "
      f"final checkpoint saved in {save}")
EOF
}

decode() {  # $1 = a run folder: decode from its checkpoint (tokenizer copied next to it)
  local run=$1 log=$WORK/decode.log devflag=()
  if "$PYTHON" bench/bench_decoding.py --help 2>/dev/null | grep -q -- "--device"; then
    devflag=(--device "$DEVICE")
  elif [ "$DEVICE" != cpu ]; then
    say "decoding: skipped (bench/bench_decoding.py has no --device option in this tree)"; return 0
  fi
  cp -r "$WORK/tokenizer" "$run/tokenizer"
  MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
    timeout "$(left)" "$PYTHON" bench/bench_decoding.py --model "$run/checkpoints" --data "$DATA" \
    --prompts "$PROMPTS" --gen-length "$GEN" --slot-size 8 --num-blocks 2 --batch-size "$PROMPTS" \
    --repeats "$DECODE_REPEATS" "${devflag[@]}" > "$log" 2>&1 || { fail "decoding" "$log"; return 1; }
  stamp "decoding finished"
  say "decoding from the $(basename "$run") checkpoint ($PROMPTS prompts, $GEN new tokens; random weights):"
  grep -E "^(mode|ar |refusion)" "$log" | sed 's/^/    /' | tee -a "$REPORT"
}

FIRST=""
if [ -z "$ATTN_KEY" ]; then
  say "model.attention: not available in this tree; only the model's default kernel is trained"
  ATTNS=""
fi
for kind in $ATTNS; do
  over_budget "train attention=${kind:-default}" && break
  if run_trainer "$kind" && [ -z "$FIRST" ]; then
    FIRST=${kind:-default}
    over_budget "decoding" || decode "$WORK/run_$FIRST"
  fi
  rm -rf "$WORK/run_${kind:-default}/checkpoints"
done
if [ -z "$ATTNS" ] && ! over_budget "train"; then
  run_trainer "" && FIRST=default && decode "$WORK/run_default"
  rm -rf "$WORK/run_default/checkpoints"
fi

# ---- 3. gradient agreement with sdpa on one packed batch ----------------------------------
# bench/attention_check.py's attention_parity: one model, one packed batch, each kernel's logits
# and gradients against sdpa's (same weights, same dtype).
if [ -n "$ATTN_KEY" ] && ! over_budget "gradient agreement"; then
  if ! grep -qs "def attention_parity" bench/attention_check.py; then
    say "gradient agreement: skipped (bench/attention_check.py attention_parity not in this tree)"
  else
    MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
      timeout "$(left)" "$PYTHON" - "$PRESET" "$SEQ" "$MBS" "$DEVICE" $ATTNS > "$WORK/grads.log" 2>&1 <<'EOF'
import sys
import torch
sys.path.insert(0, "bench")
from attention_check import attention_parity
from pipeline.model import ModelConfig
from pipeline.parallel import init_distributed
preset, seq, mbs, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
kinds = [k for k in sys.argv[5:] if k != "sdpa"]
init_distributed(1, backend="gloo")
cfg = ModelConfig.from_yaml(preset)
grads = device != "cpu"           # torch has no flex backward on the CPU
res = attention_parity(cfg, kinds, rows=mbs, row_length=seq, dtype=torch.bfloat16,
                       device=device, grads=grads)
print(f"gradient agreement with sdpa (bench/attention_check.py: one random packed batch, "
      f"{mbs} x {seq}, bf16, same weights; relative L2 difference, worst parameter):")
for kind in kinds:
    r = res[kind]
    g = (f"gradients {r['grad_rel']:.2e} ({r['grad_worst']}), max abs {r['grad_max_abs']:.2e}"
         if r["grad_rel"] is not None else "gradients not compared (forward only on the CPU)")
    print(f"    {kind}: logits {r['logits_rel']:.2e}; {g}; step {r['seconds']:.3f} s "
          f"(sdpa {res['sdpa']['seconds']:.3f} s)")
EOF
    rc=$?
    stamp "gradient agreement finished (exit $rc)"
    grep -E "^(gradient agreement|    )" "$WORK/grads.log" | tee -a "$REPORT"
    [ $rc -eq 0 ] || fail "gradient agreement (exit $rc)" "$WORK/grads.log"
  fi
fi

# ---- 4. bench_train_step.py on the same device and data, as a ratio -----------------------
if ! over_budget "reference-style step"; then
  if MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
     timeout "$(left)" "$PYTHON" bench/bench_train_step.py --data "$DATA" --model-config "$PRESET" \
       --steps "$BENCH_STEPS" --rows "$MBS" --row-length "$SEQ" --device "$DEVICE" --dtype bf16 \
       --json "$WORK/ref.json" > "$WORK/ref.log" 2>&1; then
    stamp "bench_train_step.py finished"
    "$PYTHON" - "$WORK" <<'EOF' | tee -a "$REPORT"
import glob, json, os, sys
work = sys.argv[1]
ref = json.load(open(os.path.join(work, "ref.json")))
r, o = ref["reference"]["tokens_per_s"], ref["ours"]["tokens_per_s"]
print(f"bench_train_step.py ({ref['device']}, {ref['dtype']}, plain AdamW, no DeepSpeed): "
      f"reference-style padded step {r:.0f} tokens/s, our packed step {o:.0f} tokens/s "
      f"({o / r:.2f}x)")
for path in sorted(glob.glob(os.path.join(work, "train_*.json"))):
    t = json.load(open(path))
    print(f"    trainer attention={t['attention']:<8} / reference-style step: "
          f"{t['tokens_per_s'] / r:.2f}x tokens/s")
EOF
  else
    fail "bench_train_step.py" "$WORK/ref.log"
  fi
fi

printf '\n===== GPU check summary (%s s) =====\n' "$(elapsed)"
cat "$REPORT"
[ "$FAILED" = 0 ] || { echo "bench/gpu_check.sh: some parts failed (see above)"; exit 1; }
exit 0
