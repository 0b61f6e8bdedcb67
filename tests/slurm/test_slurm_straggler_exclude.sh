#!/usr/bin/env bash
# The straggler mitigation end to end: slurm/train.sbatch runs the real locus-train on 2 ranks
# with rank 1 slowed by a test hook (LOCUS_TEST_HOOK=train-step:delay30@1, passed on by sbatch)
# and the exclusion turned on (LOCUS_EXCLUDE_STRAGGLERS=1);
# the trainer reports rank 1 a straggler and writes <checkpoint.dir>/stragglers naming its Slurm
# node; a USR1 makes it checkpoint and exit 75, the script requeues the job and adds that node
# to the job's ExcNodeList. On this one-node cluster the requeued job then cannot start
# (excluded from its only node): the test checks the exclusion and cancels it.
#   test_slurm_straggler_exclude.sh APPS_DIR      (the directory holding locus-ingest, locus-train)
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

locus_trainer_setup "${1:?usage: $0 APPS_DIR}"
slurm_cluster_setup
cd "$LSC_WORK"

ingest=$(locus_submit_fm_test_ingest)
slurm_wait_state "$ingest" COMPLETED 120 || slurm_fail "the ingest job failed: $(cat ingest.log)"
job=$(LOCUS_EXCLUDE_STRAGGLERS=1 LOCUS_TEST_HOOK=train-step:delay30@1 slurm_submit -o train.log "$LOCUS_REPO/slurm/train.sbatch" \
  --data.train=fm-test.h5 --data.test= --train.epochs=50 --train.log_every=5 \
  --train.straggler_intervals=2 --checkpoint.dir=ck --train.metrics=metrics.jsonl --eval.every=0)

listed() { [ -r ck/stragglers ] && grep -q '^1 ' ck/stragglers; }
slurm_wait_until 120 "rank 1 in ck/stragglers" listed ||
  slurm_fail "no straggler found: $(tail -n 20 train.log; cat ck/stragglers 2>/dev/null)"
node=$(awk '/^1 / { print $3 }' ck/stragglers)
[ -n "$node" ] && [ "$node" != - ] || slurm_fail "the stragglers file names no Slurm node: $(cat ck/stragglers)"
grep -q "straggler: rank 1 on .*(node $node) is slow in compute" train.log ||
  slurm_fail "no straggler line in the job's log: $(tail -n 20 train.log)"

scancel --batch --signal=USR1 "$job"
excluded() { [ "$(slurm_job_field "$job" ExcNodeList)" = "$node" ]; }
slurm_wait_until 90 "job $job requeued with ExcNodeList=$node" excluded ||
  slurm_fail "job $job: ExcNodeList=$(slurm_job_field "$job" ExcNodeList), Restarts=$(slurm_job_field "$job" Restarts): $(tail -n 20 train.log)"
[ "$(slurm_job_field "$job" Restarts)" -ge 1 ] || slurm_fail "job $job was not requeued"
grep -q "job $job will not run on $node again" train.log || slurm_fail "train.sbatch did not log the exclusion: $(tail -n 10 train.log)"
# Excluded from the only node: it stays pending.
sleep 3
[ "$(slurm_job_field "$job" JobState)" = PENDING ] || slurm_fail "job $job is $(slurm_job_field "$job" JobState), expected PENDING"
scancel "$job"
slurm_log "ok: straggler rank 1 on node $node excluded from requeued job $job"
