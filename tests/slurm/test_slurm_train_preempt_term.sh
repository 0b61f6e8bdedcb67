#!/usr/bin/env bash
# Preemption by SIGTERM under the default launcher (mpirun): the checkpoint at preemption must
# be written and be the one the rerun resumes from (no work lost), on a cluster
#   A. without preempt_send_user_signal (Slurm's default): preemption sends SIGTERM to every
#      process of the job at once -- batch shell, mpirun and ranks;
#   B. with it, but a training with --checkpoint.signals=TERM: the USR1 at preemption is
#      ignored and the SIGTERM at the end of GraceTime must checkpoint.
# Open MPI 4.1's mpirun SIGKILLs its ranks 2 s after a SIGTERM (1 s per stage), and at once on
# a second one: slurm/locus-job.sh runs it with SIGTERM blocked and hands SIGTERM to the ranks.
# First the same outside Slurm: train.sbatch run by bash, SIGTERM to its process group.
# Each job is preempted mid-training by a 4-CPU job in partition high; Slurm requeues it
# (PreemptMode=REQUEUE); the test checks the trainer's checkpoint step against the step it
# stopped at and the rerun's resume step, the explanation printed before Open MPI's "aborted"
# banner, and then cancels the rerun (slurm_train_preempt covers resumed training bit for bit).
#   test_slurm_train_preempt_term.sh APPS_DIR
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

locus_trainer_setup "${1:?usage: $0 APPS_DIR}"
# 79 steps an epoch; far more epochs than the test lets it train: the job must still be training
# when Slurm preempts it (a scheduler pass or two after the preemptor is submitted).
# No periodic and no epoch-end checkpoints: the one a rerun can resume from is the signal's, so
# a lost one shows as a rerun from scratch, and the signal is not taken during another save.
train_args=(--data.train=fm-test.h5 --data.test=fm-test.h5 "--model.widths=784,256,128,10"
  --train.epochs=400 --train.log_every=1 --eval.every=0 --checkpoint.every_seconds=0
  --checkpoint.at_epoch_end=false)
readonly interrupt_at=100

metric_lines() {
  local n
  n=$(grep -c '^{"type":"step",' "metrics-$1.jsonl" 2>/dev/null || true)
  echo "${n:-0}"
}
# 0. Outside Slurm: slurm/train.sbatch run by bash, SIGTERM to its whole process group (as a
# scheduler without Slurm's step tracking signals a job): mpirun too gets it, blocked.
outside=$(mktemp -d /tmp/locus-term.XXXX)
(
  cd "$outside"
  # shellcheck disable=SC2086 # word splitting is meant
  OPENBLAS_NUM_THREADS=1 mpirun --oversubscribe -n 2 $LOCUS_MPIRUN_ARGS "$LOCUS_BIN/locus-ingest" \
    --ingest.output=fm-test.h5 "--ingest.images=$LOCUS_FM_DATA/t10k-images-idx3-ubyte.gz" \
    "--ingest.labels=$LOCUS_FM_DATA/t10k-labels-idx1-ubyte.gz" >ingest.log 2>&1 ||
    slurm_fail "ingest outside Slurm failed: $(cat ingest.log)"
  SLURM_NTASKS=2 setsid bash "$LOCUS_REPO/slurm/train.sbatch" "${train_args[@]}" \
    --train.metrics=metrics-o.jsonl --checkpoint.dir=ckpt-o >o.log 2>&1 &
  job=$!
  trap 'kill -KILL -- "-$job" 2>/dev/null || true' EXIT  # whatever fails below
  past() { [ "$(metric_lines o)" -ge "$interrupt_at" ]; }
  slurm_wait_until 120 "the training outside Slurm to pass step $interrupt_at" past ||
    slurm_fail "no progress outside Slurm: $(cat o.log)"
  kill -TERM -- "-$job"
  rc=0
  wait "$job" || rc=$?
  [ "$rc" = 75 ] || slurm_fail "outside Slurm: exit $rc after SIGTERM, not 75: $(cat o.log)"
  stop=$(sed -n 's/^stopped by SIGTERM after step \([0-9]*\): exit 75.*/\1/p' o.log)
  [ -n "$stop" ] && grep -q "^checkpoint step $stop (signal): ckpt-o/" o.log &&
    [ "$(sed -n 's/^latest //p' ckpt-o/latest)" = "ckpt-$(printf %08d "$stop").h5" ] ||
    slurm_fail "outside Slurm: no checkpoint of the step reached: $(cat o.log)"
  slurm_log "outside Slurm: SIGTERM checkpoint at step $stop (step $((stop % 79)) of its epoch)"
) || { rm -rf "$outside"; exit 1; }
rm -rf "$outside"

slurm_cluster_setup
cd "$LSC_WORK"
ingest=$(locus_submit_fm_test_ingest)
slurm_wait_state "$ingest" COMPLETED 120 || slurm_fail "the ingest job failed: $(cat ingest.log)"

running_past() { # running_past JOB NAME LINES
  case " $SLURM_FINAL_STATES " in
    *" $(slurm_job_field "$1" JobState) "*) slurm_fail "job $1 ended $(slurm_job_field "$1" JobState) before it was preempted: $(cat "$2.log")" ;;
  esac
  [ "$(metric_lines "$2")" -ge "$3" ]
}
requeued() {
  case " $SLURM_FINAL_STATES " in
    *" $(slurm_job_field "$1" JobState) "*) slurm_fail "job $1 ended $(slurm_job_field "$1" JobState) (ExitCode $(slurm_job_field "$1" ExitCode)) instead of being requeued" ;;
  esac
  [ "$(slurm_job_field "$1" Restarts)" -ge 1 ]
}

# preempt_and_check NAME EXTRA_TRAIN_ARGS...: one job in low, preempted; checks its log.
preempt_and_check() {
  local name=$1 job high stop resumed log=$1.log
  shift
  job=$(slurm_submit -p low -o "$log" "$LOCUS_REPO/slurm/train.sbatch" "${train_args[@]}" "$@" \
    "--train.output=model-$name.h5" "--train.metrics=metrics-$name.jsonl" "--checkpoint.dir=ckpt-$name")
  slurm_wait_until 120 "job $job to pass step $interrupt_at" running_past "$job" "$name" $interrupt_at ||
    slurm_fail "job $job made no progress: $(tail -n 5 "$log")"
  slurm_log "$name: preempting job $job at metrics line $(metric_lines "$name")"
  high=$(slurm_submit -p high --ntasks=4 -o "high-$name.log" --wrap 'echo "high ran"')
  slurm_wait_until 90 "job $job to be requeued" requeued "$job" || slurm_fail "job $job: not requeued: $(cat "$log")"
  slurm_wait_state "$high" COMPLETED 60 || slurm_fail "preemptor $high did not complete"
  slurm_wait_until 90 "job $job's rerun to resume" grep -q '^resumed from' "$log" ||
    slurm_fail "job $job: the rerun did not resume: $(cat "$log")"
  scancel "$job"
  # The trainer heard SIGTERM, checkpointed the step it had reached and stopped there.
  stop=$(sed -n 's/^SIGTERM received: checkpointing step \([0-9]*\) and stopping.*/\1/p' "$log" | head -n 1)
  [ -n "$stop" ] || slurm_fail "$log: the trainer took no SIGTERM checkpoint: $(cat "$log")"
  [ "$stop" -gt "$interrupt_at" ] || slurm_fail "$log: stopped at step $stop, before the preemption"
  grep -q "^checkpoint step $stop (signal): ckpt-$name/" "$log" || slurm_fail "$log: no checkpoint of step $stop written"
  grep -q "^stopped by SIGTERM after step $stop: exit 75" "$log" || slurm_fail "$log: no exit 75 after step $stop"
  # The explanation comes right before Open MPI's banner, and the script's line after it. The
  # batch shell's own lines ([locus-slurm ...]) may land anywhere in between: another writer.
  grep -v '^\[locus-slurm ' "$log" | grep -A1 "^stopped by SIGTERM after step $stop" |
    grep -q '^note: exit 75 is expected here' ||
    slurm_fail "$log: no note that exit 75 is expected right after the stop line: $(cat "$log")"
  grep -q 'locus-train exited with code 75 (checkpointed; ' "$log" ||
    slurm_fail "$log: the script did not report exit 75: $(cat "$log")"
  grep -q "SIGTERM: passing it to the ranks on this node" "$log" || slurm_fail "$log: the shell did not pass SIGTERM to the ranks"
  # No work lost: the rerun resumed from that very checkpoint.
  resumed=$(sed -n 's/^resumed from \(.*\): step \([0-9]*\) of .*/\1 \2/p' "$log" | head -n 1)
  [ "$resumed" = "ckpt-$name/ckpt-$(printf %08d "$stop").h5 $stop" ] ||
    slurm_fail "$log: the rerun resumed from '$resumed', not from the checkpoint of step $stop"
  slurm_log "$name: SIGTERM checkpoint at step $stop (step $((stop % 79)) of its epoch), resumed there"
}

# A. Slurm's default: no user signal at preemption, SIGTERM to every process of the job.
sed -i 's/^SlurmctldParameters=.*/# &/' "$SLURM_CONF"
scontrol reconfigure
[[ "$(scontrol show config | grep -i '^SlurmctldParameters')" =~ =\ *\(null\)$ ]] ||
  slurm_fail "preempt_send_user_signal still configured"
preempt_and_check a
grep -q "SIGUSR1" a.log && slurm_fail "a.log: a USR1 reached job a, whose cluster sends none: $(cat a.log)"

# B. preempt_send_user_signal, but the training listens to TERM only: the USR1 is ignored and
# the SIGTERM at the end of the grace time checkpoints.
sed -i 's/^# \(SlurmctldParameters=.*\)/\1/' "$SLURM_CONF"
scontrol reconfigure
preempt_and_check b --checkpoint.signals=TERM
grep -q "SIGUSR1: forwarding it to mpirun" b.log || slurm_fail "b.log: no USR1 at preemption: $(cat b.log)"
echo "PASS: SIGTERM at preemption checkpoints under mpirun, with and without preempt_send_user_signal"
