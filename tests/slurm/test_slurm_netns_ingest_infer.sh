#!/usr/bin/env bash
# A node lost mid-job by the two apps whose batch scripts do not ask for --requeue: ingests
# (slurm/ingest.sbatch) and scoring jobs (slurm/infer.sbatch), 2 whole nodes x 2 tasks each on
# 8 nodes with a network of their own (slurm-cluster.sh --netns, as test_slurm_netns.sh):
#  - jobs I and IB ingest Fashion-MNIST's test set (every unit slowed by 1.5 s: about 12 s of
#    work);
#  - jobs S and SB score it with a model file (every rank sleeps 1.5 s before each unit: about
#    12 s).
# Once a job has its four ranks on two hosts (and, scoring, its temporary output; its first run
# is held after each rank's first unit until then), one of its nodes loses its network for good (its processes keep running, cut off): for I and S the node
# of ranks 2,3 -- the ingest's peers then wait in its collectives after parsing, the scorer's in
# its one-sided work queue --; for IB and SB the batch node, that of mpirun and ranks 0,1.
# slurmctld sets the nodes DOWN after SlurmdTimeout (10 s) and requeues the jobs (the cluster's
# JobRequeue=1, Slurm's default). Each rerun lands on nodes that are up and starts again from
# nothing (nothing was published: a full run publishes atomically). IB's and SB's reruns find
# their output's lock held by the stranded rank 0 (Slurm cannot reach its node to end it) and
# wait, saying so, until a stranded rank's watchdog (120 s here) ends it. Every rerun publishes
# exactly what an uninterrupted run does: the datasets bit for bit the one a plain 2-rank
# ingest writes, the prediction files bit for bit a plain 2-rank scoring's, no temporary file
# left. Then the links come back and the nodes return to service with no rank of any job left.
# Exits 77 (skipped) where network namespaces cannot be made (netns-nodes.sh check).
#   test_slurm_netns_ingest_infer.sh APPS_DIR
set -euo pipefail
# shellcheck source=scripts/slurm-lib.sh
. "$(dirname "$0")/../../scripts/slurm-lib.sh"
# shellcheck source=tests/slurm/locus-jobs-lib.sh
. "$(dirname "$0")/locus-jobs-lib.sh"

locus_trainer_setup "${1:?usage: $0 APPS_DIR}"
[ -x "$LOCUS_BIN/locus-infer" ] || slurm_fail "$LOCUS_BIN/locus-infer is not an executable: build locus-infer"
nodes_sh=$LOCUS_REPO/scripts/netns-nodes.sh
if ! bash "$nodes_sh" check; then
  echo "SKIP: cannot make nodes with a network of their own here (need root, ip netns, veth, bridge, tc tbf)"
  exit 77
fi
export LSC_LIFETIME=600
# 30 units of 334 records (Fashion-MNIST's test set, 10000 images) in both jobs, 1.5 s each:
# about 8 units a rank, 12 s a run, however fast the machine. In each job's first run every
# rank is held after its first unit (LOCUS_TEST_HOLD: ingest-first-unit, infer-second-unit;
# the hold counts as progress for the watchdog) until the test has cut the job's node and
# created its go-file: on a loaded 2-core machine the four jobs could take longer to find than
# 12 s, and one finished before its turn (CI, 2026-11-28). A rerun finds the file there and
# goes on at once. Longer units do not help: the batch-node jobs' reruns
# must start while their stranded predecessor still holds the output's lock (6 s units moved
# them past its watchdog). The same unit size for the ingests compared (statistics depend on
# it).
readonly unit_bytes=$((334 * 784)) unit_rows=334 slow_ms=1500
fm_args=("--ingest.images=$LOCUS_FM_DATA/t10k-images-idx3-ubyte.gz"
  "--ingest.labels=$LOCUS_FM_DATA/t10k-labels-idx1-ubyte.gz" "--ingest.unit_bytes=$unit_bytes")

slurm_cluster_setup --nodes 8 --netns
cd "$LSC_WORK"
net=$LSC_DIR/net
[ "$(sinfo -h -N -o '%N %c %T' | sort -u | tr '\n' ' ')" = "$(printf 'node%d 4 idle ' 1 2 3 4 5 6 7 8)" ] ||
  slurm_fail "expected nodes node1..node8, 4 CPUs each, idle: $(sinfo -N)"

# The scorer's input and the ingest's reference: a plain 2-rank ingest, no Slurm. The model: a
# locus model file, 784-64-10, seeded weights.
# shellcheck disable=SC2086 # word splitting is meant
OPENBLAS_NUM_THREADS=1 mpirun --oversubscribe -n 2 $LOCUS_MPIRUN_ARGS "$LOCUS_BIN/locus-ingest" \
  --ingest.output=fm-test.h5 "${fm_args[@]}" >ref-ingest.log 2>&1 ||
  slurm_fail "the reference ingest failed: $(cat ref-ingest.log)"
OPENBLAS_NUM_THREADS=1 /usr/bin/python3 - m.h5 <<'EOF'
import sys
import h5py
import numpy as np
rng = np.random.default_rng(7)
widths = [784, 64, 10]
with h5py.File(sys.argv[1], "w") as f:
    for i in range(len(widths) - 1):
        f[f"layers.{i}.weight"] = (rng.standard_normal((widths[i + 1], widths[i])) * 0.05).astype(np.float32)
        f[f"layers.{i}.bias"] = (rng.standard_normal(widths[i + 1]) * 0.1).astype(np.float32)
    f.attrs["locus_format"] = "locus-model"
    f.attrs["schema_version"] = 1
    f.attrs["widths"] = np.array(widths, dtype=np.int64)
    f.attrs["activation"] = "relu"
    f.attrs["loss"] = "cross_entropy"
EOF
infer_args=(--infer.model=m.h5 --infer.input=fm-test.h5 "--infer.unit_rows=$unit_rows")
# shellcheck disable=SC2086 # word splitting is meant
OPENBLAS_NUM_THREADS=1 mpirun --oversubscribe -n 2 $LOCUS_MPIRUN_ARGS "$LOCUS_BIN/locus-infer" \
  "${infer_args[@]}" --infer.output=scores-ref.h5 >ref-infer.log 2>&1 ||
  slurm_fail "the reference scoring failed: $(cat ref-infer.log)"

# The jobs on whole nodes, so that they never share one; the scripts as a user submits them.
# IB and SB, which lose their batch node, have a watchdog of 120 s (as slurm_netns): their
# stranded rank 0 ends that long after its last progress -- at least 120 s after the cut, more
# as its ranks 0,1 parse or score what is left first --, well after their reruns start (48-65 s
# after the cut, once I's and S's reruns free the nodes they wait for), so the reruns must wait.
readonly batch_watchdog=120
declare -A job app output key
for name in I IB; do
  extra=()
  [ $name = I ] || extra=("--ingest.watchdog_s=$batch_watchdog")
  job[$name]=$(LOCUS_TEST_HOOK=ingest-unit:delay$slow_ms \
    LOCUS_TEST_HOLD=ingest-first-unit:$PWD/go-$name slurm_submit -N 2 --ntasks=4 \
    --ntasks-per-node=2 --exclusive -o $name.log "$LOCUS_REPO/slurm/ingest.sbatch" \
    --ingest.output=$name.h5 "${fm_args[@]}" "${extra[@]}")
  app[$name]=locus-ingest
  key[$name]=ingest
done
for name in S SB; do
  extra=()
  [ $name = S ] || extra=("--infer.watchdog_s=$batch_watchdog")
  job[$name]=$(LOCUS_TEST_HOLD=infer-second-unit:$PWD/go-$name slurm_submit -N 2 --ntasks=4 \
    --ntasks-per-node=2 --exclusive -o $name.log "$LOCUS_REPO/slurm/infer.sbatch" \
    "${infer_args[@]}" --infer.output=$name.h5 --infer.slow_ranks=0,1,2,3 \
    "--infer.slow_ms=$slow_ms" "${extra[@]}")
  app[$name]=locus-infer
  key[$name]=infer
done
names=(I S IB SB)
for name in "${names[@]}"; do output[$name]=$name.h5; done

temp_of() { echo ".$1.locus-tmp"; }
# Job $1 is mid-run: its ranks are placed and rank 0 holds the output's lock, so its watchdog
# is armed (the work directory is new: the lock file holds a record once a job took it; asking
# flock(1) would take the lock for an instant, which could refuse the job); a scorer also has
# its temporary output (it creates it before the first unit). An ingest then parses for about
# 12 s before it writes. Fails the test at once if the job has ended: asked of Slurm only when
# the job is not seen mid-run, so that a loop over four jobs stays fast under load.
mid_run() {
  # The files first: finding the ranks forks several processes per rank of the machine, which
  # takes seconds while the cut-off nodes' stranded ranks spin.
  if grep -q "^pid " ".${output[$1]}.locus-lock" 2>/dev/null &&
    { [ "${app[$1]}" = locus-ingest ] || [ -e "$(temp_of "${output[$1]}")" ]; } &&
    locus_ranks_on_two_nodes "${job[$1]}" "${app[$1]}" 2>/dev/null; then
    return 0
  fi
  case " $SLURM_FINAL_STATES " in
    *" $(slurm_job_field "${job[$1]}" JobState) "*) slurm_fail "job $1 (${job[$1]}) ended $(slurm_job_field "${job[$1]}" JobState) before its node was cut off: $(tail -n 20 "$1.log")" ;;
  esac
  return 1
}

declare -A first_a first_b cut_node cut
all_cut() {
  local name
  for name in "${names[@]}"; do [ -n "${cut[$name]:-}" ] || return 1; done
}
deadline=$((SECONDS + 120))
while ! all_cut; do
  [ $SECONDS -lt $deadline ] ||
    slurm_fail "not every job mid-run with 4 ranks on two hosts after 120 s: $(for n in "${names[@]}"; do echo "$n: $(locus_job_ranks "${job[$n]}" "${app[$n]}" | tr '\n' ';')"; done) $(tail -n 5 "${names[@]/%/.log}")"
  for name in "${names[@]}"; do
    if [ -n "${cut[$name]:-}" ] || ! mid_run "$name"; then continue; fi
    read -r "first_a[$name]" "first_b[$name]" <"placement-${job[$name]}"
    if [ "${name: -1}" = B ]; then  # the batch node: mpirun's and ranks 0,1's
      cut_node[$name]=${first_a[$name]}
      [ "$(slurm_job_field "${job[$name]}" BatchHost)" = "${cut_node[$name]}" ] ||
        slurm_fail "job $name: ranks 0,1 run on ${cut_node[$name]}, its batch host is $(slurm_job_field "${job[$name]}" BatchHost)"
    else
      cut_node[$name]=${first_b[$name]}
    fi
    locus_cut_off "$net" "${cut_node[$name]}"
    touch "go-$name"  # the held ranks go on: those cut off until they need their peers
    cut[$name]=$SECONDS
    slurm_log "job $name (${job[$name]}, ${app[$name]}): ranks 0,1 on ${first_a[$name]}, 2,3 on ${first_b[$name]}; ${cut_node[$name]} cut off mid-run"
  done
  sleep 0.2
done

declare -A down_s rerun_s rejoin_s
for name in "${names[@]}"; do
  slurm_wait_until 60 "${cut_node[$name]} to be set DOWN" locus_node_is_down "${cut_node[$name]}" ||
    slurm_fail "${cut_node[$name]} is $(locus_node_state "${cut_node[$name]}") $((SECONDS - ${cut[$name]})) s after its link went down"
  down_s[$name]=$((SECONDS - ${cut[$name]}))
done
for name in "${names[@]}"; do
  slurm_wait_until 150 "the rerun of job $name to start" grep -q "restart 1, " "$name.log" ||
    slurm_fail "job $name (${job[$name]}) was not started again: $(slurm_job_field "${job[$name]}" JobState) $(tail -n 5 "$name.log")"
  rerun_s[$name]=$((SECONDS - ${cut[$name]}))
  nodes=$(scontrol show hostnames "$(slurm_job_field "${job[$name]}" NodeList)" | tr '\n' ' ')
  if [ "$(wc -w <<<"$nodes")" != 2 ] || grep -qw "${cut_node[$name]}" <<<"$nodes"; then
    slurm_fail "the rerun of job $name runs on '$nodes', expected two nodes without the cut-off ${cut_node[$name]}"
  fi
  slurm_log "job $name: ${cut_node[$name]} DOWN ${down_s[$name]} s after the cut, rerun started ${rerun_s[$name]} s after it, on $nodes"
done
# IB's and SB's reruns wait for their output's lock, which the stranded rank 0 holds, until
# that rank's watchdog ends it.
for name in IB SB; do
  slurm_wait_until 60 "the rerun of job $name to wait for its predecessor" \
    grep -q "output '$name.h5' (${key[$name]}.output) is held by an earlier instance of this Slurm job .*: waiting up to .* s for it to end (its ${key[$name]}.watchdog_s = $batch_watchdog ends it" "$name.log" ||
    slurm_fail "job $name's rerun did not wait for its stranded predecessor (the rerun started ${rerun_s[$name]} s after the cut, the predecessor's watchdog fires $batch_watchdog s after its last progress): $(tail -n 20 "$name.log")"
done
for name in "${names[@]}"; do
  slurm_wait_state "${job[$name]}" COMPLETED 240 || slurm_fail "job $name did not complete: $(tail -n 30 "$name.log")"
  [ "$(slurm_job_field "${job[$name]}" ExitCode)" = 0:0 ] || slurm_fail "job $name: ExitCode $(slurm_job_field "${job[$name]}" ExitCode)"
done
# What let IB's and SB's reruns in: a stranded rank's watchdog (rank 0's, or rank 1's, whose
# MPI_Abort then took rank 0 with it), which wrote to the shared log.
for name in IB SB; do
  grep -q "^\[rank [01]/4 ${cut_node[$name]}\] watchdog: no progress for $batch_watchdog s in " "$name.log" ||
    slurm_fail "$name.log: no watchdog line of a stranded rank on ${cut_node[$name]}: $(tail -n 20 "$name.log")"
  slurm_log "job $name: the rerun took the output's lock once the stranded predecessor's watchdog ended it: $(grep -o "^\[rank [01]/4 ${cut_node[$name]}\] watchdog: no progress for $batch_watchdog s in [^(]*" "$name.log" | head -n 1)"
done

# The network back (only now: a stranded instance ends as soon as it can talk again): the nodes
# rejoin by themselves, and what ran on them has ended.
for name in "${names[@]}"; do bash "$nodes_sh" link "$net" "${cut_node[$name]#node}" up; done
back=$SECONDS
for name in "${names[@]}"; do
  slurm_wait_until 150 "${cut_node[$name]} to return to service" locus_node_is_up "${cut_node[$name]}" ||
    slurm_fail "${cut_node[$name]} is $(locus_node_state "${cut_node[$name]}") $((SECONDS - back)) s after its link came back: $(grep "${cut_node[$name]}" "$LSC_DIR/log/slurmctld.log" | tail -n 5)"
  rejoin_s[$name]=$((SECONDS - back))
  none_left() { [ -z "$(locus_job_ranks "$1" "$2")" ]; }
  slurm_wait_until 30 "no rank of job $name left" none_left "${job[$name]}" "${app[$name]}" ||
    slurm_fail "ranks of job $name still run: $(locus_job_ranks "${job[$name]}" "${app[$name]}" | tr '\n' ';')"
done

for name in "${names[@]}"; do
  j=${job[$name]}
  [ "$(slurm_job_field "$j" Restarts)" = 1 ] || slurm_fail "job $name: Restarts=$(slurm_job_field "$j" Restarts), expected 1"
  grep -q "requeue job JobId=$j due to failure of node ${cut_node[$name]}" "$LSC_DIR/log/slurmctld.log" ||
    slurm_fail "slurmctld did not log the requeue of job $j for ${cut_node[$name]}: $(tail -n 20 "$LSC_DIR/log/slurmctld.log")"
  grep -q "restart 1, .*, 4 tasks: mpirun -n 4 " "$name.log" ||
    slurm_fail "$name.log: the rerun is not one 4-task mpirun: $(grep 'restart ' "$name.log")"
  [ ! -e "$(temp_of "${output[$name]}")" ] || slurm_fail "job $name left its temporary file $(temp_of "${output[$name]}")"
done
for name in I IB; do
  locus_same_tensors $name.h5 fm-test.h5 || slurm_fail "job $name: $name.h5 differs from the uninterrupted ingest's"
  [ "$(grep -c '^ingested ' $name.log)" = 1 ] || slurm_fail "$name.log: expected one finished ingest (the rerun's): $(grep -v '^{' $name.log | tail -n 20)"
done
for name in S SB; do
  locus_same_tensors $name.h5 scores-ref.h5 || slurm_fail "job $name: $name.h5 differs from the uninterrupted scoring's"
done
echo "PASS: ingests and scoring jobs each lost a node mid-run (I, S: ranks 2,3's; IB, SB: the batch node): DOWN in ${down_s[I]}/${down_s[S]}/${down_s[IB]}/${down_s[SB]} s, requeued by Slurm (JobRequeue) and rerun in ${rerun_s[I]}/${rerun_s[S]}/${rerun_s[IB]}/${rerun_s[SB]} s on nodes that were up (IB, SB waiting for their stranded rank 0's watchdog), outputs bit for bit an uninterrupted run's; nodes back in ${rejoin_s[I]}/${rejoin_s[S]}/${rejoin_s[IB]}/${rejoin_s[SB]} s"
