#!/usr/bin/env bash
# Builds the >= 1M-row benchmark input for bench/infer: Fashion-MNIST's training set ingested
# once and appended COPIES more times with locus-ingest --append (60000 x (1 + COPIES) rows,
# 784 features, minmax-normalised as configs/fashion-mnist.ini does).
#   bench/infer/make_input.sh BUILD_DIR OUT.h5 [COPIES=16] [RANKS=2]
#     FM_DIR: where the Fashion-MNIST .gz files are (default: the Debian package's directory)
set -euo pipefail
build=$1 out=$2 copies=${3:-16} ranks=${4:-2}
fm=${FM_DIR:-/usr/share/datasets/fashion-mnist}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
# locus-ingest --append refuses to append the input it appended last (a rerun after a
# preemption must not add the rows twice), so each copy is appended under a name of its own.
links=$(mktemp -d)
trap 'rm -rf "$links"' EXIT
run() { mpiexec --oversubscribe --bind-to none -n "$ranks" "$build/apps/locus-ingest" \
          --ingest.images="$1-images-idx3-ubyte.gz" --ingest.labels="$1-labels-idx1-ubyte.gz" \
          --ingest.output="$out" --ingest.report="$out.gates.json" "${@:2}" > /dev/null; }
rm -f "$out"
run "$fm/train"
for ((i = 0; i < copies; i++)); do
  ln -s "$fm/train-images-idx3-ubyte.gz" "$links/copy$i-images-idx3-ubyte.gz"
  ln -s "$fm/train-labels-idx1-ubyte.gz" "$links/copy$i-labels-idx1-ubyte.gz"
  run "$links/copy$i" --append
done
echo "$out: $((60000 * (copies + 1))) rows (Fashion-MNIST's 60000 training images per ingest)"
