# shellcheck shell=bash
# Sourced by the locus-train bench scripts (needs $apps, the build's apps/ directory): MPI as
# root, one BLAS thread per process, `launch N CMD...` (mpirun without binding, so a rank is
# not pinned to the busy core), and the Fashion-MNIST train and test sets ingested once into
# $out (LOCUS_BENCH_OUT, default /tmp/locus-train-bench) as train.h5 and test.h5.
out=${LOCUS_BENCH_OUT:-/tmp/locus-train-bench}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
mkdir -p "$out"
fm=/usr/share/datasets/fashion-mnist
launch() { local n=$1; shift; mpirun --oversubscribe --bind-to none -n "$n" "$@"; }
if [[ ! -f $out/train.h5 || ! -f $out/test.h5 ]]; then
  launch 2 "$apps/locus-ingest" --overwrite --ingest.output="$out/train.h5" > /dev/null
  launch 2 "$apps/locus-ingest" --overwrite --ingest.output="$out/test.h5" \
    --ingest.images=$fm/t10k-images-idx3-ubyte.gz --ingest.labels=$fm/t10k-labels-idx1-ubyte.gz > /dev/null
fi
