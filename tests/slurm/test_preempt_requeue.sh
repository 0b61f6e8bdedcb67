#!/usr/bin/env bash
# The preemption lifecycle a trainer relies on, with a bash payload standing in for it: on USR1
# the payload checkpoints a step counter and exits 75; the batch script requeues the job; the
# next run resumes from the counter. Triggered once by signal injection (scancel --signal) and
# once by real preemption (a job in partition high needing every CPU).
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"

readonly total_steps=50 # 0.2 s each
readonly exit_checkpointed=75

slurm_cluster_setup
cd "$LSC_WORK"

# The stand-in trainer: one step per 0.2 s, the counter checkpointed atomically on USR1.
cat >payload.sh <<'EOF'
#!/bin/bash
ckpt=$1 total=$2
step=0
[ -f "$ckpt" ] && step=$(cat "$ckpt")
echo "payload: resume from step $step"
trap 'echo "$step" >"$ckpt.tmp" && mv "$ckpt.tmp" "$ckpt"; echo "payload: USR1, checkpoint at step $step"; exit 75' USR1
while [ "$step" -lt "$total" ]; do
  step=$((step + 1))
  echo "step $step"
  sleep 0.2 & wait $!
done
echo "$step" >"$ckpt"
echo "payload: done at step $step"
EOF

# The batch script as an app's would be: payload in the background so the shell can take USR1
# (B: = batch shell only) and forward it; a checkpointed exit means "requeue me".
cat >job.sh <<EOF
#!/bin/bash
#SBATCH --partition=low
#SBATCH --ntasks=1
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --time=10:00
#SBATCH --signal=B:USR1@60
echo "batch: start, restart \${SLURM_RESTART_COUNT:-0}"
bash "$LSC_WORK/payload.sh" "$LSC_WORK/ckpt" $total_steps &
pid=\$!
trap 'echo "batch: USR1"; kill -USR1 \$pid' USR1
# A trapped signal interrupts wait: wait again until the payload is really gone.
while kill -0 \$pid 2>/dev/null; do wait \$pid || true; done
wait \$pid; rc=\$?
echo "batch: payload exit \$rc"
if [ \$rc -eq $exit_checkpointed ]; then
  scontrol requeue "\$SLURM_JOB_ID"
  exit 0
fi
exit \$rc
EOF

log=$LSC_WORK/job.log
job=$(slurm_submit -o "$log" job.sh)

# Lines "step N" in the log, the last N so far (0 if none).
last_step() {
  local n
  n=$({ grep -o '^step [0-9]*' "$log" 2>/dev/null || true; } | tail -n 1 | cut -d' ' -f2)
  echo "${n:-0}"
}
past_step() { [ "$(last_step)" -ge "$1" ]; }
restarts_at_least() { [ "$(slurm_job_field "$job" Restarts)" -ge "$1" ]; }

# 1. Signal injection.
slurm_wait_until 60 "job $job to reach step 5" past_step 5 || slurm_fail "job $job made no progress"
slurm_log "signalling job $job at step $(last_step)"
scancel --batch --signal=USR1 "$job"
slurm_wait_until 60 "job $job to be requeued" restarts_at_least 1 || slurm_fail "no requeue after USR1"
slurm_wait_state "$job" RUNNING 60 || slurm_fail "job $job did not run again after the requeue"
first_ckpt=$(cat ckpt)
slurm_wait_until 60 "job $job to pass step $((first_ckpt + 5))" past_step $((first_ckpt + 5)) ||
  slurm_fail "job $job made no progress after its first restart"

# 2. Real preemption: a high-priority job needing all 4 CPUs.
slurm_log "submitting the preemptor at step $(last_step)"
high=$(slurm_submit -p high --ntasks=4 -o "$LSC_WORK/high.log" --wrap 'echo "high ran on $SLURM_NTASKS tasks"')
slurm_wait_state "$high" COMPLETED 90 || slurm_fail "preemptor $high did not complete"
slurm_wait_state "$job" COMPLETED 90 || slurm_fail "job $job did not complete after preemption"

# The job completed, after two requeues, with every run in one log.
[ "$(slurm_job_field "$job" ExitCode)" = 0:0 ] || slurm_fail "job $job ExitCode $(slurm_job_field "$job" ExitCode)"
restarts=$(slurm_job_field "$job" Restarts)
[ "$restarts" -ge 2 ] || slurm_fail "job $job Restarts=$restarts, expected >= 2"
[ "$(grep -c '^batch: start' "$log")" = $((restarts + 1)) ] ||
  slurm_fail "append mode: expected $((restarts + 1)) runs in $log"
[ "$(grep '^batch: start' "$log" | sed 's/.*restart //' | tr '\n' ' ')" = "$(seq -s ' ' 0 "$restarts") " ] ||
  slurm_fail "runs in $log do not show SLURM_RESTART_COUNT 0..$restarts"
[ "$(grep -c '^payload: USR1, checkpoint' "$log")" -ge 2 ] || slurm_fail "expected >= 2 checkpoints in $log"
grep -q '^high ran on 4 tasks' high.log || slurm_fail "preemptor output: $(cat high.log)"

# The counter continued: steps 1..total each exactly once, in order, across all runs, and every
# restart resumed from the step its predecessor checkpointed.
[ "$(grep '^step ' "$log" | cut -d' ' -f2 | tr '\n' ' ')" = "$(seq -s ' ' 1 $total_steps) " ] ||
  slurm_fail "steps in $log are not 1..$total_steps exactly once each"
resumes=$(grep '^payload: resume from step' "$log" | awk '{print $NF}' | tr '\n' ' ')
ckpts=$(grep '^payload: USR1, checkpoint at step' "$log" | awk '{print $NF}' | tr '\n' ' ')
[ "$resumes" = "0 $ckpts" ] || slurm_fail "resumed from steps '$resumes', checkpoints were '$ckpts'"
[ "$(cat ckpt)" = $total_steps ] || slurm_fail "final counter $(cat ckpt), expected $total_steps"

slurm_log "job $job completed after $restarts requeues, checkpoints at steps: $ckpts"
echo "PASS: preemption and requeue"
