#!/usr/bin/env bash
# The main job: the ReFusion recipe of docs/EXPERIMENTS.md run 5 (objective dual, dual_masking
# refusion, ar_weight 16) trained from scratch on a mixture of embedded math word problems (95%
# of the tokens) and standard-library functions (5%), then the
# held-out problems decoded AR and with a lossless draft mode (verify draft_ahead: greedy, one
# slot at a time, token threshold >= 0.5, so its answers are AR's token for token).
# Stages: 1. data (problems, tokenizer, shards), 2. train, 3. export, 4. decode, 5. evaluate,
# 6. summary, 7. plots (python -m pipeline.report).
# Exit 1 with one line when the training loss did not fall or the draft mode's answers are not
# identical to AR's.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${DEMO_DIR:-outputs/demo}
mkdir -p "$OUT"
SECONDS=0
stage_done() { echo "-- $1: ${SECONDS} s"; SECONDS=0; }

# ---------------------------------------------------------------- 1. data
# GSM8K-form word problems (data_prep/math_problems.py) made easy enough for a few minutes of
# CPU training: the 2-step templates only, every number <= MATH_MAX_VALUE; TEST_PROBLEMS
# held-out problems (keys never in training). A SentencePiece tokenizer trained on the training
# problems, then shards (one problem per sample, 1% held out for the validation loss).
# Rerunning keeps the problems and the tokenizer (delete them to regenerate) and finished
# shards; changed shard options replace the shards (--overwrite).
PROBLEMS=${PROBLEMS:-$OUT/problems}
MATH_TEMPLATES=${MATH_TEMPLATES:-packs,share,pages}
MATH_MAX_VALUE=${MATH_MAX_VALUE:-40}
TRAIN_PROBLEMS=${TRAIN_PROBLEMS:-3000}
TEST_PROBLEMS=${TEST_PROBLEMS:-100}
SPM_MODEL=${SPM_MODEL:-$OUT/tokenizer/spm.model}
SPM_VOCAB=${SPM_VOCAB:-400}
SHARDS=${SHARDS:-$OUT/shards}
DATA_WORKERS=${DATA_WORKERS:-2}

echo "== 1. data"
if [ ! -f "$PROBLEMS/info.json" ]; then
  "$PY" data_prep/math_problems.py --output "$PROBLEMS" --train "$TRAIN_PROBLEMS" \
    --test "$TEST_PROBLEMS" --dev 0 --test-unseen 0 --seed 0 \
    --templates "$MATH_TEMPLATES" --max-value "$MATH_MAX_VALUE"
else
  echo "problems: $PROBLEMS exists, kept"
fi
if [ ! -f "$SPM_MODEL" ]; then
  "$PY" data_prep/train_tokenizer.py --input "$PROBLEMS/train.jsonl" --output "$SPM_MODEL" \
    --vocab-size "$SPM_VOCAB"
else
  echo "tokenizer: $SPM_MODEL exists, kept"
fi
"$PY" data_prep/shard.py --input "$PROBLEMS/train.jsonl" --format auto --tokenizer "$SPM_MODEL" \
  --output "$SHARDS" --max-length 256 --val-fraction 0.01 \
  --slot-sizes 4,8,16,32 --seed 0 --workers "$DATA_WORKERS" --no-progress --overwrite
# The second source of the data mixture: functions of the Python standard library as
# signature + docstring -> body pairs, tokenized with the same tokenizer (its byte fallback
# covers characters the problems lack), CODE_LIMIT of them; CODE_WEIGHT of the training tokens.
CODE_SHARDS=${CODE_SHARDS:-$OUT/stdlib_shards}
CODE_LIMIT=${CODE_LIMIT:-2000}
CODE_WEIGHT=${CODE_WEIGHT:-0.05}
"$PY" data_prep/shard.py --input stdlib --format qa --tokenizer "$SPM_MODEL" \
  --output "$CODE_SHARDS" --max-length 256 --val-fraction 0.01 --limit "$CODE_LIMIT" \
  --slot-sizes 4,8,16,32 --seed 0 --workers "$DATA_WORKERS" --no-progress --overwrite
echo "data: problems $PROBLEMS, tokenizer $SPM_MODEL, shards $SHARDS ($SHARDS/manifest.json)," \
  "stdlib functions $CODE_SHARDS"
stage_done "data"

# ---------------------------------------------------------------- 2. train
# A small Qwen3 (configs/model/demo.yaml) trained from scratch with the dual objective
# (configs/demo.yaml) on a two-source mixture (math problems, stdlib functions): 2 processes (pipeline.launch = torchrun keeping our exit codes, gloo),
# DeepSpeed ZeRO-3 over the data-parallel group, wandb offline, checkpoints under
# $RUN/checkpoints (a rerun resumes from the latest one).
RUN=${RUN:-$OUT/run}
NPROC=${NPROC:-2}
TRAIN_STEPS=${TRAIN_STEPS:-560}
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export WANDB_MODE=${WANDB_MODE:-offline}

echo "== 2. train ($NPROC processes, ZeRO-3, $TRAIN_STEPS steps; run dir $RUN)"
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONWARNINGS=${PYTHONWARNINGS:-ignore::FutureWarning} \
  "$PY" -m pipeline.launch --standalone --nproc_per_node "$NPROC" -m pipeline.train \
  --config configs/demo.yaml run_dir="$RUN" data.sources.0.dir="$SHARDS" \
  data.sources.1.dir="$CODE_SHARDS" data.sources.0.weight="$(awk "BEGIN{print 1-$CODE_WEIGHT}")" \
  data.sources.1.weight="$CODE_WEIGHT" train.max_steps="$TRAIN_STEPS"
stage_done "train"

# ---------------------------------------------------------------- 3. export
HF=${HF:-$OUT/hf}
echo "== 3. export the latest checkpoint to a Hugging Face folder ($HF)"
"$PY" -m pipeline.export "$RUN/checkpoints" "$HF" --tokenizer "$SHARDS/tokenizer" \
  --dtype float32 --overwrite
cp "$SHARDS/tokenizer/tokenizer.model" "$HF/tokenizer.model"
stage_done "export"

# ---------------------------------------------------------------- 4. decode
# The held-out problems ($PROBLEMS/test.jsonl, the "query" of each record in the data
# pipeline's prompt layout <s> <|user|> query <|assistant|>), greedy, in one batch, decoded
# AR and with verify draft_ahead (slots of DRAFT_SLOT tokens left to right, each drafted
# inside the previous verify forward; masks attending both ways, as the dual objective trains
# them). GEN_LENGTH: a multiple of DRAFT_SLOT (the longest reference answer is 70 tokens).
SPM_FILE="$SHARDS/tokenizer/tokenizer.model"
GEN_LENGTH=${GEN_LENGTH:-80}
DRAFT_SLOT=${DRAFT_SLOT:-4}
COMMON=(--gen-length "$GEN_LENGTH" --batch-size "$TEST_PROBLEMS" --temperature 0)
DRAFT=(--mode refusion --verify draft_ahead --slot-size "$DRAFT_SLOT" --token-threshold 0.9
       --mask-attention bidirectional)
echo "== 4. decode the $TEST_PROBLEMS held-out problems (ar; draft_ahead k=$DRAFT_SLOT)"
"$PY" -m pipeline.generate --model "$HF" --tokenizer "$SPM_FILE" --prompts "$PROBLEMS/test.jsonl" \
  --mode ar "${COMMON[@]}" --output "$OUT/decode_ar.json" | tail -n 1
"$PY" -m pipeline.generate --model "$HF" --tokenizer "$SPM_FILE" --prompts "$PROBLEMS/test.jsonl" \
  "${DRAFT[@]}" "${COMMON[@]}" --output "$OUT/decode_draft_ahead.json" | tail -n 1
stage_done "decode"

# ---------------------------------------------------------------- 5. evaluate
# The training checkpoint itself (not the export): its run's objective and seed, so the loss is
# the trainer's validation loss at that step, recomputed in one process.
echo "== 5. evaluate the checkpoint on the validation split (loss; 16 problems' final answers)"
"$PY" -m pipeline.evaluate --model "$RUN/checkpoints" --tokenizer "$SPM_FILE" --data "$SHARDS" \
  --limit 16 --metric final_answer --modes ar,refusion --gen-length "$GEN_LENGTH" "${DRAFT[@]:2}" \
  --batch-size 16 --output "$OUT/eval.json"
stage_done "evaluate"

# ---------------------------------------------------------------- 6. summary
echo "== 6. summary"
"$PY" scripts/demo_summary.py --metrics "$RUN/metrics.jsonl" --problems "$PROBLEMS/test.jsonl" \
  --ar "$OUT/decode_ar.json" --draft "$OUT/decode_draft_ahead.json" --eval "$OUT/eval.json" \
  --weights "math=$(awk "BEGIN{print 1-$CODE_WEIGHT}"),stdlib=$CODE_WEIGHT"
stage_done "summary"

# ---------------------------------------------------------------- 7. plots
echo "== 7. plots"
"$PY" -m pipeline.report "$RUN" --output "$OUT/report"
echo "pictures: $OUT/report/loss.png (losses), $OUT/report/throughput.png (tokens/s, memory)," \
  "$OUT/report/sources.png (loss and token share per data source);" \
  "summary: $OUT/report/summary.md"
stage_done "plots"
