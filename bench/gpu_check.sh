#!/usr/bin/env bash
# bench/gpu_check.sh: the one prepared GPU check (issue 19). Not a test; CI never needs it.
#
#   bash bench/gpu_check.sh                    # one CUDA GPU (one H200: at most about 8 minutes)
#   GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh  # reduced CPU smoke mode: tiny model, same parts
#
# No network, no checkpoint saves. On one GPU it:
#  0. writes a folder of random packed-training shards (rows of 4096 tokens, Qwen3's vocabulary;
#     the real Qwen3 tokenizer in $WORK/tokenizer);
#  (a) decoding: bench/gpu_decode_check.py (per-forward milliseconds of AR and refusion decoding,
#     the CUDA-graph AR step, AR tokens/s against transformers' `generate` with its static
#     cache, decode memory (ar, draft_every) against plan_decoding, the share of prompts whose
#     draft_ahead / draft_every ids equal bf16 AR decoding's; it prints its own lines and
#     targets);
#  (b) bench/bench_levers.py on the 16-layer Qwen3-8B-shaped proxy (configs/model/
#     qwen3_8b_16layers.yaml, 4.33B parameters) in ONE process: the plain packed step (no
#     DeepSpeed) with today's settings, then each lever alone (recompute selective / none,
#     loss fused / torch, fused AdamW, compiled regions), then all (the best measured choice of
#     each): tokens/s, MFU, HFU, peak memory, and a torch.profiler split of one step of the
#     baseline and of "all" (GEMM, attention, elementwise, loss, optimizer, idle);
#  (c) the real trainer (bench/trainer_steps.py: `pipeline.train.Trainer`, DeepSpeed ZeRO-3,
#     DP=1, bf16, packed rows, micro-batch 2) on the same proxy for GPU_CHECK_STEPS steps, first
#     with today's defaults (activation checkpointing full, chunked loss, foreach AdamW, no
#     compile), then with the settings (b) chose (or, when (b) did not finish, all levers on);
#     tokens/s, MFU, HFU, peak memory of the steps after GPU_CHECK_WARMUP, and memory against
#     the plan (pipeline.plan_memory): the peak vs the planned total, the model states and the
#     last step's working memory (max_memory_allocated) vs the plan's split; then, with 80 s or
#     more left, the chosen settings with ZeRO stage 1 (DP=1: what stage 3's gathering costs);
#  (d) time permitting (GPU_CHECK_CONTINUITY=1, the default), today's trainer on the 4-layer
#     proxy, for continuity with the 2026-11-30 figures.
# The closing block "GPU check summary" prints every figure and the targets of issue 19 (MFU >=
# 45% through the real trainer on the 16-layer proxy); docs/PERFORMANCE.md keeps the dated log.
#
# Without CUDA (and without GPU_CHECK_SMOKE=1) it prints one error line and exits 2.
# A part that cannot run in this tree prints one line saying so and the check goes on; a part
# that fails prints the tail of its log. Exit status: 0 when every part that ran succeeded,
# 1 otherwise.
#
# Knobs (environment): PYTHON (default .venv/bin/python), GPU_CHECK_STEPS (6),
# GPU_CHECK_WARMUP (2), GPU_CHECK_MICRO_BATCH (2), GPU_CHECK_LIMIT_S (470: every part is given
# only the time left until then, at most its own cap below, and a part with less than 30 s left
# is skipped with one line, so the whole check ends within 8 minutes), GPU_CHECK_DECODE_S (95,
# cap of part a), GPU_CHECK_LEVERS_S (130, cap of part b), GPU_CHECK_TRAIN_S (100, cap of each
# trainer run), GPU_CHECK_CONTINUITY (1), GPU_CHECK_WORKDIR (default: a fresh folder under
# /dev/shm when it has 8 GB free, else under $TMPDIR; removed at the end unless GPU_CHECK_KEEP=1).
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
STEPS=${GPU_CHECK_STEPS:-6}; WARMUP=${GPU_CHECK_WARMUP:-2}; MBS=${GPU_CHECK_MICRO_BATCH:-2}
DECODE_S=${GPU_CHECK_DECODE_S:-95}; LEVERS_S=${GPU_CHECK_LEVERS_S:-130}
TRAIN_S=${GPU_CHECK_TRAIN_S:-100}; CONTINUITY=${GPU_CHECK_CONTINUITY:-1}

if [ "$SMOKE" = 1 ]; then
  export DS_ACCELERATOR=cpu
  DEVICE=cpu; GPU_NAME="CPU (smoke mode)"; DTYPE=fp32
  SEQ=128; NTRAIN=48; LIMIT=${GPU_CHECK_LIMIT_S:-600}
  LEVER_STEPS=2; LEVER_WARMUP=1
  [ -n "${GPU_CHECK_STEPS:-}" ] || STEPS=3
  [ -n "${GPU_CHECK_WARMUP:-}" ] || WARMUP=1
else
  GPU_NAME=$("$PYTHON" -c 'import sys, torch
if not torch.cuda.is_available(): sys.exit(1)
print(torch.cuda.get_device_name(0))' 2>/dev/null) \
    || die "no CUDA device visible (torch.cuda.is_available() is False in $PYTHON); this check needs one GPU (GPU_CHECK_SMOKE=1 runs the reduced CPU smoke mode)"
  DEVICE=cuda; DTYPE=bf16
  SEQ=4096; NTRAIN=400; LIMIT=${GPU_CHECK_LIMIT_S:-470}
  PROXY=configs/model/qwen3_8b_16layers.yaml; PROXY4=configs/model/qwen3_8b_4layers.yaml
  LEVER_STEPS=3; LEVER_WARMUP=1
fi
[ "$STEPS" -gt "$WARMUP" ] 2>/dev/null || die "GPU_CHECK_STEPS=$STEPS must exceed GPU_CHECK_WARMUP=$WARMUP"

if [ -n "${GPU_CHECK_WORKDIR:-}" ]; then
  WORK=$GPU_CHECK_WORKDIR; mkdir -p "$WORK" || die "cannot create GPU_CHECK_WORKDIR=$WORK"
else
  base=${TMPDIR:-/tmp}
  shm_free_kb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print $4}')
  [ "$SMOKE" != 1 ] && [ "${shm_free_kb:-0}" -gt 8388608 ] && base=/dev/shm
  WORK=$(mktemp -d "$base/gpu_check.XXXXXX") || die "cannot create a work folder under $base"
  [ "${GPU_CHECK_KEEP:-0}" = 1 ] || trap 'rm -rf "$WORK"' EXIT
fi
REPORT=$WORK/report.txt; : > "$REPORT"
FAILED=0
if [ "$SMOKE" = 1 ]; then  # the tiny test shape with Qwen3's vocabulary; 4 layers for 16, 2 for 4
  PROXY=$WORK/smoke_proxy16.yaml; PROXY4=$WORK/smoke_proxy4.yaml
  sed -E "s/^vocab_size:.*/vocab_size: 151936/; s/^num_layers:.*/num_layers: 4/" \
    configs/model/tiny.yaml > "$PROXY"
  sed -E "s/^vocab_size:.*/vocab_size: 151936/; s/^num_layers:.*/num_layers: 2/" \
    configs/model/tiny.yaml > "$PROXY4"
fi
left() { echo $(( LIMIT - $(elapsed) )); }   # seconds left until GPU_CHECK_LIMIT_S
budget() { local l; l=$(left); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }  # min(left, cap)
over_budget() {  # $1 = part name; true (and one line) when less than 30 s are left
  if [ "$(left)" -lt 30 ]; then
    say "$1: skipped (GPU_CHECK_LIMIT_S=$LIMIT s nearly spent)"; return 0
  fi
  return 1
}
fail() {  # $1 = part, $2 = log
  FAILED=1; say "$1: FAILED (log tail below)"; tail -n 25 "$2" | sed 's/^/    /'
}

# ---- 0. data ------------------------------------------------------------------------------
DATA=$WORK/data
"$PYTHON" - "$DATA" "$SEQ" "$NTRAIN" "$WORK/tokenizer" > "$WORK/data.log" 2>&1 <<'EOF' || die "writing the random shards failed: $(tail -n 3 "$WORK/data.log")"
import sys
import numpy as np
sys.path.insert(0, "tests")
from shard_fixtures import random_samples, write_shards
from tiny_qwen3 import REFUSION_TOKENS, qwen_tokenizer_dir
from transformers import AutoTokenizer
from pipeline.tokenizer import load_tokenizer
out, seq, n, tokdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# the real Qwen3 tokenizer (+ the ReFusion tokens), for the shards' manifest and for decoding
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
say "GPU check on $GPU_NAME, $(date -u +%Y-%m-%d), torch $("$PYTHON" -c 'import torch; print(torch.__version__)'); packed rows of $SEQ tokens, micro-batch $MBS, $DTYPE; work folder $WORK"

# ---- (a) decoding: bench/gpu_decode_check.py ------------------------------------------------
# Its stdout lines (per-forward ms, tokens/s against transformers, the targets) go into the
# summary as they are; its figures also land in $WORK/decode.json.
if [ -f bench/gpu_decode_check.py ]; then
  if ! over_budget "decoding (bench/gpu_decode_check.py)"; then
    dargs=(--budget-s "$(( $(budget "$DECODE_S") - 10 ))" --json "$WORK/decode.json")
    [ "$SMOKE" = 1 ] && dargs+=(--smoke)
    MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
      timeout "$(budget "$DECODE_S")" "$PYTHON" bench/gpu_decode_check.py "${dargs[@]}" \
      > "$WORK/decode.log" 2>&1
    rc=$?
    stamp "decoding check finished (exit $rc)"
    say "decoding (bench/gpu_decode_check.py ${dargs[*]}):"
    grep -v -E "^\[|Warning|warn\(" "$WORK/decode.log" | tail -n 30 | sed 's/^/    /' | tee -a "$REPORT"
    [ $rc -eq 0 ] || fail "decoding (exit $rc)" "$WORK/decode.log"
  fi
else
  say "decoding: bench/gpu_decode_check.py is not in this tree; skipped"
fi
# <<< end of the decode part

# ---- (b) the levers, one process, plain step ---------------------------------------------
LEVERS_JSON=$WORK/levers.json
if ! over_budget "levers (bench/bench_levers.py)"; then
  lim=$(budget "$LEVERS_S")
  MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
    timeout "$lim" "$PYTHON" bench/bench_levers.py --data "$DATA" --model-config "$PROXY" \
      --rows "$MBS" --row-length "$SEQ" --steps "$LEVER_STEPS" --warmup "$LEVER_WARMUP" \
      --device "$DEVICE" --dtype "$DTYPE" --json "$LEVERS_JSON" --time-limit $(( lim * 6 / 10 )) \
      > "$WORK/levers.log" 2>&1
  rc=$?
  stamp "levers finished (exit $rc)"
  say "levers (bench/bench_levers.py, plain packed step without DeepSpeed, $(basename "$PROXY")):"
  grep -E "^(model |baseline|selective|none|loss_|optim_|compile|all |profile|chosen)" \
    "$WORK/levers.log" | sed 's/^/    /' | tee -a "$REPORT"
  [ $rc -eq 0 ] || fail "levers (exit $rc)" "$WORK/levers.log"
fi

# ---- (c) the real trainer: today's defaults, then the chosen levers ------------------------
CHOSEN=$("$PYTHON" -c 'import json, sys
try:
    print(" ".join(json.load(open(sys.argv[1]))["chosen_overrides"]))
except Exception:
    sys.exit(1)' "$LEVERS_JSON" 2>/dev/null) \
  || CHOSEN="train.activation_checkpointing=selective train.loss_impl=fused optim.fused=true train.compile=true"

run_trainer() {  # $1 = name, $2 = model preset, rest = overrides
  local name=$1 preset=$2; shift 2
  local cfg=$WORK/run_$name.yaml log=$WORK/run_$name.log
  cat > "$cfg" <<EOF
run_dir: $WORK/run_$name
model: {preset: $preset}
init: {source: random}
data: {dir: $DATA, max_length: $SEQ, pack: true, num_workers: 2, shuffle_buffer: 64}
optim: {lr: 1.0e-5, warmup_steps: 0, impl: torch}
train: {max_steps: $STEPS, micro_batch_size: $MBS, grad_accum_steps: 1,
        precision: $([ "$DTYPE" = bf16 ] && echo bf16 || echo fp32), zero_stage: 3,
        activation_checkpointing: full, tensor_parallel_size: 1, log_interval: 1,
        eval_interval: 0}
checkpoint: {interval: 0, keep: 1, resume: false}
wandb: {mode: disabled}
EOF
  [ "$SMOKE" = 1 ] && set -- "$@" log.peak_tflops=1.0   # an MFU/HFU figure in smoke mode too
  env -u RANK -u WORLD_SIZE -u LOCAL_RANK MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" \
    timeout "$(budget "$TRAIN_S")" "$PYTHON" bench/trainer_steps.py --config "$cfg" \
      --steps "$STEPS" --warmup "$WARMUP" --json "$WORK/train_$name.json" "$@" > "$log" 2>&1
  local rc=$?
  stamp "trainer run $name finished (exit $rc)"
  rm -rf "$WORK/run_$name"
  if [ $rc -ne 0 ]; then fail "trainer $name (exit $rc)" "$log"; return 1; fi
  "$PYTHON" - "$WORK/train_$name.json" "$name" <<'EOF' | tee -a "$REPORT"
import json, sys
r, name = json.load(open(sys.argv[1])), sys.argv[2]
pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
s = r["settings"]
print(f"    trainer {name:<12} {r['tokens_per_s']:>9.0f} tokens/s | MFU {pct(r['mfu'])} | HFU "
      f"{pct(r['hfu'])} | peak memory {r['peak_memory_gib']:.1f} GiB | step {r['step_s']:.2f} s "
      f"x {r['steps']} | loss {r['loss_last']:.3f} | recompute {s['activation_checkpointing']}, "
      f"loss {s['loss_impl']}, fused AdamW {s['optim_fused']}, compile {s['compile']}, "
      f"attention {s['attention']}, ZeRO-{s['zero_stage']} (set-up {r['setup_s']:.0f} s)")
print(f"    trainer {name:<12} memory: measured peak {r['peak_memory_gib']:.2f} GiB vs planned "
      f"{r['planned_memory_gib']:.2f} GiB (python -m pipeline.plan_memory; measured / planned "
      f"{r['peak_memory_gib'] / r['planned_memory_gib']:.2f})")
if r.get("measured_states_gib") is not None:
    print(f"    trainer {name:<12} memory by part: model states {r['measured_states_gib']:.2f} "
          f"GiB vs planned {r['planned_states_gib']:.2f} GiB; last step's working memory "
          f"{r['measured_step_gib']:.2f} GiB vs planned {r['planned_step_gib']:.2f} GiB")
EOF
}

if ! over_budget "trainer"; then
  say "real trainer (bench/trainer_steps.py: ZeRO-3, DP=1, $(basename "$PROXY"), $STEPS steps, timed after $WARMUP; no checkpoint):"
  run_trainer today "$PROXY"
  # shellcheck disable=SC2086  # CHOSEN is a list of key=value words
  over_budget "trainer chosen" || run_trainer chosen "$PROXY" $CHOSEN
  # the same with ZeRO stage 1 (DP=1: nothing to partition; what stage 3's machinery costs)
  if [ "$(left)" -ge 80 ]; then
    # shellcheck disable=SC2086
    run_trainer chosen_zero1 "$PROXY" $CHOSEN train.zero_stage=1
  else
    say "trainer chosen_zero1: skipped (under 80 s of GPU_CHECK_LIMIT_S left)"
  fi
fi
if [ "$CONTINUITY" = 1 ] && [ "$(left)" -ge 80 ]; then
  say "continuity (today's trainer on $(basename "$PROXY4")):"
  run_trainer today4 "$PROXY4"
fi

# ---- summary and targets --------------------------------------------------------------------
"$PYTHON" - "$WORK" "$SMOKE" <<'EOF' | tee -a "$REPORT"
import json, os, sys
work, smoke = sys.argv[1], sys.argv[2] == "1"
if smoke:
    print("smoke mode on the CPU: the figures above only show that every part runs (a shared CPU, "
          "a tiny model, log.peak_tflops=1); the targets apply on the GPU")
def load(name):
    p = os.path.join(work, name)
    return json.load(open(p)) if os.path.isfile(p) else None
today, chosen = load("train_today.json"), load("train_chosen.json")
runs = (today, chosen, load("train_chosen_zero1.json"))
best = max((r["mfu"] for r in runs if r and r.get("mfu") is not None), default=None)
if smoke:
    pass
elif best is None:
    print("target MFU >= 45% (goal 50%) through the real trainer on the 16-layer proxy: not measured")
else:
    verdict = "met" if best >= 0.45 else "NOT met"
    print(f"target MFU >= 45% (goal 50%) through the real trainer on the 16-layer proxy: best "
          f"{100 * best:.1f}% -> {verdict}")
if today and chosen:
    print(f"trainer, chosen levers / today's defaults: {chosen['tokens_per_s'] / today['tokens_per_s']:.2f}x "
          f"tokens/s")
EOF

printf '\n===== GPU check summary (%s s) =====\n' "$(elapsed)"
cat "$REPORT"
[ "$FAILED" = 0 ] || { echo "bench/gpu_check.sh: some parts failed (see above)"; exit 1; }
exit 0
