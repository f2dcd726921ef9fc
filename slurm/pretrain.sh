#!/usr/bin/env bash
# slurm/pretrain.sh: launch `python -m pipeline.train` on N nodes x G devices, one task per device.
#
# Usage (from the repository root; Slurm opens logs/ before this script runs, so create it):
#   mkdir -p logs
#   sbatch slurm/pretrain.sh CONFIG.yaml [key=value ...]                       # CPU defaults
#   sbatch --nodes=4 --ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=12 \
#          --time=24:00:00 slurm/pretrain.sh configs/qwen3_8b.yaml train.max_steps=20000
# Command-line sbatch options override the #SBATCH lines below. The defaults are CPU-friendly
# (one node, two tasks, no GPU request) so the same script runs on a one-node CPU cluster; on a
# GPU cluster enable the GPU block below (or pass its options to sbatch).
#
# Settings a GPU cluster needs (the "GPU block"):
# - One task per GPU: --ntasks-per-node=8 --gpus-per-node=8. Every task then sees the node's
#   GPUs and uses cuda:LOCAL_RANK. With --gpus-per-task=1 or --gpu-bind a task sees one GPU;
#   the trainer then uses LOCAL_RANK mod (visible GPUs) = cuda:0 and rewrites LOCAL_RANK to that
#   index for DeepSpeed (pipeline/parallel.py is the one home of that choice).
# - Cores: --cpus-per-task=12 (>= 8 per GPU task: the trainer's Python thread, DeepSpeed's
#   ZeRO-3 hooks, data.num_workers loader processes, the NCCL proxy). Since Slurm 22.05 `srun`
#   does not inherit --cpus-per-task from sbatch, so this script passes it explicitly:
#   CPUS_PER_TASK = $CPUS_PER_TASK, else the job's SLURM_CPUS_PER_TASK, else the node's
#   allocated cores / tasks per node (what the allocation gives; 1 each on a 2-core test node).
#   A GPU job with fewer than 8 cores per task gets a warning line in the log.
# - Time-limit margin (SIGNAL_MARGIN): the `--signal=B:USR1@300` line below. Slurm sends
#   SIGUSR1 that many seconds before the time limit; the trainer finishes its step, defers a due
#   validation to the resumed job, saves and exits. 300 s (the default; raise it for slow
#   filesystems) must cover one step plus a full save: an 8B ZeRO-3 checkpoint is about 115 GB
#   (bf16 weights + fp32 master weights + two Adam moments = 14 bytes/parameter), written by all
#   ranks in parallel.
#   Override per job: sbatch --signal=B:USR1@600 ...
#
# What it does:
# - MASTER_ADDR = the address of the allocation's first node as Slurm knows it (NodeAddr in
#   `scontrol show node`; node names need not resolve), else that node's name; MASTER_PORT =
#   20000 + job id mod 20000 (both overridable). A rank that cannot reach MASTER_ADDR:MASTER_PORT
#   stops after REFUSION_RENDEZVOUS_TIMEOUT seconds (default 60) with one line.
# - `srun` starts one task per device through slurm/task.sh, which sets RANK / WORLD_SIZE /
#   LOCAL_RANK / LOCAL_WORLD_SIZE from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID (srun relays
#   a signal to every process of the step).
# - SIGNAL_MARGIN seconds before the time limit Slurm sends SIGUSR1 to this batch shell; it is
#   forwarded to every training process, which agree on it, checkpoint and exit 0; then this
#   script runs `scontrol requeue $SLURM_JOB_ID`, and the requeued job resumes from the latest
#   checkpoint (same command, auto-resume). SIGTERM (scancel, preemption) is forwarded too (the
#   trainer checkpoints) but does not requeue by itself.
# - A fault requeues the job too: when the training tasks exit with 6 (the trainer's hang
#   watchdog found a rank that made no progress; its line names the rank, the report is
#   <run_dir>/hang.json) or 5 (a rank's process was gone), or srun reports a task killed by a
#   signal (status 128+N: a rank SIGKILLed, e.g. by the OOM killer; the survivors exit 5 but
#   srun reports the killed task's status), this script logs one line with the
#   cause and runs `scontrol requeue`; the requeued job resumes from the latest complete
#   checkpoint. At most REFUSION_MAX_REQUEUES (default 3) such requeues per job, counted in
#   $REFUSION_STATE_DIR/requeues-<job id> (time-limit requeues are not counted), so a
#   persistent fault (a bad node) stops the job with one line instead of looping.
# - The requeued job appends to the same log (--open-mode=append).
#
# Environment knobs (all optional):
#   REFUSION_ROOT        repository root (default: the sbatch submit directory)
#   PYTHON               interpreter (default: $REFUSION_ROOT/.venv/bin/python)
#   TASKS_PER_NODE       training tasks per node (default: the allocation's SLURM_NTASKS_PER_NODE)
#   CPUS_PER_TASK        cores per training task passed to srun (default: see "Cores" above)
#   MASTER_ADDR, MASTER_PORT
#   REFUSION_RENDEZVOUS_TIMEOUT  seconds every rank waits to join the rendezvous (default 60)
#   SRUN_EXTRA_ARGS      extra srun options, e.g. "--cpu-bind=cores" or "--gpu-bind=closest"
#   REQUEUE_ON_SIGNAL    1 (default) requeue after a SIGUSR1-triggered checkpoint; 0 to not
#   REFUSION_DRY_RUN=1   print the per-GPU memory plan for this job's task count
#                        (`python -m pipeline.plan_memory`, train.gpu_memory_gib to check a fit)
#                        and exit (0 fits, 1 does not, 2 bad config); no training task starts
#   REFUSION_MAX_REQUEUES requeues after a hang (exit 6) or a lost rank (exit 5 or 128+signal); default 3, 0 = none
#   REFUSION_STATE_DIR   where the fault-requeue count is kept (default: $REFUSION_ROOT/.cache/slurm)
#   TORCH_EXTENSIONS_DIR DeepSpeed's JIT-op cache (default: $REFUSION_ROOT/.cache/torch_extensions)
#   WANDB_MODE etc. pass through (sbatch exports the submitting environment).
#
#SBATCH --job-name=refusion-pretrain
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
##SBATCH --gpus-per-node=8          # GPU block: enable these three (or pass them to sbatch):
##SBATCH --ntasks-per-node=8        #   one task per GPU,
##SBATCH --cpus-per-task=12         #   >= 8 cores per GPU task
#SBATCH --time=00:30:00
# SIGNAL_MARGIN: seconds between SIGUSR1 and the time limit (>= 300; see above)
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -uo pipefail

log() { printf '[pretrain.sh %s] %s\n' "$(date +%T)" "$*"; }
die() { printf 'slurm/pretrain.sh: error: %s\n' "$*" >&2; exit 2; }

[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job; submit with: sbatch slurm/pretrain.sh CONFIG.yaml [key=value ...]"
[ $# -ge 1 ] || die "missing the run config; usage: sbatch slurm/pretrain.sh CONFIG.yaml [key=value ...]"
CONFIG=$1; shift

ROOT=${REFUSION_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$ROOT" || die "REFUSION_ROOT=$ROOT: no such directory"
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || die "PYTHON=$PYTHON is not executable (create the venv: make venv, or set PYTHON)"
[ -f "$CONFIG" ] || die "config file not found: $CONFIG (relative to $ROOT)"

NNODES=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
# SLURM_NTASKS_PER_NODE is unset when only --ntasks was given; fall back to tasks / nodes.
ALLOC_TPN=${SLURM_NTASKS_PER_NODE:-$(( ${SLURM_NTASKS:-1} / NNODES ))}
TASKS_PER_NODE=${TASKS_PER_NODE:-${ALLOC_TPN%%(*}}
NTASKS=$(( NNODES * TASKS_PER_NODE ))
# MASTER_ADDR: the first node's address as Slurm knows it (NodeAddr of `scontrol show node`),
# since node names need not be resolvable host names; the node name when NodeAddr is not given.
if [ -z "${MASTER_ADDR:-}" ]; then
  FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  MASTER_ADDR=$(scontrol -o show node "$FIRST_NODE" 2>/dev/null | sed -nE 's/^(.* )?NodeAddr=([^ ]+).*/\2/p' | head -n 1)
  MASTER_ADDR=${MASTER_ADDR:-$FIRST_NODE}
fi
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$(( 20000 + SLURM_JOB_ID % 20000 ))}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}
export PYTHONUNBUFFERED=1
if [ "${REFUSION_DRY_RUN:-0}" = 1 ]; then  # the memory plan for this job's layout, nothing started
  exec "$PYTHON" -m pipeline.plan_memory --config "$CONFIG" --world-size "$NTASKS" "$@"
fi
# Cores per task, passed to srun explicitly (srun >= 22.05 does not inherit sbatch's
# --cpus-per-task): CPUS_PER_TASK, else the job's --cpus-per-task, else an even split of this
# node's allocated cores (SLURM_CPUS_ON_NODE) over its tasks.
ALLOC_CPUS=${SLURM_CPUS_ON_NODE:-$TASKS_PER_NODE}
ALLOC_CPUS=${ALLOC_CPUS%%(*}
CPUS_PER_TASK=${CPUS_PER_TASK:-${SLURM_CPUS_PER_TASK:-$(( ALLOC_CPUS / TASKS_PER_NODE ))}}
[ "$CPUS_PER_TASK" -ge 1 ] 2>/dev/null || CPUS_PER_TASK=1
export SRUN_CPUS_PER_TASK=$CPUS_PER_TASK
if [ -z "${SLURM_GPUS_ON_NODE:-}${SLURM_JOB_GPUS:-}${SLURM_STEP_GPUS:-}" ] && ! command -v nvidia-smi >/dev/null 2>&1; then
  # No GPU in the allocation (and none visible): DeepSpeed's CPU accelerator.
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$CPUS_PER_TASK}
elif [ "$CPUS_PER_TASK" -lt 8 ]; then
  log "warning: $CPUS_PER_TASK core(s) per GPU task; the trainer, ZeRO-3 hooks and loader workers want >= 8 (sbatch --cpus-per-task=12)"
fi

log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $NNODES node(s) x $TASKS_PER_NODE task(s) x $CPUS_PER_TASK core(s); master $MASTER_ADDR:$MASTER_PORT"
log "config $CONFIG overrides: $*"

SIGNALLED=""
SRUN_PID=""
forward() {  # forward a signal to the training tasks (srun relays it to every task)
  local sig=$1
  [ "$sig" = USR1 ] && SIGNALLED=USR1
  [ "$sig" = TERM ] && [ -z "$SIGNALLED" ] && SIGNALLED=TERM
  log "received SIG$sig: forwarding to the training tasks"
  [ -n "$SRUN_PID" ] && kill -s "$sig" "$SRUN_PID" 2>/dev/null
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# One task per device; slurm/task.sh sets RANK/WORLD_SIZE/LOCAL_RANK from the SLURM_* ones.
export TASKS_PER_NODE
# shellcheck disable=SC2086
srun --nodes="$NNODES" --ntasks="$NTASKS" --ntasks-per-node="$TASKS_PER_NODE" \
     --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1 ${SRUN_EXTRA_ARGS:-} \
     "$ROOT/slurm/task.sh" "$PYTHON" -m pipeline.train --config "$CONFIG" "$@" &
SRUN_PID=$!

# `wait` returns early (status > 128) whenever a trapped signal arrives; wait until srun is gone.
while kill -0 "$SRUN_PID" 2>/dev/null; do wait "$SRUN_PID"; done
wait "$SRUN_PID"; rc=$?   # bash keeps a reaped child's status for a later `wait PID`
log "training tasks exited with status $rc"

if [ "$SIGNALLED" = USR1 ] && [ "$rc" = 0 ] && [ "${REQUEUE_ON_SIGNAL:-1}" = 1 ]; then
  log "checkpointed on SIGUSR1: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
fi

# A hang (6) or a lost rank (5, or a task killed by signal N: srun's status is then 128+N, not
# the survivors' 5): requeue, at most REFUSION_MAX_REQUEUES times for this job.
case "$rc" in
  6) cause="a rank hung (exit 6: the trainer's hang line above names it; report in <run_dir>/hang.json)" ;;
  5) cause="a rank's process was gone (exit 5: its own output above says why)" ;;
  129|13[0-9]|1[4-9][0-9]|2[0-5][0-9])
     cause="a rank's process was killed by signal $(( rc - 128 )) (status $rc: srun's lines above name the task)" ;;
  *) cause="" ;;
esac
if [ -n "$cause" ] && [ -z "$SIGNALLED" ]; then
  MAX_REQUEUES=${REFUSION_MAX_REQUEUES:-3}
  STATE_DIR=${REFUSION_STATE_DIR:-$ROOT/.cache/slurm}
  COUNT_FILE=$STATE_DIR/requeues-$SLURM_JOB_ID
  done_requeues=$(cat "$COUNT_FILE" 2>/dev/null || echo 0)
  if [ "$done_requeues" -lt "$MAX_REQUEUES" ] 2>/dev/null; then
    mkdir -p "$STATE_DIR" && echo $(( done_requeues + 1 )) > "$COUNT_FILE"
    log "requeue $(( done_requeues + 1 ))/$MAX_REQUEUES of job $SLURM_JOB_ID: $cause; it resumes from the latest checkpoint"
    scontrol requeue "$SLURM_JOB_ID"
  else
    log "not requeueing job $SLURM_JOB_ID: $cause, after $done_requeues fault requeue(s) (REFUSION_MAX_REQUEUES=$MAX_REQUEUES); look at the cause, then resubmit"
  fi
fi
exit "$rc"
