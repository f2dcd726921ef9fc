#!/usr/bin/env bash
# slurm/shard.sh: data prep on a SLURM cluster as a job array (data_prep/README.md "On a
# cluster"): the plan once, K array tasks, then the merge as a job that runs after the array
# ends (afterany) and checks every part itself rather than trusting the tasks' exit codes.
#
# Usage (`submit` makes logs/ in the current directory, where Slurm writes the jobs' logs):
#   slurm/shard.sh submit K [sbatch options for the tasks] -- SHARD_PLAN_OPTIONS...
#   slurm/shard.sh submit 64 --cpus-per-task=8 --time=04:00:00 -- \
#       --input 's3://corpus/*.jsonl' --output s3://bucket/shards --tokenizer /ckpt/Qwen3-8B \
#       --max-length 4096 --val-fraction 0.001
# `submit` runs on the login node and submits three jobs: the plan (`shard.py plan` with the
# options after `--`), the array of K tasks (afterok on the plan; each `shard.py run` with
# --workers = its cores), and the merge (afterany on the array). It prints their job ids.
# A failed merge names each missing or damaged unit and the command that makes it again
# (`shard.py run --output OUT --unit N --overwrite`); run that (or resubmit the array: complete
# parts are kept), then `sbatch slurm/shard.sh merge OUT`.
#
# The same script is the body of each job (the first argument says which):
#   sbatch slurm/shard.sh plan SHARD_PLAN_OPTIONS...
#   sbatch --array=0-63 slurm/shard.sh run OUT
#   sbatch slurm/shard.sh merge OUT
# Signals: SIGNAL_MARGIN seconds before a task's time limit Slurm sends SIGUSR1 to this batch
# shell (`--signal=B:USR1@120` below); it is passed to shard.py as SIGINT, which stops after
# removing its partial shard (complete shards are kept, exit code 130); the task is then
# requeued (`scontrol requeue`) and resumes its unit. SIGTERM (scancel, preemption) is passed on
# the same way without a requeue. A task run twice, a retried task and a resubmitted array
# leave the same parts (each unit's output is finished atomically and kept when complete).
#
# Environment knobs (all optional):
#   REFUSION_ROOT      repository root (default: the folder above this script; the jobs run in
#                      the directory `submit` was called from, where logs/ is made)
#   PYTHON             interpreter (default: $REFUSION_ROOT/.venv/bin/python)
#   WORKERS            tokenizer processes per task (default: the task's cores)
#   REQUEUE_ON_SIGNAL  1 (default) requeue a task stopped by SIGUSR1; 0 to not
#
#SBATCH --job-name=refusion-shard
#SBATCH --nodes=1
#SBATCH --ntasks=1
#SBATCH --time=02:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%A_%a.out
set -uo pipefail

log() { printf '[shard.sh %s] %s\n' "$(date +%T)" "$*"; }
die() { printf 'slurm/shard.sh: error: %s\n' "$*" >&2; exit 2; }
usage="usage: slurm/shard.sh submit K [sbatch options] -- SHARD_PLAN_OPTIONS... (or, as a job: plan OPTIONS... | run OUT | merge OUT)"

[ $# -ge 1 ] || die "$usage"
STAGE=$1; shift
# The jobs run in the submit directory (relative --input/--output paths mean the same to every
# stage); `submit` exports REFUSION_ROOT, the repository this script is in, for them.
if [ "$STAGE" = submit ]; then
  ROOT=${REFUSION_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
else
  ROOT=${REFUSION_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
fi
[ -f "$ROOT/data_prep/shard.py" ] || die "REFUSION_ROOT=$ROOT: not the repository (no data_prep/shard.py)"
export REFUSION_ROOT=$ROOT
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || die "PYTHON=$PYTHON is not executable (create the venv, or set PYTHON)"
SHARD="$ROOT/data_prep/shard.py"
export PYTHONUNBUFFERED=1

output_of() {  # the value of --output in a shard.py argument list
  local prev=""
  for a in "$@"; do
    case "$a" in --output=*) printf '%s' "${a#--output=}"; return;; esac
    [ "$prev" = --output ] && { printf '%s' "$a"; return; }
    prev=$a
  done
}

if [ "$STAGE" = submit ]; then
  [ $# -ge 1 ] || die "$usage"
  K=$1; shift
  [ "$K" -ge 1 ] 2>/dev/null || die "K must be a number of tasks >= 1, got '$K'"
  TASK_OPTS=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do TASK_OPTS+=("$1"); shift; done
  [ "${1:-}" = -- ] || die "missing -- before the shard.py plan options; $usage"
  shift
  OUT=$(output_of "$@")
  [ -n "$OUT" ] || die "the shard.py plan options need --output"
  mkdir -p logs
  PLAN_JOB=$(sbatch --parsable --job-name=refusion-shard-plan --output=logs/%x-%j.out \
             "$0" plan "$@") || die "sbatch (plan) failed"
  ARRAY_JOB=$(sbatch --parsable --job-name=refusion-shard-run --array=0-$((K - 1)) \
              --dependency=afterok:"$PLAN_JOB" "${TASK_OPTS[@]}" "$0" run "$OUT") || die "sbatch (array) failed"
  MERGE_JOB=$(sbatch --parsable --job-name=refusion-shard-merge --output=logs/%x-%j.out \
              --dependency=afterany:"$ARRAY_JOB" "$0" merge "$OUT") || die "sbatch (merge) failed"
  echo "plan $PLAN_JOB array $ARRAY_JOB merge $MERGE_JOB"
  exit 0
fi

[ -n "${SLURM_JOB_ID:-}" ] || die "'$STAGE' runs inside a Slurm job; submit with: slurm/shard.sh submit K ... -- ..."

CHILD=""
SIGNALLED=""
forward() {  # pass a signal on to shard.py as SIGINT (it stops cleanly, keeping complete shards)
  [ "$1" = USR1 ] && SIGNALLED=USR1
  [ "$1" = TERM ] && [ -z "$SIGNALLED" ] && SIGNALLED=TERM
  log "received SIG$1: stopping shard.py (complete shards are kept)"
  [ -n "$CHILD" ] && kill -s INT "$CHILD" 2>/dev/null
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

case "$STAGE" in
  plan)
    log "job $SLURM_JOB_ID: plan"
    "$PYTHON" "$SHARD" plan "$@" &
    ;;
  run)
    [ $# -eq 1 ] || die "usage: sbatch --array=0-(K-1) slurm/shard.sh run OUT"
    [ -n "${SLURM_ARRAY_TASK_ID:-}" ] || die "'run' is an array job: sbatch --array=0-(K-1) slurm/shard.sh run $1"
    CORES=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}
    WORKERS=${WORKERS:-${CORES%%(*}}
    log "job ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID} (restart ${SLURM_RESTART_COUNT:-0}): task $((SLURM_ARRAY_TASK_ID - ${SLURM_ARRAY_TASK_MIN:-0})) of ${SLURM_ARRAY_TASK_COUNT:-?}, $WORKERS worker(s)"
    # shard.py takes the task from SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN and the count
    # from SLURM_ARRAY_TASK_COUNT
    "$PYTHON" "$SHARD" run --output "$1" --workers "$WORKERS" &
    ;;
  merge)
    [ $# -eq 1 ] || die "usage: sbatch slurm/shard.sh merge OUT"
    log "job $SLURM_JOB_ID: merge (checks every part; the tasks' exit codes are not trusted)"
    "$PYTHON" "$SHARD" merge --output "$1" &
    ;;
  *) die "unknown stage '$STAGE'; $usage" ;;
esac
CHILD=$!
# `wait` returns early (status > 128) whenever a trapped signal arrives; wait until it is gone.
while kill -0 "$CHILD" 2>/dev/null; do wait "$CHILD"; done
wait "$CHILD"; rc=$?
log "shard.py $STAGE exited with status $rc"
if [ "$STAGE" = run ] && [ "$SIGNALLED" = USR1 ] && [ "$rc" = 130 ] && [ "${REQUEUE_ON_SIGNAL:-1}" = 1 ]; then
  log "stopped on SIGUSR1: requeueing ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
  scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
fi
exit "$rc"
