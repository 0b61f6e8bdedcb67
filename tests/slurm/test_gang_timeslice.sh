#!/usr/bin/env bash
# Gang scheduling: two jobs that each need every CPU share the node by time slices
# (PreemptMode=SUSPEND,GANG, OverSubscribe=FORCE:2, SchedulerTimeSlice=5). Each job runs a 2-rank
# mpirun whose ranks log wall-clock ticks; both jobs must be suspended at least once, each as a
# whole (both ranks pause together), overlap in time, and still finish every tick.
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"

readonly ticks=60         # 0.2 s each: ~12 s of work per job, so several 5 s slices
readonly min_gap_s=3      # a tick gap this long means the job was stopped (the slice is 5 s)

slurm_cluster_setup --gang
cd "$LSC_WORK"

cat >tick.sh <<'EOF'
#!/bin/bash
# tick.sh N OUT: N ticks of 0.2 s, each logged with its wall-clock time.
for i in $(seq "$1"); do
  echo "tick $i $EPOCHREALTIME"
  sleep 0.2
done >"$2"
echo done >>"$2"
EOF
cat >job.sh <<EOF
#!/bin/bash
#SBATCH --ntasks=4
mpirun -n 2 bash -c 'bash "$LSC_WORK/tick.sh" $ticks "$LSC_WORK/ticks.\$SLURM_JOB_ID.\$OMPI_COMM_WORLD_RANK"'
EOF

a=$(slurm_submit -o "$LSC_WORK/job.%j.out" job.sh)
b=$(slurm_submit -o "$LSC_WORK/job.%j.out" job.sh)
for j in "$a" "$b"; do
  slurm_wait_state "$j" COMPLETED 150 || slurm_fail "job $j did not complete"
done

# Gaps of at least min_gap_s between consecutive ticks of FILE, one a line: "+START_s:LENGTH_s"
# from the first tick; with LO and HI (wall-clock seconds), only the gaps whose middle is in
# [LO, HI]. A pause [S, R] holds no tick of either rank, so it lies wholly inside or outside
# [LO, HI] (both ticks); each rank's gap around it starts and ends within one tick (0.2 s) of
# S and R, so the middles of the two ranks' gaps fall on the same side. (Judged by their ends,
# a pause just before the end counted for one rank only: a rank resumed after the other's last
# tick; CI, 2026-11-28.)
gaps() {
  awk -v g=$min_gap_s -v lo="${2:-0}" -v hi="${3:-1e300}" '$1 != "tick" { next }
    t0 == "" { t0 = $3 }
    p != "" && $3 - p >= g && (p + $3) / 2 >= lo && (p + $3) / 2 <= hi {
      printf "+%.1f:%.1f\n", p - t0, $3 - p
    }
    { p = $3 }' "$1"
}
first() { grep '^tick' "$1" | head -n 1 | cut -d' ' -f3; }
last() { grep '^tick' "$1" | tail -n 1 | cut -d' ' -f3; }

for j in "$a" "$b"; do
  [ "$(slurm_job_field "$j" ExitCode)" = 0:0 ] || slurm_fail "job $j ExitCode $(slurm_job_field "$j" ExitCode)"
  # SuspendTime is the time of the last suspend or resume; None if neither ever happened.
  [ "$(slurm_job_field "$j" SuspendTime)" != None ] || slurm_fail "job $j was never suspended"
  for r in 0 1; do
    f=ticks.$j.$r
    [ -f "$f" ] || slurm_fail "rank $r of job $j wrote no $f"
    [ "$(grep '^tick' "$f" | cut -d' ' -f2 | tr '\n' ' ')" = "$(seq -s ' ' 1 $ticks) " ] &&
      [ "$(tail -n 1 "$f")" = "done" ] || slurm_fail "$f does not hold ticks 1..$ticks then done"
  done
  # The gang is the whole job: its two ranks pause the same number of times while both tick.
  # The ranks start and end a few ms apart, so a suspension in that window is a pause of one
  # rank only: count the pauses inside [the later first tick, the earlier last tick].
  lo=$(for r in 0 1; do first "ticks.$j.$r"; done | sort -g | tail -n 1)
  hi=$(for r in 0 1; do last "ticks.$j.$r"; done | sort -g | head -n 1)
  g0=$(gaps "ticks.$j.0" "$lo" "$hi" | wc -l)
  g1=$(gaps "ticks.$j.1" "$lo" "$hi" | wc -l)
  [ "$g0" -ge 1 ] || slurm_fail "job $j: no pause of ${min_gap_s}s or more while both ranks ticked; never suspended while running (rank 0: $(gaps "ticks.$j.0" | tr '\n' ' '))"
  [ "$g0" = "$g1" ] || slurm_fail "job $j: rank 0 paused $g0 times ($(gaps "ticks.$j.0" | tr '\n' ' ')), rank 1 $g1 times ($(gaps "ticks.$j.1" | tr '\n' ' '))"
  slurm_log "job $j: pauses (+start:length, s) $(gaps "ticks.$j.0" | tr '\n' ' ')"
done

# Time-sliced, not run one after the other: each job ticked before the other one finished.
awk -v a0="$(first "ticks.$a.0")" -v a1="$(last "ticks.$a.0")" -v b0="$(first "ticks.$b.0")" \
  -v b1="$(last "ticks.$b.0")" 'BEGIN { exit !(a0 < b1 && b0 < a1) }' ||
  slurm_fail "jobs $a and $b did not overlap in time: they ran one after the other"
echo "PASS: gang time slicing"
