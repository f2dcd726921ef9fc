#!/usr/bin/env bash
# The main job on the embedded default corpus (filled in as the pipeline grows).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${DEMO_DIR:-outputs/demo}
mkdir -p "$OUT"
echo "demo: nothing to run yet"
