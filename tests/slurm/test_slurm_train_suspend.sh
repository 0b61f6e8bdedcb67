#!/usr/bin/env bash
# Two real locus-train jobs, launched by slurm/train.sbatch, sharing the node and taking turns
# as gang time slicing (PreemptMode=SUSPEND,GANG) makes them: one is suspended (SIGSTOP to every
# process of the job) while the other runs, then they swap, again and again. The test suspends
# and resumes with scontrol at moments it chooses, so that it does not depend on how fast the
# machine trains (slurm_gang_timeslice shows that time slicing itself stops every mpirun rank).
# Both jobs must make no progress while suspended, be stopped at least three times each in the
# middle of training, complete every epoch, and write the model of an unsuspended run of the
# same config (plain mpirun, 2 ranks, outside Slurm) bit for bit: a suspension must neither fail
# the trainer (no timeout may take it for a failure) nor change what it computes. The data is
# Fashion-MNIST's test set, ingested through slurm/ingest.sbatch.
#   test_slurm_train_suspend.sh APPS_DIR      (the directory holding locus-ingest, locus-train)
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

locus_trainer_setup "${1:?usage: $0 APPS_DIR}"
# 79 steps an epoch. A slice lasts about 2 s however short hold_s is (a resume took 1.8 to 3 s
# after a recent suspension of the same job), so a job trains some 6 s before its third stop:
# up to ~1000 steps seen under load, an estimated ~1500 on an idle machine with the reference
# alongside. Enough epochs that both are still training then.
readonly epochs=40 steps=$((40 * 79)) hold_s=0.3 min_stops=3
# One evaluation, at the end: it does not change the model, and it takes time.
train_args=(--data.train=fm-test.h5 --data.test=fm-test.h5 "--model.widths=784,512,256,10"
  --optim.warmup_steps=10 "--train.epochs=$epochs" --train.log_every=1 --eval.every=0)

slurm_cluster_setup
cd "$LSC_WORK"

ingest=$(locus_submit_fm_test_ingest)
declare -A job
for name in a b; do
  job[$name]=$(slurm_submit --dependency=afterok:"$ingest" -o "train-$name.log" \
    "$LOCUS_REPO/slurm/train.sbatch" "${train_args[@]}" \
    "--train.output=model-$name.h5" "--train.metrics=metrics-$name.jsonl")
done
slurm_wait_state "$ingest" COMPLETED 120 || slurm_fail "the ingest job failed: $(cat ingest.log)"

# The unsuspended reference, alongside.
locus_reference_start "${train_args[@]}"

# Step lines job NAME has written (one every step).
metric_lines() {
  local n
  n=$(grep -c '^{"type":"step",' "metrics-$1.jsonl" 2>/dev/null || true)
  echo "${n:-0}"
}
# The header rank 0 prints once every rank has started and opened the data. Suspending earlier
# is not reliable: proctrack/linuxproc signals the processes that exist at that instant and can
# miss ranks that mpirun is starting.
started() { grep -q "^training " "train-$1.log" 2>/dev/null; }
both_started() { started a && started b; }

# The PIDs of job NAME's ranks (not mpirun: its command line names the binary too).
rank_pids() {
  local p
  for p in $(pgrep -f -- "$LOCUS_BIN/locus-train .*model-$1.h5" || true); do
    [ "$(readlink "/proc/$p/exe" 2>/dev/null)" = "$LOCUS_BIN/locus-train" ] && echo "$p"
  done
}
# Waits until both ranks of job NAME are in a state matching REGEX (/proc/PID/stat: T =
# stopped); returns 1 once no rank is left (the training ended).
wait_ranks() {
  local name=$1 deadline=$((SECONDS + 20)) pids p n st
  while [ $SECONDS -lt $deadline ]; do
    pids=$(rank_pids "$name")
    if [ -z "$pids" ]; then
      # No rank seen: the training ended, unless Slurm still holds the job (a scan can miss
      # processes that the resumption is just continuing): then look again.
      case $(slurm_job_field "${job[$name]}" JobState) in
        RUNNING | SUSPENDED) sleep 0.05 && continue ;;
        *) return 1 ;;
      esac
    fi
    n=0
    for p in $pids; do
      st=$(cut -d' ' -f3 "/proc/$p/stat" 2>/dev/null) && [[ "$st" =~ $2 ]] && n=$((n + 1))
    done
    [ $n = 2 ] && return 0
    sleep 0.05
  done
  slurm_fail "job ${job[$name]}: ranks not in state $2 within 20 s: $(for p in $(rank_pids "$name"); do cut -d' ' -f1-3 "/proc/$p/stat"; done)"
}
# slurmd stops and continues the processes a moment after scontrol returns (measured: a stop
# 0.2 to 0.9 s, a resume 1.8 to 3 s when the job's suspension was recent), so both wait for the
# ranks' own state, log how long that took and return 1 when the job has no ranks left (it
# finished). suspend_job records the job's metrics line count at the stop in stops[NAME].
declare -A stops=([a]="" [b]="")
suspend_job() {
  local t0=$EPOCHREALTIME
  scontrol suspend "${job[$1]}" 2>/dev/null && wait_ranks "$1" '^T$' || return 1
  stops[$1]+=" $(metric_lines "$1")"
  slurm_log "job ${job[$1]} stopped at line $(metric_lines "$1") after $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }') s"
}
resume_job() {
  local t0=$EPOCHREALTIME
  scontrol resume "${job[$1]}" || slurm_fail "cannot resume job ${job[$1]}"
  wait_ranks "$1" '^[RSD]$' || slurm_fail "job ${job[$1]} has no ranks after its resumption"
  slurm_log "job ${job[$1]} running again after $(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }') s"
}
# Stops of job NAME after its first step so far.
mid_stops() {
  local n
  # shellcheck disable=SC2086 # one line per recorded stop
  n=$(printf '%s\n' ${stops[$1]} | grep -c '^[1-9]' || true)
  echo "${n:-0}"
}
# Job `stopped` is held for hold_s: it must make no progress and be SUSPENDED.
hold() {
  local before
  before=$(metric_lines "$1")
  sleep "$hold_s"
  [ "$(metric_lines "$1")" = "$before" ] || slurm_fail "job ${job[$1]} made progress while stopped (at line $before)"
  [ "$(slurm_job_field "${job[$1]}" JobState)" = SUSPENDED ] ||
    slurm_fail "job ${job[$1]}: $(slurm_job_field "${job[$1]}" JobState) while suspended"
}

# Both jobs are suspended first, together, so that neither can run far ahead while the other's
# first suspension takes effect. Then time slices: the job `stopped` is held while the other
# one runs; then the running one is suspended and the held one resumed, as a gang scheduler
# switches at the end of a slice. It ends once both have been stopped min_stops times in the
# middle of training, or when one has finished (the checks below then say whether that was
# enough).
slurm_wait_until 120 "both jobs to start their ranks" both_started ||
  slurm_fail "the jobs did not start: $(cat train-a.log train-b.log)"
scontrol suspend "${job[a]}" && scontrol suspend "${job[b]}" || slurm_fail "cannot suspend the jobs"
for name in a b; do
  # The first stop; a job that ended meanwhile must not stay suspended.
  wait_ranks $name '^T$' || { scontrol resume "${job[a]}" "${job[b]}" 2>/dev/null || true; slurm_fail "job ${job[$name]} ended before its first stop: raise epochs in $0"; }
  stops[$name]=" $(metric_lines $name)"
done
slurm_log "both stopped, at lines${stops[a]} and${stops[b]}"
hold b
resume_job a
stopped=b running=a
while :; do
  hold $stopped
  if [ "$(mid_stops a)" -ge $min_stops ] && [ "$(mid_stops b)" -ge $min_stops ]; then break; fi
  # A job that has just finished may still be suspended as its batch shell ends: resume it.
  suspend_job $running || { scontrol resume "${job[$running]}" 2>/dev/null || true; break; }
  resume_job $stopped
  t=$stopped stopped=$running running=$t
done
resume_job $stopped

for name in a b; do
  j=${job[$name]} log=train-$name.log
  slurm_wait_state "$j" COMPLETED 180 || slurm_fail "training job $j did not complete: $(cat "$log")"
  [ "$(slurm_job_field "$j" ExitCode)" = 0:0 ] || slurm_fail "job $j: ExitCode $(slurm_job_field "$j" ExitCode)"
  [ "$(slurm_job_field "$j" Restarts)" = 0 ] || slurm_fail "job $j was requeued"
  [ "$(slurm_job_field "$j" SuspendTime)" != None ] || slurm_fail "job $j has no SuspendTime"
  # Every step once, in order: a suspension neither skipped nor repeated one.
  [ "$(grep -o '^{"type":"step","step":[0-9]*' "metrics-$name.jsonl" | cut -d: -f3 | tr '\n' ' ')" = "$(seq -s ' ' 1 $steps) " ] ||
    slurm_fail "metrics-$name.jsonl does not hold steps 1..$steps once each"
  [ "$(grep -c "^epoch .*/$epochs step" "$log")" = $epochs ] || slurm_fail "$log: not $epochs epochs: $(cat "$log")"
  grep -q "^trained $steps steps" "$log" || slurm_fail "$log: not $steps steps: $(cat "$log")"
  mid=0
  for n in ${stops[$name]}; do if [ "$n" -gt 0 ] && [ "$n" -lt $steps ]; then mid=$((mid + 1)); fi; done
  slurm_log "job $j: $(grep '^trained' "$log"); suspended at metrics lines${stops[$name]} of $steps"
  [ $mid -ge $min_stops ] || slurm_fail "job $j was stopped only $mid times while training: raise epochs in $0"
done
locus_reference_wait
# Both models are the unsuspended run's, every tensor bit for bit.
for name in a b; do
  locus_same_tensors "model-$name.h5" model-ref.h5 ||
    slurm_fail "job ${job[$name]}: model-$name.h5 differs from the unsuspended run's"
done
echo "PASS: two time-sliced locus-train jobs survive suspension and compute the unsuspended model"
