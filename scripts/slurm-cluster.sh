#!/usr/bin/env bash
# A throw-away single-host Slurm cluster (munged, slurmctld, one slurmd per node) living entirely
# in one directory, for the slurm-labelled tests. No systemd, nothing under /etc or /run (with
# --netns: the nodes' namespaces under /run/netns and their links, which stop removes).
#
#   slurm-cluster.sh start DIR [--gang] [--nodes N [--netns]] [--gpus G] [--lifetime SECONDS]
#   slurm-cluster.sh stop DIR
#   slurm-cluster.sh env DIR      # prints shell lines to eval: eval "$(slurm-cluster.sh env DIR)"
#   slurm-cluster.sh status DIR   # the cluster's processes and sinfo
#   slurm-cluster.sh pids DIR     # PIDs of every process of the cluster, one a line
#
# DIR should be short (mktemp -d /tmp/lsc.XXXX): the munge socket path must fit in 107 bytes.
# --gang configures time-sliced gang scheduling; --lifetime starts a watchdog that stops the
# cluster after that many seconds even if the caller dies without calling stop. --nodes N (2 to
# 8) makes N Slurm nodes node1..nodeN on this one host, each its own slurmd (Slurm's
# multiple-slurmd mode: slurmd -N NAME, a Port= per node); the default is the one node
# "localhost". --netns (with --nodes) puts each node's slurmd in a network namespace of its own
# with host name nodeI (scripts/netns-nodes.sh, kept in DIR/net): jobs then see distinct hosts,
# shared memory inside a node and TCP over a link between nodes that can be shaped or cut
# (netns-nodes.sh shape|link DIR/net ...). --gpus G (1 to 8) declares G GPUs on every node
# (GresTypes=gpu, Gres=gpu:G, a gres.conf naming G stand-in device files under DIR/dev): Slurm
# then schedules --gres=gpu:N and --gpus-per-task and sets CUDA_VISIBLE_DEVICES as on a GPU
# cluster; no GPU is needed or used.
# See docs/SLURM-CLUSTER.md for the configuration and why each value was chosen.
set -euo pipefail

readonly prog=${0##*/}
self=$(readlink -f "$0")
readonly self
readonly node_cpus=4 # declared, not real: SlurmdParameters=config_overrides
readonly node_memory_mb=4096
readonly start_timeout=${LSC_START_TIMEOUT:-30}
netns_sh=$(dirname "$self")/netns-nodes.sh
readonly netns_sh
# With --netns: how long slurmctld waits for a silent slurmd before it sets its node DOWN and
# fails the node's jobs (Slurm's default is 300 s).
readonly netns_slurmd_timeout=${LSC_SLURMD_TIMEOUT:-10}

die() {
  echo "$prog: error: $*" >&2
  exit 1
}
say() { echo "$prog: $*" >&2; }

usage() {
  sed -n '5,9p' "$self" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# The canonical absolute path of cluster directory $1 (the marker its daemons carry).
resolve_dir() {
  [ -n "${1:-}" ] || usage
  [ -d "$1" ] || die "cluster directory '$1' does not exist (start creates it; stop/env need one that start used)"
  (cd "$1" && pwd -P)
}

conf_of() { echo "$1/etc/slurm.conf"; }

# Some thread of process $1 still runs. A zombie does not count (PID 1 on these machines reaps
# orphans only every second or two, and a zombie holds nothing), but a zombie thread-group
# leader whose other threads are still exiting does: they hold its files and sockets.
pid_alive() {
  local stat t
  [ -n "${1:-}" ] || return 1
  for t in /proc/"$1"/task/*/stat; do
    stat=$(cat "$t" 2>/dev/null) || continue
    stat=${stat##*) }
    case "${stat%% *}" in Z | X) ;; *) return 0 ;; esac
  done
  return 1
}

# Process $1 and its ancestors: `stop` must never kill its caller.
ancestors_of() {
  local pid=$1
  while [ -n "$pid" ] && [ "$pid" != 0 ]; do
    echo "$pid"
    pid=$(awk '{print $4}' "/proc/$pid/stat" 2>/dev/null || true)
  done
}

# Every live process of the cluster in $1, found from /proc rather than PID files alone:
#  - the daemons carry LSC_CLUSTER_DIR=$1 in their environment;
#  - slurmstepd overwrites its environment (process title) but keeps its node's slurmd log
#    ($1/log/slurmd.log, or slurmd.NODE.log with --nodes) open;
#  - job processes have this cluster's SLURM_CONF and a SLURM_JOB_ID (proctrack/linuxproc does
#    not kill what a batch script leaves behind).
# The caller and its ancestors are left out.
cluster_pids() {
  local dir=$1 conf p
  conf=$(conf_of "$dir")
  local -A skip=()
  for p in $(ancestors_of $$) $BASHPID; do skip[$p]=1; done
  {
    grep -lzxF "LSC_CLUSTER_DIR=$dir" /proc/[0-9]*/environ 2>/dev/null || true
    for p in $(pgrep -x slurmstepd || true); do
      if [ -n "$(find "/proc/$p/fd" -lname "$dir/*" -print -quit 2>/dev/null)" ]; then
        echo "/proc/$p/environ"
      fi
    done
    comm -12 \
      <(grep -lzxF "SLURM_CONF=$conf" /proc/[0-9]*/environ 2>/dev/null | sort || true) \
      <(grep -lz '^SLURM_JOB_ID=' /proc/[0-9]*/environ 2>/dev/null | sort || true)
  } | sed -n 's#^/proc/\([0-9]*\)/environ$#\1#p' | sort -un | while read -r p; do
    if [ -z "${skip[$p]:-}" ] && pid_alive "$p"; then echo "$p"; fi
  done
}

# The PID recorded for daemon $2 if that process is alive and carries this cluster's marker (a
# stale PID file must never make us signal an unrelated process).
daemon_pid() {
  local dir=$1 name=$2 pid
  [ -f "$dir/run/$name.pid" ] || return 0
  pid=$(cat "$dir/run/$name.pid")
  if pid_alive "$pid" && grep -qzxF "LSC_CLUSTER_DIR=$dir" "/proc/$pid/environ" 2>/dev/null; then
    echo "$pid"
  fi
}

daemon_pids() {
  local dir=$1 name
  shift
  for name in "$@"; do daemon_pid "$dir" "$name"; done
}

# Send $2 to PIDs $3..., wait up to $1 s for them to go, then SIGKILL and wait again.
terminate() {
  local wait_s=$1 sig=$2 p i alive
  shift 2
  [ $# -gt 0 ] || return 0
  kill "-$sig" "$@" 2>/dev/null || true
  for i in $(seq $((wait_s * 10))) kill $(seq 50); do
    if [ "$i" = kill ]; then
      kill -KILL "$@" 2>/dev/null || true
      continue
    fi
    alive=0
    for p in "$@"; do pid_alive "$p" && alive=1; done
    [ $alive = 0 ] && return 0
    sleep 0.1
  done
  return 1
}

# A TCP port with no socket on it, other than those given.
free_port() {
  local port _
  for _ in $(seq 200); do
    port=$((20000 + RANDOM % 40000))
    case " $* " in *" $port "*) continue ;; esac
    if [ -z "$(ss -Htan "( sport = :$port )" 2>/dev/null)" ]; then
      echo "$port"
      return 0
    fi
  done
  die "found no free TCP port in 20000-59999 after 200 tries"
}

# The node names of the cluster in $1, one a line, from its slurm.conf: "localhost" for the
# default single-node cluster, node1..nodeN with --nodes N.
node_names() {
  sed -n 's/^NodeName=\([^ ]*\) .*/\1/p' "$(conf_of "$1")" 2>/dev/null || true
}

# The name under which launch records the slurmd of node $1 (run/NAME.pid, log/NAME.out).
slurmd_daemon() {
  if [ "$1" = localhost ]; then echo slurmd; else echo "slurmd-$1"; fi
}

# The slurmd daemon names (slurmd_daemon) of every node of the cluster in $1.
slurmd_daemons() {
  local node
  for node in $(node_names "$1"); do slurmd_daemon "$node"; done
}

# slurm.conf for one node "localhost" on SLURMD_PORT, or, given several ports (--nodes N), for
# nodes node1..nodeN, each its own slurmd on its own port (multiple-slurmd mode). SUBNET (--netns:
# the 10.213.X of DIR/net, else empty) puts node I at SUBNET.I and slurmctld at SUBNET.254.
write_slurm_conf() {
  local dir=$1 gang=$2 gpus=$3 subnet=$4 ctld_port=$5 slurmd_port=$6
  local nodes=$(($# - 5)) node_lines="" nodelist=localhost i port gres="" gres_types=""
  local ctld_addr=127.0.0.1 net_lines="# SlurmdTimeout: Slurm's default (300 s)"
  local slurmd_files="SlurmdSpoolDir=$dir/spool
SlurmdPidFile=$dir/run/slurmd.daemon.pid
SlurmdLogFile=$dir/log/slurmd.log"
  if [ "$gpus" -gt 0 ]; then
    gres=" Gres=gpu:$gpus"
    gres_types="GresTypes=gpu"
    write_gres_conf "$dir" "$gpus"
  else
    rm -f "$dir/etc/gres.conf"
  fi
  local cpus="CPUs=$node_cpus Sockets=1 CoresPerSocket=$node_cpus ThreadsPerCore=1 RealMemory=$node_memory_mb$gres State=UNKNOWN"
  if [ $nodes = 1 ]; then
    node_lines="NodeName=localhost NodeAddr=127.0.0.1 $cpus"
  else
    # %n is the node name: every slurmd (and its slurmstepds) needs its own spool, PID file
    # and log. TmpFS is where the PMIx plugin makes each step's client directory
    # (spmix_appdir_UID_JOB.STEP): under the default /tmp the steps of one job on two nodes of
    # this host would both make the same one, and the second fails (docs/SLURM-CLUSTER.md).
    slurmd_files="SlurmdSpoolDir=$dir/spool/%n
SlurmdPidFile=$dir/run/slurmd.%n.daemon.pid
SlurmdLogFile=$dir/log/slurmd.%n.log
TmpFS=$dir/tmp/%n"
    i=0
    for port in "${@:6}"; do
      i=$((i + 1))
      if [ -n "$subnet" ]; then
        # The node's own namespace, address and host name (NodeHostname defaults to NodeName).
        node_lines+="NodeName=node$i NodeAddr=$subnet.$i Port=$port $cpus"$'\n'
      else
        node_lines+="NodeName=node$i NodeHostname=localhost NodeAddr=127.0.0.1 Port=$port $cpus"$'\n'
      fi
    done
    node_lines=${node_lines%$'\n'}
    nodelist="node[1-$nodes]"
  fi
  if [ -n "$subnet" ]; then
    # The nodes reach slurmctld over the bridge. A node cut off (netns-nodes.sh link) is set
    # DOWN after SlurmdTimeout and its jobs fail (NODE_FAIL), a --requeue job is requeued.
    ctld_addr=$subnet.254
    net_lines="SlurmdTimeout=$netns_slurmd_timeout"
  fi
  local preempt_mode=REQUEUE low_mode=REQUEUE debug_extra="PreemptMode=OFF"
  local timeslice="# SchedulerTimeSlice: only with --gang"
  if [ "$gang" = 1 ]; then
    preempt_mode=SUSPEND,GANG
    low_mode=SUSPEND
    debug_extra="OverSubscribe=FORCE:2"
    timeslice="SchedulerTimeSlice=5"
  fi
  # No backquotes in this here-document: they would run.
  cat >"$(conf_of "$dir")" <<EOF
# Generated by scripts/slurm-cluster.sh: a throw-away single-host cluster in $dir.
ClusterName=lsc
SlurmctldHost=localhost($ctld_addr)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A munged private to this cluster. cred_expire also sets how long a requeued job waits before
# it may start again (default 120 s).
AuthInfo=socket=$dir/munge/munge.sock,cred_expire=10
StateSaveLocation=$dir/state
SlurmctldPidFile=$dir/run/slurmctld.daemon.pid
SlurmctldLogFile=$dir/log/slurmctld.log
$slurmd_files
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$dir/etc/plugstack.conf
# Nothing here needs cgroups.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
# Debian's Open MPI starts under srun with PMIx, not with PMI-2.
MpiDefault=pmix
MailProg=/bin/true
ReturnToService=2
$gres_types
# The node declares more CPUs than the machine has.
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
$timeslice
PreemptType=preempt/partition_prio
PreemptMode=$preempt_mode
SlurmctldParameters=preempt_send_user_signal
DependencyParameters=kill_invalid_depend
JobRequeue=1
# Finished jobs stay visible to scontrol for 5 minutes (no slurmdbd here, so no sacct).
MinJobAge=300
KillWait=5
InactiveLimit=0
$net_lines
$node_lines
PartitionName=debug Nodes=$nodelist Default=YES MaxTime=INFINITE State=UP $debug_extra
PartitionName=low Nodes=$nodelist MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=$low_mode GraceTime=5
PartitionName=high Nodes=$nodelist MaxTime=INFINITE State=UP PriorityTier=10
EOF
  : >"$dir/etc/plugstack.conf"
}

# gres.conf for G stand-in GPUs on every node: character devices under DIR/dev made like
# /dev/null (Slurm reads a GPU's index and device numbers from its file; nothing opens them).
# AutoDetect=off: there is no NVML to ask.
write_gres_conf() {
  local dir=$1 gpus=$2 i
  mkdir -p "$dir/dev"
  for i in $(seq 0 $((gpus - 1))); do
    [ -e "$dir/dev/gpu$i" ] || mknod -m 666 "$dir/dev/gpu$i" c 1 3 ||
      die "cannot make the stand-in device $dir/dev/gpu$i (mknod needs root)"
  done
  cat >"$dir/etc/gres.conf" <<EOF
# Generated by scripts/slurm-cluster.sh: $gpus stand-in GPUs per node (no real device).
AutoDetect=off
Name=gpu File=$dir/dev/gpu[0-$((gpus - 1))]
EOF
}

# Run daemon $2 in the foreground of its own session, cwd $1/run, detached from the caller; the
# PID file records the daemon itself (the subshell execs setsid, which execs the daemon).
launch() {
  local dir=$1 name=$2
  shift 2
  (cd "$dir/run" && LSC_CLUSTER_DIR=$dir SLURM_CONF=$(conf_of "$dir") \
    exec setsid "$@" </dev/null >>"$dir/log/$name.out" 2>&1) &
  echo $! >"$dir/run/$name.pid"
}

log_tails() {
  local dir=$1 f
  for f in "$dir"/log/*; do
    [ -s "$f" ] || continue
    echo "---- last lines of $f ----" >&2
    tail -n 15 "$f" >&2
  done
}

start_munge() {
  local dir=$1 sock="$1/munge/munge.sock" i
  dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
  chmod 600 "$dir/munge/munge.key"
  # --force: munged refuses to run as root without it.
  launch "$dir" munged munged --foreground --force --socket="$sock" \
    --key-file="$dir/munge/munge.key" --pid-file="$dir/run/munged.daemon.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed"
  for i in $(seq 100); do
    if munge -n -S "$sock" 2>/dev/null | unmunge -S "$sock" >/dev/null 2>&1; then
      return 0
    fi
    pid_alive "$(cat "$dir/run/munged.pid")" || break
    sleep 0.1
  done
  die "munged did not come up on $sock"
}

# Start slurmctld and a slurmd per node and wait for every node to be idle; returns 1 if they
# are not in time.
start_slurm() {
  local dir=$1 conf deadline state="" node daemon nodes
  conf=$(conf_of "$dir")
  nodes=$(node_names "$dir" | paste -sd, -)
  launch "$dir" slurmctld slurmctld -D -i -f "$conf"
  for node in $(node_names "$dir"); do
    # A slurmd makes its spool directory only after it has tried to open its socket there.
    [ "$node" = localhost ] || mkdir -p "$dir/spool/$node" "$dir/tmp/$node"
    if [ -n "$net_id" ]; then
      # In node K's network namespace, with a UTS namespace named nodeK (as netns-nodes.sh's
      # agent). nsenter, not ip netns exec: that also remounts /sys, where slurmd then finds no
      # cgroup file system and refuses to start.
      launch "$dir" "$(slurmd_daemon "$node")" nsenter --net="/run/netns/locus-$net_id-n${node#node}" unshare --uts \
        /bin/sh -c "hostname $node && exec slurmd -D -N $node -f $conf"
    else
      launch "$dir" "$(slurmd_daemon "$node")" slurmd -D -N "$node" -f "$conf"
    fi
  done
  deadline=$((SECONDS + start_timeout))
  while [ $SECONDS -lt $deadline ]; do
    state=$(SLURM_CONF=$conf sinfo -h -N -n "$nodes" -o %T 2>/dev/null | sort -u || true)
    [ "$state" = idle ] && return 0
    if ! pid_alive "$(cat "$dir/run/slurmctld.pid")"; then say "slurmctld exited"; return 1; fi
    for daemon in $(slurmd_daemons "$dir"); do
      if ! pid_alive "$(cat "$dir/run/$daemon.pid")"; then say "$daemon exited"; return 1; fi
    done
    sleep 0.1
  done
  say "nodes $nodes not all idle after ${start_timeout}s (sinfo states: '${state//$'\n'/ }'; LSC_START_TIMEOUT sets the limit)"
  return 1
}

start_watchdog() {
  local dir=$1 lifetime=$2
  # shellcheck disable=SC2016 # expanded by the watchdog's bash
  LSC_WATCHDOG=1 setsid bash -c 'sleep "$1"; echo "watchdog: lifetime of $1 s over, stopping" >&2; exec bash "$2" stop "$3"' \
    watchdog "$lifetime" "$self" "$dir" </dev/null >>"$dir/log/watchdog.out" 2>&1 &
  echo $! >"$dir/run/watchdog.pgid"
}

on_start_exit() {
  local rc=$? dir=$1
  [ $rc = 0 ] && return 0
  log_tails "$dir"
  say "start failed; stopping whatever did start (logs stay in $dir/log)"
  cmd_stop "$dir" || true
  exit $rc
}

cmd_start() {
  [ -n "${1:-}" ] || usage
  mkdir -p "$1"
  local dir gang=0 lifetime=0 nodes=1 gpus=0 netns=0 attempt ctld_port slurmd_ports bin slurm_daemons i
  dir=$(resolve_dir "$1")
  shift
  while [ $# -gt 0 ]; do
    case "$1" in
      --gang) gang=1 ;;
      --netns) netns=1 ;;
      --nodes)
        nodes=${2:-}
        [[ "$nodes" =~ ^[1-8]$ ]] || die "--nodes needs a node count from 1 to 8, got '$nodes'"
        shift
        ;;
      --gpus)
        gpus=${2:-}
        [[ "$gpus" =~ ^[1-8]$ ]] || die "--gpus needs a GPU count from 1 to 8, got '$gpus'"
        shift
        ;;
      --lifetime)
        lifetime=${2:-}
        [[ "$lifetime" =~ ^[0-9]+$ ]] || die "--lifetime needs a whole number of seconds, got '$lifetime'"
        shift
        ;;
      *) die "unknown start option '$1' (known: --gang, --nodes N, --netns, --gpus G, --lifetime SECONDS)" ;;
    esac
    shift
  done
  [ $netns = 0 ] || [ "$nodes" -ge 2 ] || die "--netns needs --nodes N with N from 2 to 8 (a namespace a node)"
  if [ $netns = 1 ]; then
    bash "$netns_sh" check || die "--netns: cannot make network namespaces here (see the line above)"
  fi
  for bin in munged munge unmunge slurmctld slurmd sinfo setsid ss pgrep; do
    command -v "$bin" >/dev/null ||
      die "'$bin' not found: install the Debian packages slurm-wlm and munge (scripts/install-deps.sh)"
  done
  local sock="$dir/munge/munge.sock"
  [ ${#sock} -lt 108 ] ||
    die "munge socket path '$sock' is ${#sock} bytes, over the 107 a Unix socket allows: use a shorter DIR (mktemp -d /tmp/lsc.XXXX)"
  [ -z "$(cluster_pids "$dir")" ] || die "a cluster is already running in $dir: run '$prog stop $dir' first"

  # A fresh cluster every time: DIR must be empty, or hold an earlier cluster of this script,
  # whose state, spool, logs and PID files are then cleared (never anything we did not write).
  if [ -n "$(ls -A "$dir")" ]; then
    head -n 1 "$(conf_of "$dir")" 2>/dev/null | grep -q '^# Generated by scripts/slurm-cluster.sh' ||
      die "$dir is neither empty nor an earlier cluster of $prog: give an empty directory (mktemp -d /tmp/lsc.XXXX)"
    stop_net "$dir"
    rm -rf "$dir"/state "$dir"/spool "$dir"/tmp "$dir"/log "$dir"/run "$dir"/net
  fi
  trap 'on_start_exit "$dir"' EXIT
  mkdir -p "$dir"/{etc,munge,state,spool,log,run}
  # munged refuses a socket directory that is not executable by all.
  chmod 755 "$dir" "$dir"/{etc,munge,state,spool,log,run}
  if [ "$lifetime" -gt 0 ]; then start_watchdog "$dir" "$lifetime"; fi
  start_munge "$dir"
  net_id="" net_subnet=""
  if [ $netns = 1 ]; then
    mkdir -p "$dir/net"
    # No --lifetime of its own: this cluster's watchdog stops it (cmd_stop).
    bash "$netns_sh" start "$dir/net" --nodes "$nodes" --slots "$node_cpus" ||
      die "could not make the nodes' network namespaces (--netns needs root, ip netns, veth and a bridge)"
    net_id=$(sed -n 's/^id=//p' "$dir/net/nodes.env")
    net_subnet=$(sed -n 's/^subnet=//p' "$dir/net/nodes.env")
  fi
  # Ports are random; a clash with a cluster started at the same moment shows as a bind error in
  # the logs, so try again with new ports.
  for attempt in 1 2 3; do
    ctld_port=$(free_port)
    slurmd_ports=()
    for i in $(seq "$nodes"); do slurmd_ports+=("$(free_port "$ctld_port" "${slurmd_ports[@]}")"); done
    write_slurm_conf "$dir" "$gang" "$gpus" "$net_subnet" "$ctld_port" "${slurmd_ports[@]}"
    if start_slurm "$dir"; then
      trap - EXIT
      local mode=""
      if [ $gang = 1 ]; then mode=", gang scheduling"; fi
      if [ "$nodes" -gt 1 ]; then mode+=", nodes $(node_names "$dir" | paste -sd' ' -)"; fi
      if [ "$gpus" -gt 0 ]; then mode+=", $gpus stand-in GPUs a node"; fi
      if [ -n "$net_subnet" ]; then mode+=", each in a network namespace at $net_subnet.I (netns-nodes.sh DIR/net)"; fi
      say "cluster up in $dir (slurmctld :$ctld_port, slurmd :${slurmd_ports[*]}$mode)"
      return 0
    fi
    grep -qs 'Address already in use' "$dir"/log/slurm* || break
    say "port clash on attempt $attempt, trying new ports"
    # shellcheck disable=SC2046 # a list of names
    mapfile -t slurm_daemons < <(daemon_pids "$dir" slurmctld $(slurmd_daemons "$dir"))
    terminate 10 TERM "${slurm_daemons[@]}" || true
    rm -f "$dir"/log/slurm*
  done
  die "the cluster in $dir did not start (log tails above; all logs in $dir/log)"
}

# The nodes' network namespaces of a --netns cluster in $1, if any (netns-nodes.sh stop).
stop_net() {
  [ -f "$1/net/nodes.env" ] || return 0
  bash "$netns_sh" stop "$1/net" || say "could not remove every namespace of $1/net (ip netns list)"
}

cmd_stop() {
  local dir p pids=() munged_pid leftover=()
  dir=$(resolve_dir "${1:-}")
  # The watchdog first, so it cannot fire in the middle of this stop (unless it is the caller).
  local wd
  wd=$(cat "$dir/run/watchdog.pgid" 2>/dev/null || true)
  # (Only if that PID still is this cluster's watchdog: the file may be stale.)
  if [ -n "$wd" ] && [ -z "${LSC_WATCHDOG:-}" ] && grep -qzxF "$dir" "/proc/$wd/cmdline" 2>/dev/null; then
    kill -TERM -- "-$wd" 2>/dev/null || true
  fi
  # slurmctld and slurmd shut down cleanly on SIGTERM within a second. What is left of the jobs
  # (slurmstepd, batch scripts, whatever they left behind) is then killed outright, and munged
  # goes last because the others talk to it until they exit.
  # shellcheck disable=SC2046 # a list of names
  mapfile -t pids < <(daemon_pids "$dir" slurmctld $(slurmd_daemons "$dir"))
  terminate 10 TERM "${pids[@]}" || true
  pids=()
  munged_pid=$(daemon_pid "$dir" munged)
  for p in $(cluster_pids "$dir"); do
    [ "$p" = "$munged_pid" ] || pids+=("$p")
  done
  terminate 5 KILL "${pids[@]}" || true
  # --netns: whatever still runs in the nodes' namespaces, then the namespaces and links.
  stop_net "$dir"
  if [ -n "$munged_pid" ]; then terminate 10 TERM "$munged_pid" || true; fi
  mapfile -t leftover < <(cluster_pids "$dir")
  if [ ${#leftover[@]} -gt 0 ]; then
    terminate 5 KILL "${leftover[@]}" || true
    mapfile -t leftover < <(cluster_pids "$dir")
  fi
  [ ${#leftover[@]} = 0 ] || die "processes of the cluster in $dir survive SIGKILL: ${leftover[*]}"
  rm -f "$dir"/run/*.pid "$dir"/run/watchdog.pgid
  say "cluster in $dir stopped"
}

# SLURM_CONF for this cluster, and unset any SLURM_*/SBATCH_*/SALLOC_*/SRUN_* inherited from an
# outer allocation (srun and sbatch read them as options, e.g. SLURM_JOB_ID joins a job).
# With --netns (distinct hosts): Open MPI's default transports (any BTL choice inherited is
# unset), UCX for windows over TCP and yielding ranks. With several nodes otherwise, Open MPI's transports for jobs spanning them (sbatch passes the
# environment on), docs/SLURM-CLUSTER.md: TCP over loopback and no shared-memory BTL, because
# Open MPI names its shared-memory (vader) segments by host name, job and local rank, so ranks
# with one local rank on two nodes of this one host would share a segment and crash; and
# one-sided communication (the apps' work queue) through UCX, because no other osc component
# of Open MPI 4.1 can make a window over TCP alone (MPI_Win_allocate fails, MPI_ERR_WIN).
cmd_env() {
  local dir v
  dir=$(resolve_dir "${1:-}")
  [ -f "$(conf_of "$dir")" ] || die "no slurm.conf in $dir: run '$prog start $dir' first"
  for v in $(compgen -e); do
    case "$v" in SLURM_* | SBATCH_* | SALLOC_* | SRUN_*) echo "unset $v" ;; esac
  done
  echo "export SLURM_CONF=$(conf_of "$dir")"
  if [ -f "$dir/net/nodes.env" ]; then
    # Distinct hosts: Open MPI's defaults (shared memory inside a node, TCP on eth0 between
    # them) work. Windows over TCP still need UCX, and ranks must yield: every node's daemon
    # takes the host's cores for its own.
    echo "unset OMPI_MCA_btl OMPI_MCA_btl_tcp_if_include"
    echo "export OMPI_MCA_osc=ucx OMPI_MCA_mpi_yield_when_idle=1"
  elif [ "$(node_names "$dir" | wc -l)" -gt 1 ]; then
    echo "export OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_osc=ucx"
  fi
}

cmd_status() {
  local dir p
  dir=$(resolve_dir "${1:-}")
  for p in $(cluster_pids "$dir"); do
    echo "$p $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)"
  done
  if [ -n "$(daemon_pid "$dir" slurmctld)" ]; then
    SLURM_CONF=$(conf_of "$dir") sinfo
  else
    echo "slurmctld is not running"
  fi
}

cmd_pids() {
  cluster_pids "$(resolve_dir "${1:-}")"
}

main() {
  local cmd=${1:-}
  [ $# -gt 0 ] && shift
  case "$cmd" in
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    env) cmd_env "$@" ;;
    status) cmd_status "$@" ;;
    pids) cmd_pids "$@" ;;
    *) usage ;;
  esac
}

main "$@"
