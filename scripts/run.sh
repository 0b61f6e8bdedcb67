#!/usr/bin/env bash
# The main job, end to end on one machine: installs what is missing, builds, then runs the
# pipeline of configs/fashion-mnist.ini (the apps' embedded default) under plain mpirun with
# 2 ranks: ingest the Fashion-MNIST train and test sets and print their summaries.
# Outputs go to ./out/ (override with LOCUS_OUT=dir). Extra args are passed to every app.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
ranks=${LOCUS_RANKS:-2}
out=${LOCUS_OUT:-out}
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
mkdir -p "$out"
bin="$root/build/apps"
launch() { mpirun --oversubscribe --bind-to none -n "$ranks" "$@"; }
data=/usr/share/datasets/fashion-mnist

echo "== ingest: Fashion-MNIST train set"
launch "$bin/locus-ingest" --overwrite --ingest.output="$out/fashion-mnist-train.h5" "$@"
echo "== ingest: Fashion-MNIST test set (gated against the train set's statistics)"
launch "$bin/locus-ingest" --overwrite --ingest.output="$out/fashion-mnist-test.h5" \
  --ingest.images="$data/t10k-images-idx3-ubyte.gz" \
  --ingest.labels="$data/t10k-labels-idx1-ubyte.gz" \
  --gates.reference="$out/fashion-mnist-train.h5" --gates.max_psi=0.1 \
  --gates.max_mean_shift=0.1 "$@"
