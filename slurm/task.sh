#!/usr/bin/env bash
# slurm/task.sh CMD [ARGS...]: one training task under srun (used by slurm/pretrain.sh).
#
# Sets the torch.distributed variables from Slurm's, overriding any inherited from the
# submitting shell (sbatch exports its environment): RANK = SLURM_PROCID, WORLD_SIZE =
# SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID, LOCAL_WORLD_SIZE = TASKS_PER_NODE (else
# SLURM_NTASKS_PER_NODE), then execs CMD.
#
# Device: LOCAL_RANK here is the node-local task index. A task that sees fewer GPUs than that
# (--gpus-per-task=1, --gpu-bind) is mapped to cuda:(LOCAL_RANK mod visible GPUs) by the trainer
# (pipeline/parallel.py bind_local_device), which then rewrites LOCAL_RANK to that index before
# DeepSpeed reads it; the node-local index stays in SLURM_LOCALID.
#
# Signals: a signal relayed by srun reaches every process of the step (Slurm's process
# tracking signals the whole container), data-loader workers included; workers forked after
# the trainer installed its SIGUSR1/SIGTERM handlers inherit them, so they survive.
set -eu
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
tpn=${TASKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}
export LOCAL_WORLD_SIZE=${tpn%%(*}
exec "$@"
