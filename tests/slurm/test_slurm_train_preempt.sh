#!/usr/bin/env bash
# The real locus-train, launched by slurm/train.sbatch, interrupted mid-training and resumed:
# job M (mpirun, partition low) by a real preemption (a job in high needing M's CPUs, with
# PreemptMode=REQUEUE, GraceTime and preempt_send_user_signal), job S (srun --mpi=pmix,
# partition debug) by signal injection (scancel --batch --signal=USR1). Each time the batch
# shell must forward USR1 to every rank, the trainer must checkpoint at a step boundary and exit
# 75, the script must requeue the job, and the rerun must pass --resume=auto (the first run must
# not) and continue from that checkpoint. Both jobs must end COMPLETED with the model of an
# uninterrupted run of the same config (plain mpirun, 2 ranks, outside Slurm) bit for bit, and a
# job with --dependency=afterok on M must start only after M's final run. The data is
# Fashion-MNIST's test set, ingested through slurm/ingest.sbatch.
#   test_slurm_train_preempt.sh APPS_DIR      (the directory holding locus-ingest, locus-train)
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

locus_trainer_setup "${1:?usage: $0 APPS_DIR}"
# 79 steps an epoch. Interrupt past the first epoch-end checkpoint, so that the rerun must pick
# the newest checkpoint (the one the signal caused, mostly mid-epoch), not an older one. Both interruptions land
# within a second or so (Slurm selects the job to preempt when the preemptor is submitted),
# a few hundred steps later on an idle machine: enough epochs that this is well before the end.
readonly epochs=16 steps=$((16 * 79)) interrupt_at=100
# Dropout and momentum: their RNG and optimizer state must survive the checkpoint too. One
# evaluation, at the end: it does not change the model, and it takes time.
train_args=(--data.train=fm-test.h5 --data.test=fm-test.h5 "--model.widths=784,512,256,10"
  --model.dropout=0.1 --optim.warmup_steps=10 "--train.epochs=$epochs" --train.log_every=1
  --eval.every=0)

slurm_cluster_setup
cd "$LSC_WORK"

ingest=$(locus_submit_fm_test_ingest)
submit_train() { # submit_train NAME SBATCH_ARGS...: a training job writing NAME's files
  local name=$1
  shift
  slurm_submit --dependency=afterok:"$ingest" -o "$name.log" "$@" "$LOCUS_REPO/slurm/train.sbatch" \
    "${train_args[@]}" "--train.output=model-$name.h5" "--train.metrics=metrics-$name.jsonl" \
    "--checkpoint.dir=ckpt-$name"
}
# Every step of both jobs waits 5 ms (in every run): the 1164 steps after step 100 then take
# at least 5.8 s however fast the machine, the window for the preemption and the signal.
m=$(LOCUS_TEST_HOOK=train-step:delay5 submit_train m -p low)
s=$(LOCUS_TEST_HOOK=train-step:delay5 LOCUS_LAUNCHER=srun submit_train s -p debug)
after=$(slurm_submit --dependency=afterok:"$m" -o after.log --wrap 'echo "after started"')

# Step lines (one a step) job NAME's first run has written so far.
metric_lines() {
  local n
  n=$(grep -c '^{"type":"step",' "metrics-$1.jsonl" 2>/dev/null || true)
  echo "${n:-0}"
}
# Both jobs are past metrics line $1; fails the test at once if either has ended.
both_past() {
  local j
  for j in "$m" "$s"; do
    case " $SLURM_FINAL_STATES " in
      *" $(slurm_job_field "$j" JobState) "*) slurm_fail "job $j ended $(slurm_job_field "$j" JobState) before it was interrupted" ;;
    esac
  done
  [ "$(metric_lines m)" -ge "$1" ] && [ "$(metric_lines s)" -ge "$1" ]
}
# Job $1 has been requeued; fails the test at once if it has ended instead.
requeued() {
  case " $SLURM_FINAL_STATES " in
    *" $(slurm_job_field "$1" JobState) "*) slurm_fail "job $1 ended $(slurm_job_field "$1" JobState) (ExitCode $(slurm_job_field "$1" ExitCode)) instead of being requeued" ;;
  esac
  [ "$(slurm_job_field "$1" Restarts)" -ge 1 ]
}

slurm_wait_state "$ingest" COMPLETED 120 || slurm_fail "the ingest job failed: $(cat ingest.log)"
slurm_wait_until 120 "both trainings to pass step $interrupt_at" both_past $interrupt_at ||
  slurm_fail "the trainings made no progress: $(tail -n 5 m.log s.log)"

# 1. Real preemption of M: a job in high needing 2 CPUs while M and S hold all 4. S's partition
# (debug) is never preempted, so M must give way.
slurm_log "submitting the preemptor at metrics line $(metric_lines m) of job $m"
high=$(slurm_submit -p high --ntasks=2 -o high.log --wrap 'echo "high ran on $SLURM_NTASKS tasks"')
# Slurm signals M's batch shell when it selects M (preempt_send_user_signal).
slurm_wait_until 60 "job $m to be signalled" grep -q "SIGUSR1: forwarding" m.log ||
  slurm_fail "job $m: its batch shell got no USR1 on preemption: $(cat m.log)"

# 2. Signal injection into S's batch shell only: it must forward USR1 to srun's tasks.
slurm_log "injecting USR1 into job $s at metrics line $(metric_lines s)"
scancel --batch --signal=USR1 "$s"
for j in "$m" "$s"; do
  slurm_wait_until 90 "job $j to be requeued" requeued "$j" || slurm_fail "job $j: no requeue after USR1"
done
slurm_wait_state "$high" COMPLETED 60 || slurm_fail "preemptor $high did not complete"
[ "$(slurm_job_field "$after" JobState)" = PENDING ] || slurm_fail "afterok job $after left PENDING after a requeue"

# The uninterrupted reference, while the requeued jobs wait to start again.
locus_reference_start "${train_args[@]}"

for j in "$m" "$s" "$after"; do
  slurm_wait_state "$j" COMPLETED 180 || slurm_fail "job $j did not complete: $(cat "$([ "$j" = "$m" ] && echo m || echo s).log")"
  [ "$(slurm_job_field "$j" ExitCode)" = 0:0 ] || slurm_fail "job $j: ExitCode $(slurm_job_field "$j" ExitCode)"
done
locus_reference_wait
[[ "$(slurm_job_field "$after" StartTime)" > "$(slurm_job_field "$m" EndTime)" ]] ||
  [ "$(slurm_job_field "$after" StartTime)" = "$(slurm_job_field "$m" EndTime)" ] ||
  slurm_fail "afterok job started $(slurm_job_field "$after" StartTime), before job $m ended $(slurm_job_field "$m" EndTime)"
grep -q '^high ran on 2 tasks' high.log || slurm_fail "preemptor: $(cat high.log)"

for pair in "$m:m:mpirun -n 2 " "$s:s:srun --mpi=pmix -n 2 "; do
  IFS=: read -r job name launcher <<<"$pair"
  log=$name.log
  restarts=$(slurm_job_field "$job" Restarts)
  [ "$restarts" -ge 1 ] || slurm_fail "job $job: Restarts=$restarts, expected >= 1"
  # One log (--open-mode=append) with every run under the chosen launcher; --resume=auto on
  # every rerun, and nothing on the first run (no stale checkpoint can be picked up).
  runs=$(grep "restart [0-9]*, .* tasks: $launcher" "$log" || true)
  [ "$(echo "$runs" | sed 's/.*restart \([0-9]*\),.*/\1/' | tr '\n' ' ')" = "$(seq -s ' ' 0 "$restarts") " ] ||
    slurm_fail "$log: expected runs 0..$restarts under '$launcher': $(cat "$log")"
  [ "$(echo "$runs" | grep -c -- "locus-train --resume=auto ")" = "$restarts" ] &&
    echo "$runs" | grep "restart 0," | grep -qv -- --resume ||
    slurm_fail "$log: --resume=auto must be passed on every rerun and only there: $runs"
  grep -q "SIGUSR1: forwarding it to ${launcher%% *}" "$log" || slurm_fail "$log: the batch shell forwarded no USR1"
  # The first run checkpointed at a step boundary on the signal (or, when it came during an
  # epoch-end checkpoint, stopped after that one) and exited 75; the script requeued the job;
  # the rerun resumed from exactly that checkpoint.
  stop=$(sed -n -e 's/^SIGUSR1 received: checkpointing step \([0-9]*\) and stopping.*/\1/p' \
    -e 's/^SIGUSR1 received during the checkpoint of step \([0-9]*\): stopping.*/\1/p' "$log" | head -n 1)
  [ -n "$stop" ] || slurm_fail "$log: the trainer took no signal checkpoint: $(cat "$log")"
  [ "$stop" -gt 79 ] && [ "$stop" -lt "$steps" ] || slurm_fail "$log: interrupted at step $stop, not mid-run (1 epoch < step < $steps): raise epochs in $0"
  grep -q "^checkpoint step $stop (\(signal\|epoch\)): ckpt-$name/" "$log" || slurm_fail "$log: no checkpoint of step $stop written"
  grep -q "^stopped by SIGUSR1 after step $stop: exit 75" "$log" && grep -q "locus-train exited with code 75" "$log" &&
    grep -q "checkpointed: requeued job $job" "$log" || slurm_fail "$log: no exit 75 followed by a requeue"
  resumed=$(sed -n 's/^resumed from \(.*\): step \([0-9]*\) of \([0-9]*\) .*/\1 \2 \3/p' "$log" | head -n 1)
  [ "$resumed" = "ckpt-$name/ckpt-$(printf %08d "$stop").h5 $stop $steps" ] ||
    slurm_fail "$log: the rerun did not resume from the signal checkpoint of step $stop: '$resumed'"
  # The rerun trained exactly the steps that were left.
  grep -q "^trained $((steps - stop)) steps" "$log" || slurm_fail "$log: the rerun did not train the $((steps - stop)) steps left after step $stop: $(grep '^trained' "$log")"
  grep -q "^model written to model-$name.h5" "$log" || slurm_fail "$log: no model written"
  # The model of the interrupted training is the reference's, every tensor bit for bit.
  locus_same_tensors "model-$name.h5" model-ref.h5 ||
    slurm_fail "job $job: model-$name.h5 differs from the uninterrupted run's"
  slurm_log "job $job ($launcher): $restarts requeue(s), signal checkpoint at step $stop of $steps, model identical"
done
echo "PASS: locus-train checkpoints on preemption, is requeued, resumes and trains the uninterrupted model"
