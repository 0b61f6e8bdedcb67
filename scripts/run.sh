#!/usr/bin/env bash
# The main job, end to end on one machine: installs what is missing, builds, then runs the
# pipeline of configs/fashion-mnist.ini (the apps' embedded default) under plain mpirun with
# 2 ranks: ingest the Fashion-MNIST train and test sets and print their summaries, then train
# the MLP on the train set (evaluated on the test set every epoch), score the test set with the
# trained model (locus-infer) and print its accuracy. The training run's report (locus-report:
# one HTML page with plots) is written to out/fashion-mnist-report.html.
# Outputs go to ./out/ (override with LOCUS_OUT=dir). Extra args go to the app whose config
# sections they name (--ingest.*/--gates.* to locus-ingest; --data/model/optim/train/loader/
# eval/checkpoint.* and --resume to locus-train; --infer.* to locus-infer; write them as
# --key=value); any other argument (e.g. --config FILE) to every app.
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
ingest_args=() train_args=() infer_args=()
for a in "$@"; do
  case $a in
    --ingest.*|--gates.*) ingest_args+=("$a") ;;
    --data.*|--model.*|--optim.*|--train.*|--loader.*|--eval.*|--checkpoint.*|--resume=*) train_args+=("$a") ;;
    --infer.*) infer_args+=("$a") ;;
    *) ingest_args+=("$a"); train_args+=("$a"); infer_args+=("$a") ;;
  esac
done

echo "== ingest: Fashion-MNIST train set"
launch "$bin/locus-ingest" --overwrite --ingest.output="$out/fashion-mnist-train.h5" "${ingest_args[@]}"
echo "== ingest: Fashion-MNIST test set (gated against the train set's statistics)"
launch "$bin/locus-ingest" --overwrite --ingest.output="$out/fashion-mnist-test.h5" \
  --ingest.images="$data/t10k-images-idx3-ubyte.gz" \
  --ingest.labels="$data/t10k-labels-idx1-ubyte.gz" \
  --gates.reference="$out/fashion-mnist-train.h5" --gates.max_psi=0.1 \
  --gates.max_mean_shift=0.1 "${ingest_args[@]}"
echo "== train: MLP on the train set, $ranks data-parallel ranks, evaluated on the test set"
launch "$bin/locus-train" --data.train="$out/fashion-mnist-train.h5" \
  --data.test="$out/fashion-mnist-test.h5" --train.output="$out/fashion-mnist-model.h5" \
  --train.metrics="$out/fashion-mnist-metrics.jsonl" --checkpoint.dir="$out/checkpoints" \
  "${train_args[@]}" | tee "$out/train.log"
echo "== report: the training run as one HTML page (plots, checkpoints, telemetry, config)"
report=$(/usr/bin/python3 "$bin/locus-report" "$out/fashion-mnist-metrics.jsonl" \
  --log "$out/train.log" --checkpoints "$out/checkpoints" -o "$out/fashion-mnist-report.html")
echo "   run report: $report"
echo "== infer: score the test set with the trained model, $ranks ranks"
launch "$bin/locus-infer" --overwrite --infer.model="$out/fashion-mnist-model.h5" \
  --infer.input="$out/fashion-mnist-test.h5" --infer.output="$out/fashion-mnist-scores.h5" \
  "${infer_args[@]}" | tee "$out/infer.log"
echo "== Fashion-MNIST test accuracy: $(sed -n 's/^  accuracy \([0-9.]*\),.*/\1/p' "$out/infer.log")" \
     "(locus-infer; predictions $out/fashion-mnist-scores.h5, report" \
     "$out/fashion-mnist-scores.h5.report.json; the trainer's own evaluation:" \
     "$(sed -n 's/^test accuracy \([0-9.]*\).*/\1/p' "$out/train.log"))"
echo "== run report: $report"
