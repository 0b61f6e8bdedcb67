#!/usr/bin/env bash
# A dead or stuck rank never hangs a Slurm job (docs/RELIABILITY.md, "Dead ranks and the
# watchdog"): slurm/train.sbatch runs the real locus-train on 2 ranks and a test hook
#   1. SIGKILLs rank 1 just before the first gradient all-reduce, while rank 0 waits in it:
#      the job must end FAILED with a non-zero exit code within 60 s, and publish no model;
#   2. stalls rank 1 there for 600 s with train.watchdog_s = 3: the watchdog must end the job
#      FAILED with exit code 70 within 60 s, its log naming the rank and the operation.
# Neither is requeued (train.sbatch requeues only exit 75).
#   test_slurm_dead_rank.sh APPS_DIR      (the directory holding locus-ingest, locus-train)
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
train_args=(--data.train=fm-test.h5 --data.test= --train.epochs=2 --eval.every=0 --optim.warmup_steps=0)

# Submits a training job with LOCUS_TEST_HOOK=$2 (log $1.log, model $1.h5) and waits until it
# has ended; prints its final state and exit code. Fails the test beyond 60 s from its start.
run_job() {
  local name=$1 hook=$2 job start
  shift 2
  job=$(LOCUS_TEST_HOOK=$hook slurm_submit -o "$name.log" "$LOCUS_REPO/slurm/train.sbatch" \
    "${train_args[@]}" "--train.output=$name.h5" "--train.metrics=" "$@")
  slurm_wait_state "$job" RUNNING 120 >&2 || slurm_fail "job $job ($name) did not start: $(cat "$name.log" 2>/dev/null)"
  start=$SECONDS
  ended() { case " $SLURM_FINAL_STATES " in *" $(slurm_job_field "$job" JobState) "*) return 0 ;; esac; return 1; }
  slurm_wait_until 60 "job $job ($name) ended" ended >&2 ||
    slurm_fail "job $job ($name) still $(slurm_job_field "$job" JobState) 60 s after it started: a dead or stuck rank hangs it; log: $(tail -n 20 "$name.log")"
  slurm_log "job $job ($name) ended $(slurm_job_field "$job" JobState), exit $(slurm_job_field "$job" ExitCode), $((SECONDS - start)) s after it started" >&2
  echo "$(slurm_job_field "$job" JobState) $(slurm_job_field "$job" ExitCode)"
}

out=$(run_job killed "train-before-allreduce:kill@1") || exit 1
read -r state code <<< "$out"
[ "$state" = FAILED ] || slurm_fail "killed rank: job ended $state (exit $code), expected FAILED; log: $(tail -n 20 killed.log)"
[ "${code%%:*}" != 0 ] || slurm_fail "killed rank: exit code $code"
grep -q "test hook 'train-before-allreduce': kill" killed.log || slurm_fail "the hook did not fire: $(tail -n 20 killed.log)"
[ ! -e killed.h5 ] || slurm_fail "a model was published by the failed job"

out=$(run_job stuck "train-before-allreduce:sleep600@1" --train.watchdog_s=3) || exit 1
read -r state code <<< "$out"
[ "$state" = FAILED ] || slurm_fail "stuck rank: job ended $state (exit $code), expected FAILED; log: $(tail -n 20 stuck.log)"
[ "${code%%:*}" = 70 ] || slurm_fail "stuck rank: exit code $code, expected 70 (the watchdog's MPI_Abort); log: $(tail -n 20 stuck.log)"
grep -q "watchdog: no progress for .* in gradient all-reduce of step 1" stuck.log ||
  slurm_fail "no watchdog line naming the all-reduce: $(tail -n 20 stuck.log)"
[ ! -e stuck.h5 ] || slurm_fail "a model was published by the failed job"
slurm_log "ok: a killed rank and a stuck rank each ended their Slurm job (FAILED) within 60 s"
