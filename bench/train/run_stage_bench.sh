#!/bin/bash
# Node-local staging benchmark (bench/RESULTS.md, "Node-local staging"): writes a synthetic
# locus-format dataset on the disk (not tmpfs), then runs stage_bench at 2 ranks, local and
# global shuffle, out of core, with the source evicted from the page cache before every epoch,
# direct vs staged into /dev/shm, alternating.
#   bench/train/run_stage_bench.sh BUILD_DIR [WORK_DIR=/var/tmp/locus-stage-bench] [ROWS=400000] [COLS=64]
set -euo pipefail
build=${1:?usage: run_stage_bench.sh BUILD_DIR [WORK_DIR] [ROWS] [COLS]}
work=${2:-/var/tmp/locus-stage-bench}
rows=${3:-400000}
cols=${4:-64}
mkdir -p "$work" /dev/shm/locus-stage-bench
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
if [ ! -f "$work/data-$rows-$cols.h5" ]; then
  /usr/bin/python3 - "$work/data-$rows-$cols.h5" "$rows" "$cols" <<'PY'
import sys, h5py, numpy as np
path, n, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
with h5py.File(path, "w") as f:
    f.create_dataset("features", data=rng.standard_normal((n, d), dtype=np.float32),
                     chunks=(max(1, (1 << 20) // (4 * d)), d))
    f.create_dataset("labels", data=rng.integers(0, 10, n, dtype=np.int32))
    f.attrs["committed_rows"] = np.int64(n)
PY
fi
for shuffle in ${SHUFFLES:-local global}; do
  mpiexec --oversubscribe --bind-to none -n 2 "$build/bench/train/locus_stage_bench" \
    "$work/data-$rows-$cols.h5" /dev/shm/locus-stage-bench --shuffle "$shuffle" \
    --budget-mb 8 --batch 256 --epochs 3 --repeats "${REPEATS:-3}" --evict 1
done
rmdir /dev/shm/locus-stage-bench 2>/dev/null || true
