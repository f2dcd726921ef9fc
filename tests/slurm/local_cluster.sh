#!/usr/bin/env bash
# tests/slurm/local_cluster.sh {start|stop|status}: a one-node SLURM cluster on this machine,
# for tests/test_slurm.py (which starts it itself) and for trying slurm/pretrain.sh by hand.
#
#   sudo bash tests/slurm/local_cluster.sh start    # prints `export SLURM_CONF=...` on stdout
#   eval "$(sudo bash tests/slurm/local_cluster.sh start)"; sbatch slurm/pretrain.sh ...
#   sudo bash tests/slurm/local_cluster.sh stop     # cancels its jobs, stops its daemons
#
# Needs root and Debian's packages (munge, slurmctld, slurmd, slurm-client; installed with
# apt-get when missing, without starting the distribution's services). Tested with Debian 12's
# Slurm 22.05 without systemd.
#
# Everything lives in a private folder (REFUSION_SLURM_DIR, default
# /var/tmp/refusion-slurm-KEY, KEY the first 8 hex digits of this script's sha256):
# slurm.conf, the munge key and socket, spool, state, logs and the pid files of the daemons
# this script started. Nothing under /etc is written, the ports are not Slurm's defaults and
# munged gets its own socket, so a system Slurm or munge on the same machine is left alone.
# Clients find this cluster through SLURM_CONF (printed by `start`).
#
# The node is called `refusion-node` (REFUSION_SLURM_NODE), a name that is deliberately not a
# host name, with NodeAddr=127.0.0.1: as on clusters whose node names are not resolvable, a job
# must take addresses from `scontrol show node` (slurm/pretrain.sh does for MASTER_ADDR).
#
# Choices (each avoids a trap of this Slurm on a container without systemd):
# - proctrack/linuxproc + task/none: no cgroup access needed. (With proctrack/cgroup, Slurm
#   22.05 fails every job step unless a cgroup.conf exists, while `sbatch --wait` still reports
#   success.) Processes a job leaves running after its batch script ends are not killed.
# - AuthInfo cred_expire=10: a requeued job may start again 11 s after it ended (default 121 s;
#   Slurm's minimum is 5). It is also how long a job step's launch credential stays valid: 10 s
#   between its creation and slurmd's check leaves room on a loaded 2-core machine.
# - SchedulerParameters=sched_interval=1: the main scheduling loop tests pending jobs every
#   second (default 60 s). A requeued job becoming eligible is no event that runs the scheduler,
#   so with the default it waited for the next periodic pass, up to a minute after its 11 s.
# - No slurmdbd: plain `sacct` reports that accounting is disabled; finished jobs are written by
#   jobcomp/filetxt and `sacct -c` reads them.
# - The controller starts with a clean state (slurmctld -c): jobs of an earlier run are gone.
#
# `start` is idempotent: when this script's daemons already run with the same config it only
# checks that the node is usable. Exit codes: 0 ready (or stopped); 3 this machine cannot run
# it (not root, no apt-get/dpkg, the packages cannot be installed); 1 it should have worked
# but did not (a daemon or the test job failed; the logs are in $REFUSION_SLURM_DIR/log).
#
# The cluster is keyed by this script's content: two checkouts whose copies differ (another
# slurm.conf, another version under test) get their own folder and ports, so neither restarts
# the other's daemons under its running tests; checkouts with the same script share one.
#
# Knobs: REFUSION_SLURM_DIR, REFUSION_SLURM_NODE, REFUSION_SLURM_PORT (controller port,
# default 6917 + 2 x (KEY mod 1000); slurmd uses the next one), REFUSION_SLURM_WAIT (seconds
# for the node to become idle, default 60).
set -euo pipefail

KEY=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-8)
DIR=${REFUSION_SLURM_DIR:-/var/tmp/refusion-slurm-$KEY}
NODE=${REFUSION_SLURM_NODE:-refusion-node}
PORT=${REFUSION_SLURM_PORT:-$((6917 + 2 * (16#$KEY % 1000)))}
WAIT=${REFUSION_SLURM_WAIT:-60}
CONF=$DIR/etc/slurm.conf
SOCK=$DIR/run/munge.sock
PACKAGES=(munge slurmctld slurmd slurm-client)
export SLURM_CONF=$CONF

say() { printf 'local_cluster.sh: %s\n' "$*" >&2; }
unusable() { say "cannot run here: $*"; exit 3; }
broken() { say "error: $*"; exit 1; }

# alive NAME PID: succeed when PID is a live, non-zombie process whose command name is NAME.
alive() {
  local state
  [[ "$2" =~ ^[0-9]+$ ]] || return 1
  [ "$(cat "/proc/$2/comm" 2>/dev/null)" = "$1" ] || return 1
  state=$(sed -E 's/^[0-9]+ \(.*\) (.).*/\1/' "/proc/$2/stat" 2>/dev/null) || return 1
  [ "$state" != Z ]
}

# running NAME PIDFILE: print the pid when PIDFILE names a live process called NAME (a stale
# or recycled pid is never taken for ours).
running() {
  local pid
  pid=$(cat "$2" 2>/dev/null) || return 1
  alive "$1" "$pid" && echo "$pid"
}

# halt NAME: SIGTERM the daemon recorded in $DIR/run/NAME.pid, SIGKILL after 15 s.
halt() {
  local pid i
  if ! pid=$(running "$1" "$DIR/run/$1.pid"); then
    rm -f "$DIR/run/$1.pid"; return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 150; i++)); do alive "$1" "$pid" || break; sleep 0.1; done
  if alive "$1" "$pid"; then
    say "$1 (pid $pid) still running 15 s after SIGTERM: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$DIR/run/$1.pid"
  say "stopped $1 (pid $pid)"
}

# cancel_jobs: end every job of this cluster (their processes outlive slurmd otherwise).
cancel_jobs() {
  local i
  running slurmctld "$DIR/run/slurmctld.pid" >/dev/null || return 0
  [ -n "$(squeue -h -o %i 2>/dev/null)" ] || return 0
  squeue -h -o %i | xargs -r scancel 2>/dev/null || true
  for ((i = 0; i < 90; i++)); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && return 0; sleep 0.5; done
  say "jobs still listed 45 s after scancel: $(squeue -h -o '%i %T' | tr '\n' ' ')"
}

do_stop() {
  [ "$(id -u)" = 0 ] || unusable "needs root"
  cancel_jobs
  halt slurmd; halt slurmctld; halt munged   # munged last: the others need it to shut down
}

do_status() {
  local d pid
  for d in munged slurmctld slurmd; do
    if pid=$(running "$d" "$DIR/run/$d.pid"); then echo "$d running (pid $pid)"; else echo "$d not running"; fi
  done
  running slurmctld "$DIR/run/slurmctld.pid" >/dev/null && sinfo
  return 0
}

install_packages() {
  local missing=() p added_policy=""
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} = 0 ] && return 0
  say "installing ${missing[*]} with apt-get"
  # Keep the packages' maintainer scripts from starting the distribution's own services: a
  # policy-rc.d that answers 101 ("not allowed") for as long as the install runs.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 0755 /usr/sbin/policy-rc.d
    added_policy=1
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT   # also when this script is interrupted
  fi
  local ok=1
  DEBIAN_FRONTEND=noninteractive apt-get update -qq >"$DIR/log/apt.log" 2>&1 \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
         "${missing[@]}" >>"$DIR/log/apt.log" 2>&1 || ok=0
  if [ -n "$added_policy" ]; then rm -f /usr/sbin/policy-rc.d; trap - EXIT; fi
  [ "$ok" = 1 ] || unusable "apt-get could not install ${missing[*]}: $(tail -n 1 "$DIR/log/apt.log")"
}

write_config() {  # prints 1 when the config file changed
  local host topo mem node_line text
  host=$(hostname -s)
  # e.g. "NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"
  node_line=$(slurmd -C | head -n 1)
  topo=$(tr ' ' '\n' <<<"$node_line" | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ')
  mem=$(tr ' ' '\n' <<<"$node_line" | sed -n 's/^RealMemory=//p')
  # declare a little less memory than slurmd measures, or the node is marked INVALID
  mem=$(( ${mem:-1024} * 9 / 10 ))
  text="# written by tests/slurm/local_cluster.sh; regenerated on each start
ClusterName=refusion-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
MpiDefault=none
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=$NODE NodeHostname=$host NodeAddr=127.0.0.1 ${topo}RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP"
  if [ -f "$CONF" ] && [ "$(cat "$CONF")" = "$text" ]; then echo 0; return; fi
  printf '%s\n' "$text" > "$CONF.tmp" && mv "$CONF.tmp" "$CONF"
  echo 1
}

# launch NAME TIMEOUT_S CMD...: run a daemon that forks into the background and writes
# $DIR/run/NAME.pid, and wait until that pid is alive.
launch() {
  local name=$1 limit=$2 i; shift 2
  rm -f "$DIR/run/$name.pid"
  "$@" 9>&- || broken "$name did not start (exit $?); see $DIR/log/$name.log"
  for ((i = 0; i < limit * 10; i++)); do
    running "$name" "$DIR/run/$name.pid" >/dev/null && { started+=("$name"); return 0; }
    sleep 0.1
  done
  broken "$name did not come up within ${limit} s; see $DIR/log/$name.log"
}

do_start() {
  local t0=$SECONDS changed started=() state="" i out
  [ "$(id -u)" = 0 ] || unusable "needs root (it installs Debian packages and runs slurmd as root)"
  command -v apt-get >/dev/null && command -v dpkg-query >/dev/null || unusable "needs Debian's apt-get and dpkg"
  mkdir -p "$DIR"/{etc,run,log,state,spool,munge}
  chmod 0755 "$DIR" "$DIR"/{etc,run,log,state,spool,munge}
  install_packages

  if [ ! -s "$DIR/etc/munge.key" ]; then
    (umask 077; head -c 1024 /dev/urandom > "$DIR/etc/munge.key")
  fi
  chmod 0400 "$DIR/etc/munge.key"
  changed=$(write_config)
  if [ "$changed" = 1 ]; then halt slurmd; halt slurmctld; fi

  running munged "$DIR/run/munged.pid" >/dev/null \
    || launch munged 10 munged --socket="$SOCK" --key-file="$DIR/etc/munge.key" \
         --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
         --seed-file="$DIR/munge/seed"
  munge -S "$SOCK" -n | unmunge -S "$SOCK" >/dev/null || broken "munge cannot decode its own credential; see $DIR/log/munged.log"
  running slurmctld "$DIR/run/slurmctld.pid" >/dev/null || launch slurmctld 20 slurmctld -c -f "$CONF"
  running slurmd "$DIR/run/slurmd.pid" >/dev/null || launch slurmd 20 slurmd -f "$CONF" -N "$NODE"

  for ((i = 0; i < WAIT * 2; i++)); do
    state=$(sinfo -h -n "$NODE" -o %T 2>/dev/null || true)
    case $state in
      idle|mixed|allocated) break ;;
      down*|drain*) scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
  done
  case $state in
    idle|mixed|allocated) ;;
    *) broken "node $NODE is '$state' after ${WAIT} s ($(sinfo -h -R -o '%E' 2>/dev/null)); see $DIR/log/" ;;
  esac
  # A job step, not just node state: a node can look idle while every launch fails. Read its
  # output, since srun can report a failed launch and still exit 0.
  if [ ${#started[@]} -gt 0 ] || [ "$changed" = 1 ]; then
    out=$(timeout 60 srun --nodes=1 --ntasks=1 --time=1 --job-name=cluster-check echo cluster-check-ok 2>&1 || true)
    grep -qx cluster-check-ok <<<"$out" || broken "a test job step failed: $(tr '\n' ' ' <<<"$out")"
  fi
  say "ready in $((SECONDS - t0)) s (node $NODE: $state${started:+; started ${started[*]}})"
  echo "export SLURM_CONF=$CONF"
  echo "# started: ${started[*]}"
}

# One start or stop at a time (two test sessions may start the cluster at once). The daemons
# are launched with this descriptor closed, so they never hold the lock.
lock() {
  command -v flock >/dev/null || return 0
  mkdir -p "$DIR/run"
  exec 9>"$DIR/run/start-stop.lock"
  flock -w 120 9 || say "another start or stop held the lock for 120 s; going on"
}

case ${1:-} in
  start) [ "$(id -u)" = 0 ] && lock; do_start ;;
  stop) [ "$(id -u)" = 0 ] && lock; do_stop ;;
  status) do_status ;;
  *) echo "usage: $0 {start|stop|status}" >&2; exit 2 ;;
esac
