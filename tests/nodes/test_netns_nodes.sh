#!/usr/bin/env bash
# The apps across two emulated nodes with a network of their own (scripts/netns-nodes.sh: a
# network namespace and host name per node, shared memory inside a node, TCP over a veth link
# between them), 2 ranks a node, against the same runs on one host:
#  1. comm::Topology finds the 2 nodes by shared memory alone (ranks 0,1 and 2,3).
#  2. locus-ingest across the nodes writes the same datasets, bit for bit, as 2 ranks on one host.
#  3. locus-train, train.reduction = auto, picks the hierarchical reduction (only the leaders
#     exchange gradients over the link) and ends with the model of a flat 4-rank run on one
#     host, bit for bit; so do a flat run across the nodes and one whose ranks are dealt to
#     the nodes in turn (mpirun --map-by node; the grid numbers them node by node).
#  4. The same with the link limited to 100 Mbit/s in each direction (tc tbf): the same bits.
#  5. Training from node-local staged copies (data.stage_dir; one file a node): both nodes
#     stage, one host's model bit for bit. Pipeline stages inside a node, replicas across
#     (pp=2, dp=2), ranks in blocks or dealt in turn: the model of the same grid declared on
#     one host (LOCUS_TEST_RANKS_PER_NODE=2), bit for bit.
#  6. locus-infer across the nodes (the one-sided work queue over the link), ranks in blocks or
#     dealt in turn: the predictions of 2 ranks on one host, byte for byte.
#  7. SIGTERM to a rank on node2 mid-run: one checkpoint across the nodes, exit 75; resumed on
#     one host, the uninterrupted model, bit for bit.
#  8. node2's link down for 3 s mid-training, then up: the run goes on by itself and ends with
#     one host's model, bit for bit.
#  9. node2 cut off the network mid-training: node1's ranks report the stuck operation within
#     train.watchdog_s (exit 70) and end.
# Exits 77 (skipped) where emulated nodes cannot be made (not root; no ip netns, veth, bridge or
# tc tbf).
#   test_netns_nodes.sh APPS_DIR PATH_TO_slurm_node_probe
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/slurm-lib.sh
. "$here/../../scripts/slurm-lib.sh"   # slurm_log, slurm_fail (no cluster is started)
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$here/../slurm/locus-jobs-lib.sh"   # locus_make_csv, locus_same_tensors

bin=$(readlink -f "${1:?usage: $0 APPS_DIR PATH_TO_slurm_node_probe}")
probe=$(readlink -f "${2:?usage: $0 APPS_DIR PATH_TO_slurm_node_probe}")
nodes_sh=$LOCUS_REPO/scripts/netns-nodes.sh
for x in "$bin/locus-ingest" "$bin/locus-train" "$bin/locus-infer" "$probe"; do
  [ -x "$x" ] || slurm_fail "$x is not an executable: build it"
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1

if ! bash "$nodes_sh" check; then
  echo "SKIP: cannot make emulated nodes here (need root, iproute2's ip netns, veth and bridge links, tc tbf)"
  exit 77
fi

work=$(mktemp -d /tmp/lnn.XXXX)
cleanup() {
  # An mpirun that lost a node's daemon would wait for TCP to give up (about 15 minutes).
  pkill -KILL -f -- "--hostfile $work/nodes/hosts" 2>/dev/null || true
  bash "$nodes_sh" stop "$work/nodes" >/dev/null 2>&1 || true
  [ -n "${LNN_KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
mkdir "$work/nodes"
bash "$nodes_sh" start "$work/nodes" --nodes 2 --slots 2 --lifetime 300 || slurm_fail "could not start the nodes"
cd "$work"
across() { bash "$nodes_sh" mpirun "$work/nodes" "$@"; }
here_n() { local n=$1; shift; mpirun --oversubscribe --bind-to none -n "$n" "$@"; }

# 1. Topology.
across -n 4 "$probe" >probe.log 2>&1 || slurm_fail "node probe across the nodes failed: $(cat probe.log)"
grep -q '^topology: 4 ranks on 2 nodes (2+2; shared memory)' probe.log ||
  slurm_fail "expected 4 ranks on 2 nodes found by shared memory: $(cat probe.log)"
for r in 0 1 2 3; do
  grep -q "^rank $r of 4 .*topology_node $((r / 2)) of 2" probe.log ||
    slurm_fail "rank $r is not on node $((r / 2)): $(cat probe.log)"
done
slurm_log "topology: ranks 0,1 on node1 and 2,3 on node2, found by shared memory"

# 2. Ingest.
locus_make_csv tiny-train.csv 2000 1
locus_make_csv tiny-test.csv 500 2
ingest=("$bin/locus-ingest" --config "$LOCUS_REPO/configs/tiny.ini")
across -n 4 "${ingest[@]}" >ingest.log 2>&1 || slurm_fail "ingest across the nodes failed: $(cat ingest.log)"
here_n 2 "${ingest[@]}" --ingest.output=tiny-train-1host.h5 >ingest-1host.log 2>&1 ||
  slurm_fail "ingest on one host failed: $(cat ingest-1host.log)"
locus_same_tensors tiny-train.h5 tiny-train-1host.h5 || slurm_fail "ingest across the nodes wrote other bytes"
across -n 4 "${ingest[@]}" --ingest.csv=tiny-test.csv --ingest.output=tiny-test.h5 >>ingest.log 2>&1 ||
  slurm_fail "ingest of the test set across the nodes failed: $(cat ingest.log)"
here_n 2 "${ingest[@]}" --ingest.csv=tiny-test.csv --ingest.output=tiny-test-1host.h5 >>ingest-1host.log 2>&1 ||
  slurm_fail "ingest of the test set on one host failed: $(cat ingest-1host.log)"
locus_same_tensors tiny-test.h5 tiny-test-1host.h5 || slurm_fail "ingest of the test set across the nodes wrote other bytes"
slurm_log "ingest: 4 ranks on 2 nodes wrote the datasets of 2 ranks on one host, bit for bit"

# 3.-5. Training.
train=("$bin/locus-train" --config "$LOCUS_REPO/configs/tiny.ini" --train.metrics=)
train_as() {   # NAME LAUNCHER-FUNCTION ARGS...
  local name=$1 launch=$2
  shift 2
  "$launch" "$@" --train.output="model-$name.h5" >"train-$name.log" 2>&1 ||
    slurm_fail "training '$name' failed: $(cat "train-$name.log")"
}
train_as ref here_n 4 "${train[@]}" --train.reduction=flat
train_as auto across -n 4 "${train[@]}"
grep -q '^ *gradient reduction: hierarchical (train.reduction = auto: 4 ranks on 2 nodes' train-auto.log ||
  slurm_fail "train.reduction = auto did not pick hierarchical on 2 nodes: $(grep -i reduction train-auto.log)"
train_as flat across -n 4 "${train[@]}" --train.reduction=flat
for m in auto flat; do
  locus_same_tensors "model-$m.h5" model-ref.h5 || slurm_fail "the $m model across the nodes differs from one host's"
done
# Ranks dealt to the nodes in turn (mpirun --map-by node: 0,2 on node1, 1,3 on node2): the grid
# numbers them node by node, so the reduction still sums in one host's order.
train_as cyclic across -n 4 --map-by node "${train[@]}"
grep -q '^ *node 0: rank 0 = replica 0 stage 0, rank 2 = replica 1 stage 0' train-cyclic.log ||
  slurm_fail "ranks 0,2 not placed on node 0 as replicas 0,1: $(grep -A2 layout train-cyclic.log)"
locus_same_tensors model-cyclic.h5 model-ref.h5 || slurm_fail "the model with ranks dealt in turn differs"
bash "$nodes_sh" shape "$work/nodes" 100mbit || slurm_fail "could not limit the link"
train_as slow across -n 4 "${train[@]}"
bash "$nodes_sh" shape "$work/nodes" off
locus_same_tensors model-slow.h5 model-ref.h5 || slurm_fail "the model over a 100 Mbit/s link differs"
slurm_log "train: hierarchical and flat across the nodes, ranks dealt in turn, and over a 100 Mbit/s link, end with one host's model, bit for bit"

# Node-local staging: each node copies its ranks' rows into its own file under stage_dir (the
# nodes share this host's /tmp, so the files must differ by node, not by path alone).
mkdir "$work/stage"
train_as staged across -n 4 "${train[@]}" --data.stage_dir="$work/stage"
grep -q '^ *data staged in .*: 2 of 2 nodes staged it afresh' train-staged.log ||
  slurm_fail "expected both nodes to stage the data: $(head -n 12 train-staged.log)"
locus_same_tensors model-staged.h5 model-ref.h5 || slurm_fail "the model trained from node-local copies differs"
slurm_log "train from node-local staged copies (one file a node): one host's model, bit for bit"

pp=(--train.pipeline_stages=2 --train.micro_batches=2)
train_as pp-ref here_n 4 -x LOCUS_TEST_RANKS_PER_NODE=2 "${train[@]}" "${pp[@]}"
train_as pp across -n 4 "${train[@]}" "${pp[@]}"
locus_same_tensors model-pp.h5 model-pp-ref.h5 || slurm_fail "the pp=2 model across the nodes differs from one host's"
train_as pp-cyclic across -n 4 --map-by node "${train[@]}" "${pp[@]}"
grep -q '^ *node 0: rank 0 = replica 0 stage 0, rank 2 = replica 0 stage 1' train-pp-cyclic.log ||
  slurm_fail "a replica's stages not kept inside node 0: $(grep -A2 layout train-pp-cyclic.log)"
locus_same_tensors model-pp-cyclic.h5 model-pp-ref.h5 || slurm_fail "the pp=2 model with ranks dealt in turn differs"
slurm_log "train pp=2 x dp=2: stages inside a node, replicas across, the same bits as the layout declared on one host"

# 6. Inference.
infer=("$bin/locus-infer" --config "$LOCUS_REPO/configs/tiny.ini" --infer.model=model-ref.h5
  --infer.input=tiny-test.h5 --infer.top_k=2 --infer.unit_rows=64)
across -n 4 "${infer[@]}" --infer.output=scores.h5 >infer.log 2>&1 || slurm_fail "infer across the nodes failed: $(cat infer.log)"
here_n 2 "${infer[@]}" --infer.output=scores-1host.h5 >infer-1host.log 2>&1 ||
  slurm_fail "infer on one host failed: $(cat infer-1host.log)"
across -n 4 --map-by node "${infer[@]}" --infer.output=scores-cyclic.h5 >infer-cyclic.log 2>&1 ||
  slurm_fail "infer with ranks dealt in turn failed: $(cat infer-cyclic.log)"
for d in /scores /predicted /topk_classes /topk_scores; do
  for f in scores.h5 scores-cyclic.h5; do
    h5diff "$f" scores-1host.h5 "$d" "$d" >/dev/null || slurm_fail "predictions across the nodes ($f) differ in $d"
  done
done
slurm_log "infer: 4 ranks on 2 nodes wrote the predictions of 2 ranks on one host, byte for byte"

# 7. Preempted across the nodes: SIGTERM to one rank on node2 mid-run (each step delayed 20 ms
# by a test hook so that it is mid-run); every rank checkpoints at one step (written
# collectively across the link) and the job exits 75. Resumed on one host (4 ranks, flat), it
# ends with the uninterrupted model, bit for bit.
node_trainers() {   # K: the locus-train processes in node K's namespace
  local p
  for p in $(ip netns pids "locus-$(sed -n 's/^id=//p' "$work/nodes/nodes.env")-n$1"); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = locus-train ] && echo "$p"
  done
  return 0
}
across -n 4 -x LOCUS_TEST_HOOK=ckpt-step-boundary:delay20 "${train[@]}" --checkpoint.dir=ck \
  --train.log_every=1 --train.metrics=pre.jsonl --train.output=model-pre.h5 >train-pre.log 2>&1 &
pre=$!
steps_logged() { [ -f pre.jsonl ] && [ "$(grep -c '"type": *"step"' pre.jsonl)" -ge "$1" ]; }
slurm_wait_until 60 "50 steps of the run to preempt" steps_logged 50 ||
  slurm_fail "the run to preempt did not get to step 50: $(tail -n 20 train-pre.log)"
victim=$(node_trainers 2 | tail -n 1)
[ -n "$victim" ] || slurm_fail "no locus-train rank found on node2"
kill -TERM "$victim"
rc=0
wait "$pre" || rc=$?
[ "$rc" = 75 ] || slurm_fail "the preempted run exited $rc, not 75: $(tail -n 20 train-pre.log)"
grep -q 'SIGTERM received: checkpointing step' train-pre.log ||
  slurm_fail "no checkpoint on SIGTERM: $(tail -n 20 train-pre.log)"
[ ! -e model-pre.h5 ] || slurm_fail "the preempted run wrote its final model"
train_as resumed here_n 4 "${train[@]}" --train.reduction=flat --checkpoint.dir=ck --resume=auto
grep -q '^resumed from ck/ckpt-' train-resumed.log ||
  slurm_fail "the run on one host did not resume: $(head -n 20 train-resumed.log)"
locus_same_tensors model-resumed.h5 model-ref.h5 ||
  slurm_fail "preempted across the nodes and resumed on one host, the model differs from the uninterrupted one"
slurm_log "preempted across the nodes ($(grep -o 'resumed from ck/ckpt-[0-9]*.h5: step [0-9]*' train-resumed.log)), resumed on one host: the uninterrupted model, bit for bit"

# 8. A link that drops for 3 s mid-training and comes back: TCP retransmits, the run goes on
# by itself (the watchdog, at 60 s, stays quiet) and ends with one host's model, bit for bit.
# Each step is delayed 20 ms (a test hook) so that the run, about 10 s, outlasts the outage.
across -n 4 -x LOCUS_TEST_HOOK=train-step:delay20 "${train[@]}" --train.epochs=8 \
  --train.watchdog_s=60 --train.output=model-flap.h5 >train-flap.log 2>&1 &
flap=$!
slurm_wait_until 60 "the training across the nodes to pass its first epoch" grep -q '^epoch *2/' train-flap.log ||
  slurm_fail "training did not get going: $(tail -n 20 train-flap.log)"
bash "$nodes_sh" link "$work/nodes" 2 down
sleep 3
bash "$nodes_sh" link "$work/nodes" 2 up
kill -0 "$flap" 2>/dev/null || slurm_fail "the run ended before the link came back: $(tail -n 5 train-flap.log)"
rc=0
wait "$flap" || rc=$?
[ "$rc" = 0 ] || slurm_fail "the run whose link dropped for 3 s exited $rc: $(tail -n 20 train-flap.log)"
! grep -q 'watchdog:' train-flap.log || slurm_fail "the watchdog fired over a 3 s outage: $(grep watchdog: train-flap.log)"
train_as flap-ref here_n 4 "${train[@]}" --train.epochs=8 --train.reduction=flat
locus_same_tensors model-flap.h5 model-flap-ref.h5 || slurm_fail "the model of the run whose link dropped differs"
slurm_log "a 3 s link outage mid-training: the run went on and ended with one host's model, bit for bit"

# 9. A node cut off the network mid-training: MPI over TCP neither errors nor returns (the
# connection just stops), so the watchdog must end it. node1's ranks report the stuck
# operation within watchdog_s and are gone. mpirun itself returns only
# when TCP gives up on node2's daemon (about 15 minutes, tcp_retries2): the test kills it.
across -n 4 "${train[@]}" --train.epochs=100000 --train.watchdog_s=5 --train.output=model-cut.h5 \
  >train-cut.log 2>&1 &
slurm_wait_until 60 "the training across the nodes to pass its first epoch" grep -q '^epoch *2/' train-cut.log ||
  slurm_fail "training did not get going: $(tail -n 20 train-cut.log)"
bash "$nodes_sh" link "$work/nodes" 2 down
cut=$SECONDS
slurm_wait_until 30 "a watchdog line from node1's ranks" \
  grep -q '^\[rank [01]/4 node1\] watchdog: no progress for 5 s in ' train-cut.log ||
  slurm_fail "no watchdog line from node1 after node2 was cut off: $(tail -n 20 train-cut.log)"
fired=$((SECONDS - cut))
no_node1_trainers() { [ -z "$(node_trainers 1)" ]; }
slurm_wait_until 20 "node1's ranks to end" no_node1_trainers ||
  slurm_fail "node1's ranks still run after the watchdog: $(node_trainers 1)"
pkill -KILL -f -- "--hostfile $work/nodes/hosts" || true
slurm_log "node2 cut off: node1's watchdog fired after ${fired} s ($(grep -o 'watchdog: no progress for 5 s in [a-z0-9 -]*' train-cut.log | head -n 1)), its ranks ended"
echo "PASS: ingest, train (flat, hierarchical, ranks in turn, shaped link, staged, pp=2) and infer across 2 emulated nodes match one host bit for bit; preempted across them, resumed on one host bitwise; a 3 s link outage changes nothing; a node cut off ends the job by the watchdog"
