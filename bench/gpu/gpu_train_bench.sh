#!/usr/bin/env bash
# locus-train end to end on one GPU: Fashion-MNIST's training set (60000 x 784) ingested into
# HDF5 with locus-ingest, then trained (784-256-128-10, SGD momentum 0.9 nesterov, the embedded
# config's other settings) with --train.backend=cuda, batches streamed from pinned host memory
# (--loader.device_cache_mb=0) or gathered from a device-resident copy (=1024), fp32 and bf16,
# batch 128/1024/8192, and a few rows with --train.backend=cpu for reference (constant learning
# rate, no warm-up: a run of a few epochs at batch 8192 has too few steps for the default
# schedule's warm-up; the rate does not change the work per step). For each row:
# samples/s and data_wait_fraction, medians over the epoch lines of the metrics file after the
# first epoch (start-up, CUDA context, graph capture and the device-cache fill land there).
#   bench/gpu/gpu_train_bench.sh APPS_ROOT WORK_DIR
#     APPS_ROOT: a build directory or a bundle (make_gpu_bundle.sh): APPS_ROOT/apps/locus-*
#     FM_DIR     Fashion-MNIST .gz files (default APPS_ROOT/fm, else the Debian package's)
#     EPOCHS=4   STEP_TIMEOUT=90 (s per run)   BUDGET_S=240 (rows left after this are skipped)
#     LAUNCH=auto|direct|mpirun  (auto: run the apps directly as MPI singletons, or through
#                                 `mpirun --allow-run-as-root --oversubscribe -n 1` if that fails)
#     ROWS="backend:precision:batch:cache_mb:graphs ..." (graphs: true|false|- for the default;
#                   cache_mb "map": no device cache, loader.gather = device; "0tN": no device
#                   cache, loader.gather_threads = N host threads copying each batch)
#     CPU_THREADS=1 (train.threads of the cpu rows)   PYTHON=python3   EXTRA="--key=value ..."
#     DATA=FILE.h5  train on this file instead (a locus dataset, or any HDF5 file with /features
#                   [N, D] float and /labels [N] integer: docs/FORMATS.md): no locus-ingest; with
#                   LAUNCH=auto, `locus-train --help` (it starts MPI) chooses the launcher; give
#                   the matching --model.widths in EXTRA. The file is only read, never removed.
#     TITLE="..."   the workload's name in the table's heading
# Writes WORK_DIR/gpu_train_bench.tsv, one log per run under WORK_DIR/logs, and prints a table.
set -uo pipefail
root=$(cd "${1:?usage: gpu_train_bench.sh APPS_ROOT WORK_DIR}" && pwd)
work=${2:?usage: gpu_train_bench.sh APPS_ROOT WORK_DIR}
apps=$root/apps
fm=${FM_DIR:-$root/fm}
[[ -f $fm/train-images-idx3-ubyte.gz ]] || fm=/usr/share/datasets/fashion-mnist
epochs=${EPOCHS:-4} step_timeout=${STEP_TIMEOUT:-90} budget=${BUDGET_S:-240}
py=${PYTHON:-python3} cpu_threads=${CPU_THREADS:-1}
if [[ -z ${ROWS:-} ]]; then
  ROWS=""
  for cache in 1024 0; do
    for prec in fp32 bf16; do
      for b in 128 1024 8192; do ROWS+=" cuda:$prec:$b:$cache:true"; done
    done
  done
  ROWS+=" cuda:fp32:1024:map:true cuda:fp32:8192:map:true cuda:bf16:8192:map:true"
  ROWS+=" cuda:fp32:8192:0t8:true cuda:bf16:8192:0t8:true"
  ROWS+=" cuda:fp32:128:1024:false cuda:fp32:8192:1024:false cpu:fp32:128:0:- cpu:fp32:1024:0:-"
fi
mkdir -p "$work/logs"
tsv=$work/gpu_train_bench.tsv
printf 'backend\tprecision\tbatch\tcache_mb\tgraphs\tstatus\tsamples_per_s\tdata_wait_fraction\tepochs_used\tfirst_epoch_s\twall_s\tnote\n' > "$tsv"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
mpirun_cmd=(mpirun --allow-run-as-root --oversubscribe --bind-to none -n 1)
launch=${LAUNCH:-auto}

# run LOG CMD... : under the chosen launcher and the per-run timeout
run() {
  local log=$1; shift
  case $launch in
    direct) OMPI_MCA_ess_singleton_isolated=1 timeout --foreground -k 5 "$step_timeout" "$@" > "$log" 2>&1 ;;
    mpirun) timeout --foreground -k 5 "$step_timeout" "${mpirun_cmd[@]}" "$@" > "$log" 2>&1 ;;
  esac
}

# The dataset, whose first command (locus-ingest, or `locus-train --help` when DATA is given)
# also decides the launcher when LAUNCH=auto: the first one under which it works.
if [[ -n ${DATA:-} ]]; then
  if [[ ! -f $DATA ]]; then
    echo "gpu_train_bench: DATA=$DATA: no such file; give an HDF5 file with /features and /labels" >&2
    exit 2
  fi
  data=$(cd "$(dirname "$DATA")" && pwd)/$(basename "$DATA")
  step=probe first=("$apps/locus-train" --help)
  started() { grep -q '^usage: locus-train' "$1"; }
else
  data=$work/train.h5
  step=ingest first=("$apps/locus-ingest" --ingest.images="$fm/train-images-idx3-ubyte.gz"
                     --ingest.labels="$fm/train-labels-idx1-ubyte.gz" --ingest.output="$data"
                     --ingest.report="$work/train.gates.json")
  started() { [[ -f $data ]]; }
fi
launchers=$launch
[[ $launch == auto ]] && launchers="direct mpirun"
for l in $launchers; do
  launch=$l
  [[ -n ${DATA:-} ]] || rm -f "$data"
  if run "$work/logs/$step-$l.log" "${first[@]}" && started "$work/logs/$step-$l.log"; then break; fi
  echo "gpu_train_bench: ${first[0]##*/} failed with launcher '$l':" >&2
  tail -n 5 "$work/logs/$step-$l.log" >&2
  launch=none
done
if [[ $launch == none || ! -f $data ]]; then
  if [[ -n ${DATA:-} ]]; then
    echo "gpu_train_bench: locus-train does not start under any launcher (logs in $work/logs): nothing to time" >&2
  else
    echo "gpu_train_bench: no dataset (locus-ingest failed; logs in $work/logs): nothing to time" >&2
  fi
  exit 2
fi
if [[ -n ${DATA:-} ]]; then
  echo "gpu_train_bench: dataset $data (launcher: $launch; given as DATA)"
else
  echo "gpu_train_bench: dataset $data (launcher: $launch; Fashion-MNIST from $fm)"
fi

# summarize METRICS -> "samples_per_s data_wait epochs_used first_epoch_s" (medians after epoch 1)
summarize() {
  "$py" - "$1" <<'EOF'
import json, statistics, sys
ep = []
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if r.get("type") == "epoch":
        ep.append(r)
if not ep:
    print("- - 0 -")
    sys.exit()
use = ep[1:] or ep
med = lambda k: statistics.median(float(r.get(k, "nan")) for r in use)
print(f"{med('samples_per_s'):.0f} {med('data_wait_fraction'):.4f} {len(use)} {float(ep[0].get('seconds', 'nan')):.3f}")
EOF
}

t0=$SECONDS
for row in $ROWS; do
  IFS=: read -r backend prec batch cache graphs <<< "$row"
  tag=$backend-$prec-b$batch-c$cache-g$graphs
  if ((SECONDS - t0 > budget)); then
    printf '%s\t%s\t%s\t%s\t%s\tskipped\t-\t-\t-\t-\t-\tbudget %ss spent\n' \
      "$backend" "$prec" "$batch" "$cache" "$graphs" "$budget" >> "$tsv"
    continue
  fi
  metrics=$work/metrics-$tag.jsonl
  rm -f "$metrics"
  args=(--data.train="$data" --data.test= --eval.every=0 --train.output= --train.metrics="$metrics"
        --train.log_every=0 --train.epochs="$epochs" --train.batch="$batch"
        --optim.schedule=constant --optim.warmup_steps=0
        --train.backend="$backend")
  if [[ $backend == cuda ]]; then
    if [[ $cache == map ]]; then
      args+=(--train.precision="$prec" --loader.device_cache_mb=0 --loader.gather=device)
    elif [[ $cache == 0t* ]]; then
      args+=(--train.precision="$prec" --loader.device_cache_mb=0
             --loader.gather_threads="${cache#0t}")
    else
      args+=(--train.precision="$prec" --loader.device_cache_mb="$cache")
    fi
    [[ $graphs == - ]] || args+=(--train.graphs="$graphs")
  else
    args+=(--train.threads="$cpu_threads")
  fi
  # shellcheck disable=SC2206
  [[ -n ${EXTRA:-} ]] && args+=($EXTRA)
  start=$SECONDS
  run "$work/logs/train-$tag.log" "$apps/locus-train" "${args[@]}"
  rc=$?
  wall=$((SECONDS - start))
  read -r sps wait used first <<< "$( [[ -s $metrics ]] && summarize "$metrics" || echo "- - 0 -")"
  if ((rc == 0)) && [[ $sps != - ]]; then
    status=ok note=""
    # The whole run's data wait split (the summary's line on cuda): the loader's, the GPU's.
    note=$(sed -n "s/^data wait: the loader (host) \([0-9.]*\)%, the GPU's stream for its inputs \([0-9.]*\)%$/wait host \1% gpu \2%/p" \
             "$work/logs/train-$tag.log" | head -n 1)
  else
    status=failed
    ((rc == 124 || rc == 137)) && status=timeout
    note="rc=$rc: $( { grep -m1 -i 'error' "$work/logs/train-$tag.log" || tail -n 1 "$work/logs/train-$tag.log"; } |
                     tr '\t\n' '  ' | cut -c1-160)"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$backend" "$prec" "$batch" "$cache" \
    "$graphs" "$status" "$sps" "$wait" "$used" "$first" "$wall" "$note" >> "$tsv"
  echo "gpu_train_bench: $tag: $status $sps samples/s, data wait $wait (${wall}s)${note:+ $note}"
done

echo
if [[ -n ${DATA:-} ]]; then title=${TITLE:-$(basename "$data")}; else title=${TITLE:-Fashion-MNIST 784-256-128-10}; fi
echo "locus-train, $title, $epochs epochs; medians over epochs 2..$epochs"
awk -F'\t' 'NR == 1 {printf "%-7s %-5s %6s %6s %-6s %-8s %11s %9s %9s  %s\n", "backend", "prec", "batch",
                     "cache", "graphs", "status", "samples/s", "data wait", "epoch1 s", "note"; next}
            {w = ($8 == "-") ? "-" : sprintf("%.1f%%", 100 * $8)
             printf "%-7s %-5s %6s %6s %-6s %-8s %11s %9s %9s  %s\n", $1, $2, $3, $4, $5, $6, $7, w, $10, substr($12, 1, 90)}' "$tsv"
