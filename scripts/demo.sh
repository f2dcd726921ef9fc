#!/usr/bin/env bash
# The main job on the embedded default corpus (the Python standard library sources).
# Stages: 1. data (tokenizer + shards); later stages train a tiny ReFusion model and decode.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${DEMO_DIR:-outputs/demo}
mkdir -p "$OUT"

# ---------------------------------------------------------------- 1. data
# A small SentencePiece BPE tokenizer (pieces <pad> <unk> <s> </s> <|mask|> <|user|>
# <|assistant|>, byte fallback) trained on the stdlib sources, then shards of the same corpus:
# each file as text (cut into MAX_LEN-token chunks) and each documented function as a
# query/response pair (signature + docstring -> body), with a validation split.
# Rerunning keeps finished shards; changed options replace them (--overwrite).
SPM_MODEL=${SPM_MODEL:-$OUT/tokenizer/spm.model}
SPM_VOCAB=${SPM_VOCAB:-6000}
SHARDS=${SHARDS:-$OUT/shards}
MAX_LEN=${MAX_LEN:-256}
VAL_FRACTION=${VAL_FRACTION:-0.02}
SLOT_SIZES=${SLOT_SIZES:-4,8,16,32}
DATA_WORKERS=${DATA_WORKERS:-2}

echo "== 1. data"
if [ ! -f "$SPM_MODEL" ]; then
  "$PY" data_prep/train_tokenizer.py --input stdlib --output "$SPM_MODEL" --vocab-size "$SPM_VOCAB"
else
  echo "tokenizer: $SPM_MODEL exists, kept"
fi
"$PY" data_prep/shard.py --input stdlib --format auto --tokenizer "$SPM_MODEL" \
  --output "$SHARDS" --max-length "$MAX_LEN" --val-fraction "$VAL_FRACTION" \
  --slot-sizes "$SLOT_SIZES" --seed 0 --workers "$DATA_WORKERS" --no-progress --overwrite
echo "data: tokenizer $SPM_MODEL, shards $SHARDS (manifest: $SHARDS/manifest.json)"
