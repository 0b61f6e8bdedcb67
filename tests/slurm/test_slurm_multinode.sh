#!/usr/bin/env bash
# Jobs spanning several Slurm nodes, on a 3-node cluster emulated on this host
# (slurm-cluster.sh --nodes 3):
#  1. A 2-node x 2-task job runs slurm_node_probe under mpirun and under srun --mpi=pmix: each
#     launch is one 4-rank world with ranks 0,1 on one node and 2,3 on another (SLURMD_NODENAME,
#     SLURM_NODEID), and comm::Topology finds the same 2 nodes.
#  2. The real locus-train via slurm/train.sbatch, 2 nodes x 2 tasks under mpirun in partition
#     low, rank 3 slowed by a test hook and straggler exclusion on: each rank runs under the
#     slurmstepd of the node its environment names, ranks 0,1 and 2,3 on two nodes. Rank 3 is
#     reported a straggler on its node; a job in high needing every CPU preempts the training,
#     which checkpoints on USR1 and exits 75; the script requeues it and excludes rank 3's node;
#     the rerun lands on the two other nodes, resumes from that checkpoint with --resume=auto and
#     ends with the model of an uninterrupted 4-rank run, bit for bit.
#   test_slurm_multinode.sh APPS_DIR PATH_TO_slurm_node_probe
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

locus_trainer_setup "${1:?usage: $0 APPS_DIR PATH_TO_slurm_node_probe}"
probe=$(readlink -f "${2:?usage: $0 APPS_DIR PATH_TO_slurm_node_probe}")
[ -x "$probe" ] || slurm_fail "$probe is not an executable: build the target slurm_node_probe"
# 79 steps an epoch (global batch 128). The preemption comes past the first epoch-end checkpoint
# (so the rerun must take the newest one, the signal's) and well before the end. Rank 3 waits
# 50 ms a step in every run: the other ranks wait for it, so a step takes at least that, and
# the 152 steps from step 85 to the end at least 7.6 s, the window for the preemption.
readonly epochs=3 steps=$((3 * 79)) interrupt_at=85
train_args=(--data.train=fm-test.h5 --data.test=fm-test.h5 "--model.widths=784,128,10"
  --model.dropout=0.1 --optim.warmup_steps=10 "--train.epochs=$epochs" --train.log_every=5
  --train.straggler_intervals=6 --eval.every=0)

slurm_cluster_setup --nodes 3
cd "$LSC_WORK"
[ "$(sinfo -h -N -o '%N %c %T' | sort -u | tr '\n' ' ')" = "node1 4 idle node2 4 idle node3 4 idle " ] ||
  slurm_fail "expected nodes node1..node3, 4 CPUs each, idle: $(sinfo -N)"
[ "${OMPI_MCA_btl:-}" = self,tcp ] || slurm_fail "slurm-cluster.sh env did not set OMPI_MCA_btl=self,tcp for the 3-node cluster"

# The node whose slurmd started process $1's job step: the slurmstepd above it keeps that
# node's log (DIR/log/slurmd.NODE.log) open.
stepd_node() {
  local p=$1 log
  while [ -n "$p" ] && [ "$p" != 1 ]; do
    if [ "$(cat "/proc/$p/comm" 2>/dev/null)" = slurmstepd ]; then
      log=$(find "/proc/$p/fd" -lname "$LSC_DIR/log/slurmd.*.log" -printf '%l\n' 2>/dev/null | head -n 1)
      log=${log##*/slurmd.}
      echo "${log%.log}"
      return
    fi
    p=$(awk '{print $4}' "/proc/$p/stat" 2>/dev/null || true)
  done
  echo "-"
}
# "RANK SLURMD_NODENAME SLURM_NODEID STEPD_NODE" for every live locus-train rank of job $1.
train_ranks() {
  local p env
  for p in $(pgrep -x locus-train || true); do
    # (A process that has just ended, or a zombie, has no environment to read.)
    env=$({ tr '\0' '\n' <"/proc/$p/environ"; } 2>/dev/null) || continue
    grep -qx "SLURM_JOB_ID=$1" <<<"$env" || continue
    echo "$(sed -n 's/^OMPI_COMM_WORLD_RANK=//p' <<<"$env") $(sed -n 's/^SLURMD_NODENAME=//p' <<<"$env")" \
      "$(sed -n 's/^SLURM_NODEID=//p' <<<"$env") $(stepd_node "$p")"
  done | sort -n
}
# Succeeds when job $job has its 4 ranks running: ranks 0,1 on one node, 2,3 on another, each
# under that node's slurmstepd; writes the two nodes to the file placement.
ranks_on_two_nodes() {
  local r
  r=$(train_ranks "$job")
  [ "$(echo "$r" | grep -c .)" = 4 ] || return 1
  echo "$r" | awk '
    { rank[NR-1] = $1; node[NR-1] = $2; id[NR-1] = $3; stepd[NR-1] = $4 }
    END {
      for (i = 0; i < 4; i++) if (rank[i] != i || node[i] != stepd[i] || id[i] != int(i / 2)) exit 1
      if (node[0] != node[1] || node[2] != node[3] || node[0] == node[2]) exit 1
      print node[0], node[2]
    }' >placement || { echo "job $job: ranks not 2+2 on two nodes: $(echo "$r" | tr '\n' ';')" >&2; return 1; }
}

# 1. Both launchers across two nodes.
cat >probe.sh <<EOF
#!/bin/bash
echo "mpirun:"
mpirun -n 4 $LOCUS_MPIRUN_ARGS "$probe"
echo "srun:"
srun -n 4 "$probe"
EOF
probe_job=$(slurm_submit -N 2 --ntasks-per-node=2 -o probe.log probe.sh)
ingest=$(locus_submit_fm_test_ingest)
job=$(LOCUS_EXCLUDE_STRAGGLERS=1 LOCUS_TEST_HOOK=train-step:delay50@3 slurm_submit \
  --dependency=afterok:"$ingest" -p low -N 2 --ntasks=4 --ntasks-per-node=2 -o train.log \
  "$LOCUS_REPO/slurm/train.sbatch" "${train_args[@]}" --train.output=model.h5 \
  --train.metrics=metrics.jsonl --checkpoint.dir=ck)

slurm_wait_state "$probe_job" COMPLETED 90 || slurm_fail "probe job $probe_job: $(cat probe.log)"
probe_nodes=$(slurm_job_field "$probe_job" NodeList)
for launcher in mpirun srun; do
  lines=$(sed -n "/^$launcher:/,/^[a-z]*:$/p" probe.log | grep "^rank " | sort -n -k 2) || true
  echo "$lines" | awk -v job="$probe_job" '
    $4 == 4 && $6 == job && $10 == int($2 / 2) && $12 == int($2 / 2) && $14 == 2 { node[$2] = $8; ok++ }
    END { exit !(ok == 4 && node[0] == node[1] && node[2] == node[3] && node[0] != node[2]) }' ||
    slurm_fail "$launcher: expected ranks 0,1 on one node and 2,3 on another (SLURM_NODEID 0 and 1, Topology nodes 0 and 1 of 2) in job $probe_job on $probe_nodes: $(cat probe.log)"
  sed -n "/^$launcher:/,/^[a-z]*:$/p" probe.log |
    grep -qx "topology: 4 ranks on 2 nodes (2+2; shared memory and Slurm node names)" ||
    slurm_fail "$launcher: comm::Topology did not find 2 nodes of 2 ranks: $(cat probe.log)"
done
slurm_log "probe: mpirun and srun each put ranks 0,1 and 2,3 on two nodes of $probe_nodes"

# 2. The training across nodes, preempted, requeued off its straggler's node, resumed.
slurm_wait_state "$ingest" COMPLETED 120 || slurm_fail "the ingest job failed: $(cat ingest.log)"
slurm_wait_until 90 "the 4 ranks of job $job on two nodes" ranks_on_two_nodes ||
  slurm_fail "job $job: $(train_ranks "$job" | tr '\n' ';') $(tail -n 5 train.log)"
read -r first_a first_b <placement
slurm_log "run 0: ranks 0,1 on $first_a, ranks 2,3 on $first_b"

last_step() { locus_last_step metrics.jsonl; }
# Rank 3 alone is listed as a straggler (a loaded machine can make any rank slow for a while:
# the file then lists it too, and the requeue would exclude its node as well).
only_rank3() { [ -r ck/stragglers ] && [ "$(grep -v '^#' ck/stragglers | cut -d' ' -f1 | tr '\n' ' ')" = "3 " ]; }
ready() {
  case " $SLURM_FINAL_STATES " in
    *" $(slurm_job_field "$job" JobState) "*) slurm_fail "job $job ended $(slurm_job_field "$job" JobState) before it was preempted" ;;
  esac
  [ "$(last_step)" -ge $interrupt_at ] && only_rank3
}
slurm_wait_until 120 "rank 3 alone in ck/stragglers past step $interrupt_at" ready ||
  slurm_fail "job $job: at step $(last_step), stragglers: $(cat ck/stragglers 2>/dev/null): $(tail -n 20 train.log)"
straggler_node=$(awk '/^3 / { print $3 }' ck/stragglers)
[ "$straggler_node" = "$first_b" ] || slurm_fail "ck/stragglers names node '$straggler_node' for rank 3, which runs on $first_b"

# Every CPU of the cluster in high: the low job must give way.
slurm_log "preempting job $job at step $(last_step)"
# shellcheck disable=SC2016 # expanded by the job
high=$(slurm_submit -p high -N 3 --ntasks-per-node=4 -o high.log --wrap 'echo "high ran on $SLURM_JOB_NODELIST"')
slurm_wait_until 60 "job $job to be signalled" grep -q "SIGUSR1: forwarding" train.log ||
  slurm_fail "job $job: its batch shell got no USR1 on preemption: $(tail -n 20 train.log)"
excluded() { [ "$(slurm_job_field "$job" ExcNodeList)" = "$straggler_node" ]; }
slurm_wait_until 90 "job $job requeued with ExcNodeList=$straggler_node" excluded ||
  slurm_fail "job $job: ExcNodeList=$(slurm_job_field "$job" ExcNodeList), Restarts=$(slurm_job_field "$job" Restarts): $(tail -n 20 train.log)"
slurm_wait_state "$high" COMPLETED 60 || slurm_fail "preemptor $high did not complete"

# The uninterrupted reference (4 ranks, no Slurm), while the requeued job waits to start again.
# Two ranks a node, as in the job, should locus ever reduce by node (comm::Topology).
LOCUS_REFERENCE_RANKS=4 LOCUS_TEST_RANKS_PER_NODE=2 locus_reference_start "${train_args[@]}"

slurm_wait_until 120 "the rerun of job $job to start" grep -q "restart 1, " train.log ||
  slurm_fail "job $job was not started again: $(slurm_job_field "$job" JobState) $(tail -n 5 train.log)"
slurm_wait_until 60 "the rerun of job $job on two nodes" ranks_on_two_nodes ||
  slurm_fail "job $job rerun: $(slurm_job_field "$job" JobState) $(train_ranks "$job" | tr '\n' ';') $(tail -n 5 train.log)"
read -r second_a second_b <placement
slurm_log "run 1: ranks 0,1 on $second_a, ranks 2,3 on $second_b"
[ "$second_a" != "$straggler_node" ] && [ "$second_b" != "$straggler_node" ] ||
  slurm_fail "the rerun of job $job runs on $second_a and $second_b, including the excluded $straggler_node"

slurm_wait_state "$job" COMPLETED 180 || slurm_fail "job $job did not complete: $(tail -n 30 train.log)"
[ "$(slurm_job_field "$job" ExitCode)" = 0:0 ] || slurm_fail "job $job: ExitCode $(slurm_job_field "$job" ExitCode)"
locus_reference_wait

restarts=$(slurm_job_field "$job" Restarts)
[ "$restarts" = 1 ] || slurm_fail "job $job: Restarts=$restarts, expected 1"
runs=$(grep "restart [0-9]*, .*, nodes .*, 4 tasks: mpirun -n 4 " train.log || true)
[ "$(echo "$runs" | sed 's/.*restart \([0-9]*\),.*/\1/' | tr '\n' ' ')" = "0 1 " ] ||
  slurm_fail "train.log: expected runs 0 and 1 of 4 tasks under mpirun: $(cat train.log)"
echo "$runs" | grep "restart 1," | grep -q -- "locus-train --resume=auto " &&
  echo "$runs" | grep "restart 0," | grep -qv -- --resume ||
  slurm_fail "train.log: --resume=auto must be passed on the rerun only: $runs"
grep -q "job $job will not run on $straggler_node again" train.log ||
  slurm_fail "train.sbatch did not log the exclusion of $straggler_node: $(cat train.log)"
stop=$(sed -n -e 's/^SIGUSR1 received: checkpointing step \([0-9]*\) and stopping.*/\1/p' \
  -e 's/^SIGUSR1 received during the checkpoint of step \([0-9]*\): stopping.*/\1/p' train.log | head -n 1)
[ -n "$stop" ] || slurm_fail "train.log: the trainer took no signal checkpoint: $(cat train.log)"
[ "$stop" -gt 79 ] && [ "$stop" -lt "$steps" ] ||
  slurm_fail "train.log: interrupted at step $stop, not mid-run (1 epoch < step < $steps): raise epochs in $0"
grep -q "^stopped by SIGUSR1 after step $stop: exit 75" train.log && grep -q "checkpointed: requeued job $job" train.log ||
  slurm_fail "train.log: no exit 75 followed by a requeue"
resumed=$(sed -n 's/^resumed from \(.*\): step \([0-9]*\) of \([0-9]*\) .*/\1 \2 \3/p' train.log | head -n 1)
[ "$resumed" = "ck/ckpt-$(printf %08d "$stop").h5 $stop $steps" ] ||
  slurm_fail "train.log: the rerun did not resume from the signal checkpoint of step $stop: '$resumed'"
grep -q "^trained $((steps - stop)) steps" train.log ||
  slurm_fail "train.log: the rerun did not train the $((steps - stop)) steps left after step $stop: $(grep '^trained' train.log)"
locus_same_tensors model.h5 model-ref.h5 || slurm_fail "job $job: model.h5 differs from the uninterrupted run's"
slurm_log "job $job: preempted at step $stop of $steps on $first_a+$first_b, rerun on $second_a+$second_b (excluded $straggler_node), model identical"
echo "PASS: 2-node jobs under mpirun and srun; a 2-node training preempted, requeued off its straggler's node and resumed bit for bit"
