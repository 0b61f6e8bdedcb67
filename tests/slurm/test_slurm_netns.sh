#!/usr/bin/env bash
# Slurm nodes with a network of their own (slurm-cluster.sh --nodes 3 --netns: each slurmd in a
# network namespace with its own host name and a veth link to a bridge), so that jobs see what
# a cluster's nodes are -- distinct hosts, shared memory inside a node, TCP between them -- and
# a node can lose its network:
#  1. A 2-node x 2-task job runs slurm_node_probe under mpirun and under srun --mpi=pmix with
#     Open MPI's default transports (no OMPI_MCA_btl): ranks 0,1 on one host and 2,3 on
#     another, each rank's host name its Slurm node's, comm::Topology finding the 2 nodes.
#  2. The real locus-train via slurm/train.sbatch, 2 nodes x 2 tasks, checkpointing every 20
#     steps. Mid-run the link of the node of ranks 2,3 goes down for good (its processes keep
#     running, cut off). slurmctld sets that node DOWN after SlurmdTimeout (10 s) and requeues
#     the job (NODE_FAIL, --requeue); the rerun lands on the two other nodes, resumes from the
#     newest checkpoint with --resume=auto and ends with the model of an uninterrupted 4-rank
#     run, bit for bit. Then the link comes back and the node returns to service by itself
#     (ReturnToService=2), with no rank of the job left on it. The latencies are logged.
# Exits 77 (skipped) where network namespaces cannot be made (netns-nodes.sh check).
#   test_slurm_netns.sh APPS_DIR PATH_TO_slurm_node_probe
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

locus_trainer_setup "${1:?usage: $0 APPS_DIR PATH_TO_slurm_node_probe}"
probe=$(readlink -f "${2:?usage: $0 APPS_DIR PATH_TO_slurm_node_probe}")
[ -x "$probe" ] || slurm_fail "$probe is not an executable: build the target slurm_node_probe"
nodes_sh=$LOCUS_REPO/scripts/netns-nodes.sh
if ! bash "$nodes_sh" check; then
  echo "SKIP: cannot make nodes with a network of their own here (need root, ip netns, veth, bridge, tc tbf)"
  exit 77
fi
# 79 steps an epoch (global batch 128); every rank waits 40 ms a step, so the first run is
# still training when its node is cut off at step $cut_at, and the rerun for a while after.
readonly steps=$((2 * 79)) cut_at=45
train_args=(--data.train=fm-test.h5 --data.test=fm-test.h5 "--model.widths=784,128,10"
  --model.dropout=0.1 --optim.warmup_steps=10 --train.epochs=2 --train.log_every=5 --eval.every=0)

slurm_cluster_setup --nodes 3 --netns
cd "$LSC_WORK"
net=$LSC_DIR/net
[ "$(sinfo -h -N -o '%N %c %T' | sort -u | tr '\n' ' ')" = "node1 4 idle node2 4 idle node3 4 idle " ] ||
  slurm_fail "expected nodes node1..node3, 4 CPUs each, idle: $(sinfo -N)"
[ -z "${OMPI_MCA_btl:-}" ] || slurm_fail "slurm-cluster.sh env set OMPI_MCA_btl=$OMPI_MCA_btl for nodes with their own network"

# 1. Both launchers across two hosts.
cat >probe.sh <<EOF
#!/bin/bash
echo "mpirun:"
mpirun -n 4 $LOCUS_MPIRUN_ARGS "$probe"
echo "srun:"
srun -n 4 "$probe"
EOF
probe_job=$(slurm_submit -N 2 --ntasks-per-node=2 -o probe.log probe.sh)
ingest=$(locus_submit_fm_test_ingest)
slurm_wait_state "$probe_job" COMPLETED 90 || slurm_fail "probe job $probe_job: $(cat probe.log)"
for launcher in mpirun srun; do
  # (Under mpirun, SLURM_NODEID is the orted step's: 0 on every node. Not checked.)
  sed -n "/^$launcher:/,/^[a-z]*:$/p" probe.log | grep "^rank " | sort -n -k 2 | awk -v job="$probe_job" '
    $4 == 4 && $6 == job && $12 == int($2 / 2) && $14 == 2 && $16 == $8 { host[$2] = $16; ok++ }
    END { exit !(ok == 4 && host[0] == host[1] && host[2] == host[3] && host[0] != host[2]) }' ||
    slurm_fail "$launcher: expected ranks 0,1 on one host and 2,3 on another, each host named as its Slurm node: $(cat probe.log)"
  sed -n "/^$launcher:/,/^[a-z]*:$/p" probe.log |
    grep -qx "topology: 4 ranks on 2 nodes (2+2; shared memory and Slurm node names)" ||
    slurm_fail "$launcher: comm::Topology did not find 2 nodes of 2 ranks: $(cat probe.log)"
done
slurm_log "probe: mpirun and srun each put ranks 0,1 and 2,3 on two hosts of $(slurm_job_field "$probe_job" NodeList)"

# 2. A node lost mid-training.
slurm_wait_state "$ingest" COMPLETED 120 || slurm_fail "the ingest job failed: $(cat ingest.log)"
job=$(LOCUS_TEST_HOOK=train-step:delay40 slurm_submit -N 2 --ntasks=4 --ntasks-per-node=2 \
  -o train.log "$LOCUS_REPO/slurm/train.sbatch" "${train_args[@]}" --train.output=model.h5 \
  --train.metrics=metrics.jsonl --checkpoint.dir=ck --checkpoint.every_steps=20 --train.watchdog_s=5)
# The uninterrupted reference (4 ranks, two a node as in the job, no Slurm), meanwhile.
LOCUS_REFERENCE_RANKS=4 LOCUS_TEST_RANKS_PER_NODE=2 locus_reference_start "${train_args[@]}"

# "RANK HOST" for every live locus-train rank of job $1 (the host name of its UTS namespace).
train_ranks() {
  local p env
  for p in $(pgrep -x locus-train || true); do
    env=$({ tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null) || continue
    grep -qx "SLURM_JOB_ID=$1" <<<"$env" || continue
    echo "$(sed -n 's/^OMPI_COMM_WORLD_RANK=//p' <<<"$env") $(nsenter --uts --target "$p" hostname 2>/dev/null || echo -)"
  done | sort -n
}
# Succeeds when job $job has its 4 ranks running, 0,1 on one host and 2,3 on another; writes
# the two hosts to the file placement.
ranks_on_two_nodes() {
  local r
  r=$(train_ranks "$job")
  [ "$(echo "$r" | grep -c .)" = 4 ] || return 1
  echo "$r" | awk '
    { rank[NR-1] = $1; host[NR-1] = $2 }
    END {
      for (i = 0; i < 4; i++) if (rank[i] != i || host[i] !~ /^node[1-3]$/) exit 1
      if (host[0] != host[1] || host[2] != host[3] || host[0] == host[2]) exit 1
      print host[0], host[2]
    }' >placement || { echo "job $job: ranks not 2+2 on two hosts: $(echo "$r" | tr '\n' ';')" >&2; return 1; }
}
last_step() {
  local n
  n=$(sed -n 's/^{"type":"step","step":\([0-9]*\),.*/\1/p' metrics.jsonl 2>/dev/null | tail -n 1)
  echo "${n:-0}"
}
running_past_cut() {
  case " $SLURM_FINAL_STATES " in
    *" $(slurm_job_field "$job" JobState) "*) slurm_fail "job $job ended $(slurm_job_field "$job" JobState) before its node was cut off" ;;
  esac
  [ "$(last_step)" -ge $cut_at ]
}
slurm_wait_until 90 "the 4 ranks of job $job on two hosts" ranks_on_two_nodes ||
  slurm_fail "job $job: $(train_ranks "$job" | tr '\n' ';') $(tail -n 5 train.log)"
read -r first_a first_b <placement
slurm_wait_until 90 "job $job past step $cut_at" running_past_cut ||
  slurm_fail "job $job: at step $(last_step): $(tail -n 20 train.log)"

at=$(last_step)
bash "$nodes_sh" link "$net" "${first_b#node}" down
cut=$SECONDS
slurm_log "job $job: ranks 0,1 on $first_a, 2,3 on $first_b; $first_b cut off the network at step $at"
node_state() { sinfo -h -n "$1" -o %T | head -n 1; }
is_down() { case "$(node_state "$first_b")" in down*) return 0 ;; esac; return 1; }
slurm_wait_until 60 "$first_b to be set DOWN" is_down ||
  slurm_fail "$first_b is $(node_state "$first_b") 60 s after its link went down; job $job $(slurm_job_field "$job" JobState)"
down_s=$((SECONDS - cut))
slurm_wait_until 90 "the rerun of job $job to start" grep -q "restart 1, " train.log ||
  slurm_fail "job $job was not started again: $(slurm_job_field "$job" JobState) $(tail -n 5 train.log)"
rerun_s=$((SECONDS - cut))
slurm_wait_until 60 "the rerun of job $job on two hosts" ranks_on_two_nodes ||
  slurm_fail "job $job rerun: $(slurm_job_field "$job" JobState) $(train_ranks "$job" | tr '\n' ';') $(tail -n 5 train.log)"
read -r second_a second_b <placement
[ "$second_a" != "$first_b" ] && [ "$second_b" != "$first_b" ] ||
  slurm_fail "the rerun of job $job runs on $second_a and $second_b, including the cut-off $first_b"
slurm_log "job $job: $first_b DOWN $down_s s after the cut, rerun on $second_a+$second_b $rerun_s s after it"

# The network back: the node rejoins by itself while the rerun trains.
bash "$nodes_sh" link "$net" "${first_b#node}" up
back=$SECONDS
is_idle() { [ "$(node_state "$first_b")" = idle ] || [ "$(node_state "$first_b")" = allocated ]; }
slurm_wait_state "$job" COMPLETED 180 || slurm_fail "job $job did not complete: $(tail -n 30 train.log)"
[ "$(slurm_job_field "$job" ExitCode)" = 0:0 ] || slurm_fail "job $job: ExitCode $(slurm_job_field "$job" ExitCode)"
locus_reference_wait
slurm_wait_until 150 "$first_b to return to service" is_idle ||
  slurm_fail "$first_b is $(node_state "$first_b") 150 s after its link came back: $(grep "$first_b" "$LSC_DIR/log/slurmctld.log" | tail -n 5)"
rejoin_s=$((SECONDS - back))
# What ran on the cut-off node ended when the node could talk again.
left_on_b() { [ -z "$(train_ranks "$job")" ]; }
slurm_wait_until 30 "no rank of job $job left on $first_b" left_on_b ||
  slurm_fail "ranks of job $job still run: $(train_ranks "$job" | tr '\n' ';')"

[ "$(slurm_job_field "$job" Restarts)" = 1 ] || slurm_fail "job $job: Restarts=$(slurm_job_field "$job" Restarts), expected 1"
grep -q "requeue job JobId=$job due to failure of node $first_b" "$LSC_DIR/log/slurmctld.log" ||
  slurm_fail "slurmctld did not log the requeue of job $job for $first_b: $(tail -n 20 "$LSC_DIR/log/slurmctld.log")"
runs=$(grep "restart [0-9]*, .*, nodes .*, 4 tasks: mpirun -n 4 " train.log || true)
echo "$runs" | grep "restart 1," | grep -q -- "locus-train --resume=auto " ||
  slurm_fail "train.log: the rerun did not pass --resume=auto: $runs"
resumed=$(sed -n 's/^resumed from ck\/ckpt-[0-9]*\.h5: step \([0-9]*\) of \([0-9]*\) .*/\1 \2/p' train.log | head -n 1)
read -r from total <<<"$resumed"
[ "${total:-}" = "$steps" ] && [ "$from" -ge $((at / 20 * 20)) ] && [ "$from" -lt "$steps" ] ||
  slurm_fail "train.log: the rerun resumed '$resumed', expected the newest checkpoint (every 20 steps) at or past step $((at / 20 * 20)) of $steps: $(grep -e '^resumed' -e '^checkpoint' train.log)"
grep -q "^trained $((steps - from)) steps" train.log ||
  slurm_fail "train.log: the rerun did not train the $((steps - from)) steps left: $(grep '^trained' train.log)"
locus_same_tensors model.h5 model-ref.h5 || slurm_fail "job $job: model.h5 differs from the uninterrupted run's"
slurm_log "job $job: cut at step $at, resumed from step $from on $second_a+$second_b, model identical; $first_b back in service $rejoin_s s after its link"
echo "PASS: 2-host jobs under mpirun and srun; a node lost mid-training: DOWN in ${down_s} s, rerun in ${rerun_s} s from step $from, model bit for bit; node back in ${rejoin_s} s"
