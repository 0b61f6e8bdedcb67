#!/usr/bin/env bash
# Emulated nodes on one host: each node a Linux network namespace with its own host name, joined
# to the others by a bridge over veth links that can be rate-limited, so that Open MPI sees
# several nodes -- shared memory inside a node, TCP over the (shaped) link between nodes -- and
# locus's topology, hierarchical reduction and node-aware placement meet a network that is
# slower than memory, as on a cluster.
#
#   netns-nodes.sh start DIR [--nodes N] [--slots S] [--rate RATE] [--lifetime SECONDS]
#   netns-nodes.sh mpirun DIR MPIRUN-ARGS...   # mpirun across the nodes (S ranks a node at most)
#   netns-nodes.sh shape DIR RATE|off          # change the links' rate of running nodes
#   netns-nodes.sh link DIR K down|up          # cut node K off the network, or back on
#   netns-nodes.sh stop DIR
#   netns-nodes.sh check                       # exit 0 if nodes can be made here, else 1 and why
#
# Needs root and network namespaces (ip netns, veth, bridge; tbf for --rate). --nodes N (2 to
# 8, default 2) nodes node1..nodeN with --slots S (default 2) rank slots each. --rate RATE (tc
# units: 1gbit, 400mbit; default: no limit) limits each node's link in both directions with a
# token bucket (tc tbf); the link's queue holds 10 ms at that rate. --lifetime starts a watchdog
# that stops the nodes after that many seconds even if the caller dies. Everything a set of
# nodes makes is named after an id kept in DIR, so several sets run side by side; stop removes
# it all. See docs/SLURM-CLUSTER.md, "Nodes with a network of their own".
set -euo pipefail

readonly prog=${0##*/}
self=$(readlink -f "$0")
readonly self
readonly lock=/tmp/locus-netns-nodes.lock

die() {
  echo "$prog: error: $*" >&2
  exit 1
}

usage() {
  sed -n '8,13p' "$self" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

resolve_dir() {
  [ -n "${1:-}" ] || usage
  [ -d "$1" ] || die "directory '$1' does not exist (start needs an empty directory; the other commands one that start used)"
  local d
  d=$(cd "$1" && pwd -P)
  # Open MPI splits plm_rsh_agent's value (DIR/agent) at white space.
  [[ "$d" != *[[:space:]]* ]] || die "directory '$d' has white space in its path: use one without (mktemp -d /tmp/lnn.XXXX)"
  echo "$d"
}

# What start recorded: id, subnet prefix (10.213.X), node count.
load() {
  local dir=$1
  [ -f "$dir/nodes.env" ] || die "'$dir' holds no emulated nodes (no nodes.env): run '$prog start $dir' first"
  # shellcheck disable=SC1091
  . "$dir/nodes.env"
}

ns_name() { echo "locus-$id-n$1"; }

# tbf on both ends of node $1's link: the namespace's eth0 (what the node sends) and the
# bridge port (what it receives). Queue: 10 ms at the rate.
shape_node() {
  local k=$1 rate=$2 ns
  ns=$(ns_name "$k")
  if [ "$rate" = off ]; then
    ip netns exec "$ns" tc qdisc del dev eth0 root 2>/dev/null || true
    tc qdisc del dev "lcv${id}n$k" root 2>/dev/null || true
    return
  fi
  ip netns exec "$ns" tc qdisc replace dev eth0 root tbf rate "$rate" burst 64kb latency 10ms ||
    die "tc could not limit node$k's link to '$rate' (a tc rate such as 1gbit or 400mbit)"
  tc qdisc replace dev "lcv${id}n$k" root tbf rate "$rate" burst 64kb latency 10ms ||
    die "tc could not limit node$k's bridge port to '$rate'"
}

cmd_start() {
  local dir nodes=2 slots=2 rate="" lifetime=0 k x used ns
  dir=$(resolve_dir "${1:-}")
  shift
  while [ $# -gt 0 ]; do
    [ $# -ge 2 ] || die "start option '$1' needs a value"
    case "$1" in
      --nodes) nodes=${2:-}; shift 2 ;;
      --slots) slots=${2:-}; shift 2 ;;
      --rate) rate=${2:-}; shift 2 ;;
      --lifetime) lifetime=${2:-}; shift 2 ;;
      *) die "unknown start option '$1' (known: --nodes N, --slots S, --rate RATE, --lifetime SECONDS)" ;;
    esac
  done
  [[ "$nodes" =~ ^[2-8]$ ]] || die "--nodes must be 2 to 8, got '$nodes'"
  [[ "$slots" =~ ^[1-9][0-9]*$ ]] || die "--slots must be a positive whole number, got '$slots'"
  [[ "$lifetime" =~ ^[0-9]+$ ]] || die "--lifetime needs a whole number of seconds, got '$lifetime'"
  [ -z "$(ls -A "$dir")" ] || die "'$dir' is not empty: start needs a fresh directory (stop the nodes there first)"
  [ "$(id -u)" = 0 ] || die "network namespaces need root"
  command -v ip >/dev/null || die "'ip' (iproute2) not found"

  # A free id and /24 under 10.213/16, chosen under a lock so that starts side by side differ.
  exec 9>"$lock"
  flock 9
  used=$(ip -o -4 addr show | awk '{print $4}' | sed -n 's|^10\.213\.\([0-9]*\)\..*|\1|p')
  x=""
  for _ in $(seq 64); do
    local cand=$((RANDOM % 250 + 1))
    if ! grep -qx "$cand" <<<"$used"; then x=$cand; break; fi
  done
  [ -n "$x" ] || die "no free /24 under 10.213.0.0/16 (stale nodes? 'ip netns list' shows them)"
  id=$(printf '%04x' $((RANDOM % 65536)))
  # Not an id in use, or left behind by a set whose stop never ran.
  while ip link show "lcb$id" >/dev/null 2>&1 || [ -e "/run/netns/locus-$id-n1" ]; do
    id=$(printf '%04x' $((RANDOM % 65536)))
  done
  printf 'id=%s\nsubnet=10.213.%s\nnodes=%s\nslots=%s\n' "$id" "$x" "$nodes" "$slots" >"$dir/nodes.env"
  subnet=10.213.$x

  # Undo a half-made set if anything below fails (set -e, or die).
  trap 'cmd_stop "$dir" >/dev/null 2>&1 || true' EXIT
  ip link add "lcb$id" type bridge
  ip addr add "$subnet.254/24" dev "lcb$id"
  ip link set "lcb$id" up
  : >"$dir/hosts"
  for k in $(seq "$nodes"); do
    ns=$(ns_name "$k")
    ip netns add "$ns"
    ip link add "lcv${id}n$k" type veth peer name eth0 netns "$ns"
    ip link set "lcv${id}n$k" master "lcb$id"
    ip link set "lcv${id}n$k" up
    ip -n "$ns" addr add "$subnet.$k/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    echo "$subnet.$k slots=$slots" >>"$dir/hosts"
    if [ -n "$rate" ]; then shape_node "$k" "$rate"; fi
  done
  trap - EXIT
  flock -u 9

  # Open MPI's launcher reaches a "remote" node through this agent instead of ssh: it enters the
  # node's namespace and gives the daemon (and so every rank there) the node's host name.
  cat >"$dir/agent" <<EOF
#!/bin/sh
# plm_rsh_agent for the emulated nodes of $dir: agent HOST COMMAND...
host=\$1; shift
k=\${host##*.}
exec ip netns exec locus-$id-n\$k unshare --uts /bin/sh -c "hostname node\$k && \$*"
EOF
  chmod +x "$dir/agent"
  if [ "$lifetime" -gt 0 ]; then
    # shellcheck disable=SC2016 # expanded by the watchdog's bash
    setsid bash -c 'sleep "$1"; echo "watchdog: lifetime of $1 s over, stopping" >&2; exec bash "$2" stop "$3"' \
      watchdog "$lifetime" "$self" "$dir" </dev/null >>"$dir/watchdog.out" 2>&1 &
    echo $! >"$dir/watchdog.pid"
  fi
  echo "$prog: $nodes nodes node1..node$nodes ($subnet.1-$nodes, $slots slots each; link ${rate:-not limited}) in $dir" >&2
}

cmd_mpirun() {
  local dir
  dir=$(resolve_dir "${1:-}")
  shift
  load "$dir"
  # yield_when_idle: each node's daemon sees the host's cores as its own, so Open MPI does not
  # know the nodes together oversubscribe them; ranks polling without yielding starve the
  # others (an 8-byte MPI_Allreduce of 4 ranks on 2 cores: 6 ms spinning, 0.1 ms yielding).
  exec mpirun --allow-run-as-root --hostfile "$dir/hosts" \
    --mca plm_rsh_agent "$dir/agent" --mca plm_rsh_no_tree_spawn 1 \
    --mca oob_tcp_if_include "$subnet.0/24" --mca btl_tcp_if_include "$subnet.0/24" \
    --mca btl self,vader,tcp --mca osc ucx --mca mpi_yield_when_idle 1 --bind-to none "$@"
}

cmd_shape() {
  local dir k
  dir=$(resolve_dir "${1:-}")
  [ -n "${2:-}" ] || usage
  load "$dir"
  for k in $(seq "$nodes"); do shape_node "$k" "$2"; done
}

# The bridge's end of node K's link: down, the node neither sends nor receives (its processes
# keep running, as on a node whose network failed).
cmd_link() {
  local dir
  dir=$(resolve_dir "${1:-}")
  load "$dir"
  if ! [[ "${2:-}" =~ ^[1-8]$ ]] || [ "$2" -gt "$nodes" ]; then die "no node '${2:-}' (nodes are 1 to $nodes)"; fi
  case "${3:-}" in
    down | up) ip link set "lcv${id}n$2" "$3" ;;
    *) die "link needs 'down' or 'up', got '${3:-}'" ;;
  esac
}

cmd_stop() {
  local dir k ns pids wd
  dir=$(resolve_dir "${1:-}")
  load "$dir"
  wd=$(cat "$dir/watchdog.pid" 2>/dev/null || true)
  # The watchdog's whole process group (its sleep too), unless the watchdog is this stop.
  if [ -n "$wd" ] && [ "$wd" != "$$" ]; then kill -- -"$wd" 2>/dev/null || true; fi
  for k in $(seq "$nodes"); do
    ns=$(ns_name "$k")
    [ -e "/run/netns/$ns" ] || continue
    # Until none is left: a daemon may fork a rank between the listing and the kill.
    for _ in 1 2 3 4 5; do
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [ -n "$pids" ] || break
      # shellcheck disable=SC2086 # a list of PIDs
      kill -KILL $pids 2>/dev/null || true
      sleep 0.1
    done
    ip netns del "$ns" 2>/dev/null || true
  done
  # The veth pairs at once (a namespace whose killed processes are still exiting outlives its
  # name, and its end of the pair with it).
  for k in $(seq "$nodes"); do ip link del "lcv${id}n$k" 2>/dev/null || true; done
  ip link del "lcb$id" 2>/dev/null || true
  rm -f "$dir/nodes.env" "$dir/hosts" "$dir/agent" "$dir/watchdog.pid" "$dir/watchdog.out"
}

# Whether nodes can be made here, tried on throw-away names: a namespace, a bridge, a veth pair
# into the namespace, a tbf qdisc. Tests skip (exit 77) when it fails.
cmd_check() {
  local ns=locus-check-$$ ok=1
  [ "$(id -u)" = 0 ] || { echo "$prog: network namespaces need root" >&2; return 1; }
  # (k in the throw-away names: not a hex digit, so never a running set's lcb<id>.)
  local t
  for t in ip tc nsenter unshare hostname; do
    command -v "$t" >/dev/null || { echo "$prog: '$t' not found: needs iproute2 (ip, tc), util-linux (nsenter, unshare) and hostname" >&2; return 1; }
  done
  ip netns add "$ns" 2>/dev/null || { echo "$prog: 'ip netns add' failed: no network namespaces here" >&2; return 1; }
  { ip link add "lcbk$$" type bridge &&
    ip link add "lcvk$$" type veth peer name eth0 netns "$ns" &&
    tc qdisc add dev "lcvk$$" root tbf rate 1gbit burst 64kb latency 10ms; } >/dev/null 2>&1 || ok=0
  ip link del "lcvk$$" 2>/dev/null || true
  ip link del "lcbk$$" 2>/dev/null || true
  ip netns del "$ns" 2>/dev/null || true
  [ $ok = 1 ] || { echo "$prog: a bridge, a veth pair into a namespace or a tc tbf qdisc could not be made" >&2; return 1; }
}

case "${1:-}" in
  check) cmd_check ;;
  start | mpirun | shape | link | stop)
    c=$1
    shift
    "cmd_$c" "$@"
    ;;
  *) usage ;;
esac
