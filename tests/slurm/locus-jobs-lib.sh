# shellcheck shell=bash
# Helpers for the tests of the product's batch scripts (slurm/*): test data, dataset facts,
# job logs. Source after scripts/slurm-lib.sh.
#
#   locus_make_csv PATH ROWS SEED [SHIFT] [CLASSES_IN_LABELS]
#   locus_h5_rows FILE [DATASET]     rows of a dataset (default /features), from h5dump -H
#   locus_h5_labels FILE             the /labels values, one a line
#   locus_csv_labels FILE            the label column of a CSV made by locus_make_csv, one a line
#   locus_json FILE EXPR             a Python expression over the JSON document `r` in FILE
#   locus_job_log JOB                path of a pipeline job's log (LOCUS_LOG_DIR/NAME-JOB.out)
#   locus_last_step METRICS          the last step of a metrics file's step lines, 0 before the first
#   locus_same_tensors FILE REF      every dataset of two HDF5 files (models, datasets, predictions)
#                                    equal bit for bit
#   locus_trainer_setup APPS_DIR     the real-trainer tests' common start: LOCUS_BIN, 2-rank
#                                    mpirun arguments that do not busy-poll, the apps checked
#   locus_submit_fm_test_ingest      submit slurm/ingest.sbatch of Fashion-MNIST's test set into
#                                    fm-test.h5 (cwd); prints the job id
#   locus_reference_start ARGS...    start the uninterrupted 2-rank (LOCUS_REFERENCE_RANKS)
#                                    reference locus-train run (model-ref.h5, ref.log in cwd)
#                                    beside the cluster's jobs; the EXIT trap ends it before the
#                                    cluster's teardown
#   locus_reference_wait             wait for it; fail the test if it failed
# Nodes with a network of their own (slurm-cluster.sh --netns):
#   locus_job_ranks JOB APP          "RANK HOST" for every live APP process of Slurm job JOB
#   locus_ranks_on_two_nodes JOB APP JOB's 4 ranks run 2+2 on two hosts (written to placement-JOB)
#   locus_node_state NODE            Slurm's state of NODE; locus_node_is_down / _is_up NODE
#   locus_cut_off NET NODE           NODE loses its link for good; its processes get nice 19

# shellcheck disable=SC2034 # used by the tests that source this file
LOCUS_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
LOCUS_FM_DATA=/usr/share/datasets/fashion-mnist

# A CSV with 12 features and a label column: 4 overlapping clusters (as configs/tiny.ini's
# test data; an MLP reaches ~0.9 accuracy, chance is 0.25). SHIFT is added to every feature
# (drift); labels are drawn from [0, CLASSES_IN_LABELS) (default 4: more makes bad labels).
locus_make_csv() {
  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 - "$@" <<'EOF'
import sys
import numpy as np
path, rows, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
shift = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
classes = int(sys.argv[5]) if len(sys.argv) > 5 else 4
rng = np.random.default_rng(seed)
y = rng.integers(0, classes, size=rows)
k = np.arange(12)
centres = 1.2 * np.sin(1.7 * np.arange(classes)[:, None] + 0.9 * k[None, :])
x = centres[y] + rng.normal(0, 1.0, size=(rows, 12)) + shift
with open(path, "w") as f:
    f.write(",".join(f"f{i}" for i in range(12)) + ",label\n")
    for xi, yi in zip(x, y):
        f.write(",".join(f"{v:.6f}" for v in xi) + f",{yi}\n")
EOF
}

locus_h5_rows() {
  local file=$1 dataset=${2:-/features}
  h5dump -H -d "$dataset" "$file" | sed -n 's/.*DATASPACE *SIMPLE { ( \([0-9]*\).*/\1/p' | head -n 1
}

locus_h5_labels() {
  h5dump -d /labels -y -w 1 "$1" | sed -n '/DATA {/,/}/p' | grep -o '[0-9-]\+'
}

locus_csv_labels() { tail -n +2 "$1" | awk -F, '{ print $NF }'; }

locus_json() {
  /usr/bin/python3 -c 'import json, sys; r = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"
}

locus_job_log() {
  local name
  name=$(slurm_job_field "$1" JobName) || return 1
  echo "${LOCUS_LOG_DIR:-logs}/$name-$1.out"
}

# The last step in a locus-train metrics file (a step line every train.log_every steps); 0 when
# the file has none yet or does not exist.
locus_last_step() {
  local n
  n=$(sed -n 's/^{"type":"step","step":\([0-9]*\),.*/\1/p' "$1" 2>/dev/null | tail -n 1) || true
  echo "${n:-0}"
}

# Succeeds when FILE and REF hold the same datasets with the same dtype, shape and bytes (the
# tensors of two model files; their attributes, e.g. the output path in the config, may differ).
locus_same_tensors() {
  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 - "$1" "$2" <<'EOF'
import sys
import h5py
import numpy as np
def tensors(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.__setitem__(n, np.asarray(o[()])) if isinstance(o, h5py.Dataset) else None)
    return out
got, want = tensors(sys.argv[1]), tensors(sys.argv[2])
if not want or sorted(got) != sorted(want):
    sys.exit(f"{sys.argv[1]} holds {sorted(got)}, {sys.argv[2]} holds {sorted(want)}")
bad = [k for k in want if got[k].dtype != want[k].dtype or got[k].shape != want[k].shape
       or got[k].tobytes() != want[k].tobytes()]
if bad:
    sys.exit(f"{sys.argv[1]} and {sys.argv[2]} differ in {bad}")
EOF
}

# The tests that run the real locus-train under Slurm run two 2-rank jobs (or a job and its
# reference) at once on a 2-core machine whose node declares 4 CPUs: ranks that busy-poll in MPI
# would take the cores from the peers they wait for (docs/SLURM.md).
locus_trainer_setup() {
  LOCUS_BIN=$(readlink -f "${1:?usage: locus_trainer_setup APPS_DIR}")
  LOCUS_MPIRUN_ARGS="--bind-to none --mca mpi_yield_when_idle 1"
  export LOCUS_BIN LOCUS_MPIRUN_ARGS
  local app
  for app in locus-ingest locus-train; do
    [ -x "$LOCUS_BIN/$app" ] || slurm_fail "$LOCUS_BIN/$app is not an executable: build $app"
  done
  [ -r "$LOCUS_FM_DATA/t10k-images-idx3-ubyte.gz" ] ||
    slurm_fail "no $LOCUS_FM_DATA: install dataset-fashion-mnist (scripts/install-deps.sh)"
}

locus_submit_fm_test_ingest() {
  slurm_submit -o ingest.log "$LOCUS_REPO/slurm/ingest.sbatch" --ingest.output=fm-test.h5 \
    "--ingest.images=$LOCUS_FM_DATA/t10k-images-idx3-ubyte.gz" \
    "--ingest.labels=$LOCUS_FM_DATA/t10k-labels-idx1-ubyte.gz"
}

# The reference a test compares its jobs' models with: the same locus-train arguments and rank
# count (LOCUS_REFERENCE_RANKS, default 2), no Slurm, no checkpoints, run alongside the jobs. It
# is no job of the cluster, so if the test fails before it ends, the EXIT trap ends it (mpirun
# ends its ranks) and then lets the cluster's teardown run with the test's exit status.
locus_reference_start() {
  # shellcheck disable=SC2086 # word splitting is meant
  OPENBLAS_NUM_THREADS=1 mpirun --oversubscribe -n "${LOCUS_REFERENCE_RANKS:-2}" $LOCUS_MPIRUN_ARGS "$LOCUS_BIN/locus-train" \
    "$@" --train.output=model-ref.h5 --train.metrics= >ref.log 2>&1 &
  LOCUS_REF_PID=$!
  trap locus_reference_end EXIT
}

locus_reference_end() {
  local rc=$?
  set +e # a failing command must not end the trap before the teardown
  [ -z "${LOCUS_REF_PID:-}" ] || { kill "$LOCUS_REF_PID" 2>/dev/null && wait "$LOCUS_REF_PID"; }
  (exit $rc) # the status slurm_cluster_teardown reports
  slurm_cluster_teardown
}

locus_reference_wait() {
  local rc=0
  wait "$LOCUS_REF_PID" || rc=$?
  LOCUS_REF_PID=""
  [ $rc = 0 ] || slurm_fail "the reference training failed (exit $rc): $(cat ref.log)"
}

# "RANK HOST" for every live process named $2 of Slurm job $1: its world rank and the host name
# of its UTS namespace. Each process's environment is read by the shell itself: forking tools
# for each rank of the machine took seconds a call on 2 loaded cores (the stranded ranks of
# cut-off nodes spinning), which the node-loss tests' loops cannot afford.
locus_job_ranks() {
  local p v rank mine
  local -a env
  for p in $(pgrep -x "$2" || true); do
    mapfile -d '' -t env 2>/dev/null <"/proc/$p/environ" || continue
    rank="" mine=0
    for v in "${env[@]}"; do
      case $v in
        "SLURM_JOB_ID=$1") mine=1 ;;
        OMPI_COMM_WORLD_RANK=*) rank=${v#OMPI_COMM_WORLD_RANK=} ;;
      esac
    done
    [ $mine = 1 ] || continue
    echo "$rank $(nsenter --uts --target "$p" hostname 2>/dev/null || echo -)"
  done | sort -n
}

# Succeeds when job $1 has its 4 ranks of app $2 running, 0,1 on one host and 2,3 on another;
# writes the two hosts to the file placement-$1.
locus_ranks_on_two_nodes() {
  local r
  r=$(locus_job_ranks "$1" "$2")
  [ "$(echo "$r" | grep -c .)" = 4 ] || return 1
  echo "$r" | awk '
    { rank[NR-1] = $1; host[NR-1] = $2 }
    END {
      for (i = 0; i < 4; i++) if (rank[i] != i || host[i] !~ /^node[1-9][0-9]*$/) exit 1
      if (host[0] != host[1] || host[2] != host[3] || host[0] == host[2]) exit 1
      print host[0], host[2]
    }' >"placement-$1" || { echo "job $1: ranks not 2+2 on two hosts: $(echo "$r" | tr '\n' ';')" >&2; return 1; }
}

locus_node_state() { sinfo -h -n "$1" -o %T | head -n 1; }
locus_node_is_down() { case "$(locus_node_state "$1")" in down*) return 0 ;; esac; return 1; }
locus_node_is_up() { case "$(locus_node_state "$1")" in idle | allocated | mixed) return 0 ;; esac; return 1; }

# Node $2 (nodeK) of the emulated nodes in $1 (slurm-cluster.sh's DIR/net) loses its link for
# good; its processes keep running, cut off. The emulated nodes share this machine's 2 cores,
# where a lost node's would be its own: its stranded ranks poll at 100% of a core each until
# their watchdog ends them (measured), so they get nice 19 and leave the cores to the nodes
# that are up.
locus_cut_off() {
  local id p
  bash "$LOCUS_REPO/scripts/netns-nodes.sh" link "$1" "${2#node}" down
  id=$(sed -n 's/^id=//p' "$1/nodes.env")
  for p in $(ip netns pids "locus-$id-n${2#node}"); do
    renice -n 19 -p "$p" >/dev/null 2>&1 || true
  done
}
