#!/usr/bin/env bash
# slurm/task.sh CMD [ARGS...]: one training task under srun (used by slurm/pretrain.sh).
#
# Sets the torch.distributed variables from Slurm's, overriding any inherited from the
# submitting shell (sbatch exports its environment): RANK = SLURM_PROCID, WORLD_SIZE =
# SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID, LOCAL_WORLD_SIZE = TASKS_PER_NODE (else
# SLURM_NTASKS_PER_NODE), then execs CMD.
#
# Signals: a signal relayed by srun reaches every process of the step (Slurm's process
# tracking signals the whole container), data-loader workers included; workers forked after
# the trainer installed its SIGUSR1/SIGTERM handlers inherit them, so they survive.
set -eu
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
tpn=${TASKS_PER_NODE:-${SLURM_NTASKS_PER_NODE:-1}}
export LOCAL_WORLD_SIZE=${tpn%%(*}
exec "$@"
