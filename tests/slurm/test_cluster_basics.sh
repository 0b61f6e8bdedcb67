#!/usr/bin/env bash
# The throw-away cluster itself: MPI jobs under mpirun and srun, exit codes, a job array, a
# dependency that can never be met, and a stop that leaves no process behind.
#   test_cluster_basics.sh PATH_TO_slurm_mpi_hello
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"

hello=$(readlink -f "${1:?usage: $0 PATH_TO_slurm_mpi_hello}")
[ -x "$hello" ] || slurm_fail "$hello is not an executable: build the target slurm_mpi_hello"

slurm_cluster_setup
cd "$LSC_WORK"

# The node and partitions the later tests rely on.
[ "$(sinfo -h -N -o '%c %T' | sort -u)" = "4 idle" ] || slurm_fail "node is not '4 idle': $(sinfo -N)"
[ "$(sinfo -h -o %P | tr '\n' ' ')" = "debug* low high " ] || slurm_fail "partitions: $(sinfo -h -o %P)"

# One job, two launches of a 2-rank MPI program: mpirun (as an app's launcher would) and srun
# (PMIx direct launch, MpiDefault=pmix). Each must be one 2-rank world inside this job.
cat >mpi.sh <<EOF
#!/bin/bash
#SBATCH --ntasks=2
echo "mpirun:"
mpirun -n 2 "$hello"
echo "srun:"
srun -n 2 "$hello"
EOF
mpi_job=$(slurm_submit -o "$LSC_WORK/mpi.%j.out" mpi.sh)

# A failing job, and a job that can never start because it depends on that one succeeding.
fail_job=$(slurm_submit -o /dev/null --wrap 'exit 3')
dep_job=$(slurm_submit -o /dev/null --dependency=afterok:"$fail_job" --wrap 'true')

# A job array: each task writes its own file.
array_job=$(slurm_submit -o /dev/null --array=0-2 \
  --wrap 'echo "task $SLURM_ARRAY_TASK_ID of $SLURM_ARRAY_JOB_ID" > array.$SLURM_ARRAY_TASK_ID')

slurm_wait_state "$mpi_job" COMPLETED 60 || slurm_fail "MPI job $mpi_job did not complete"
[ "$(slurm_job_field "$mpi_job" ExitCode)" = 0:0 ] || slurm_fail "MPI job exit code"
out=$LSC_WORK/mpi.$mpi_job.out
for launcher in mpirun srun; do
  ranks=$(sed -n "/^$launcher:/,/^[a-z]*:$/p" "$out" | grep -c "of 2 sum 1 job $mpi_job$" || true)
  [ "$ranks" = 2 ] || slurm_fail "$launcher: expected 2 ranks of one 2-rank world in job $mpi_job; output:
$(cat "$out")"
done
for r in 0 1; do
  [ "$(grep -c "^rank $r of 2 sum 1 job $mpi_job$" "$out")" = 2 ] || slurm_fail "rank $r missing in $out"
done

slurm_wait_state "$fail_job" FAILED 60 || slurm_fail "job $fail_job (exit 3) did not fail"
[ "$(slurm_job_field "$fail_job" ExitCode)" = 3:0 ] ||
  slurm_fail "job $fail_job: ExitCode $(slurm_job_field "$fail_job" ExitCode), expected 3:0"
# kill_invalid_depend: cancelled at once instead of pending forever.
slurm_wait_state "$dep_job" CANCELLED 60 || slurm_fail "job $dep_job with an unmet dependency not cancelled"

for t in 0 1 2; do
  slurm_wait_state "${array_job}_$t" COMPLETED 60 || slurm_fail "array task ${array_job}_$t"
  [ "$(cat "array.$t")" = "task $t of $array_job" ] || slurm_fail "array.$t holds '$(cat "array.$t")'"
done
[ "$(ls array.* | wc -l)" = 3 ] || slurm_fail "expected 3 array files: $(ls array.*)"

bash "$SLURM_CLUSTER_SH" stop "$LSC_DIR"
slurm_assert_no_processes "$LSC_DIR"
echo "PASS: cluster basics"
