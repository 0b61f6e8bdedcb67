#!/usr/bin/env bash
# Where a locus-train step's device time goes: Nsight Compute's duration of every kernel of a
# few steps of the Fashion-MNIST MLP (eager launches, so each kernel is seen alone; a graph
# replays the same kernels), summed per kernel name. Run on the GPU host after the locus phase
# of run_gpu.sh has ingested the dataset:
#   bench/gpu/kernel_profile.sh APPS_DIR DATASET.h5 [BATCH=128] [PRECISION=fp32]
# Prints one line per kernel name (count, total and mean microseconds) and the sum per step.
set -uo pipefail
apps=${1:?usage: kernel_profile.sh APPS_DIR DATASET.h5 [BATCH] [PRECISION]}
data=${2:?dataset}
batch=${3:-128} prec=${4:-fp32}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2> /dev/null | head -n 1)
[[ -x $ncu ]] || { echo "kernel_profile: no ncu on this host"; exit 0; }
out=$(mktemp -d)
# A window of launches well after the first steps (warm-up, cuBLASLt's first choices).
steps=60
OMPI_MCA_ess_singleton_isolated=1 timeout -k 5 120 "$ncu" --clock-control none \
  --metrics gpu__time_duration.sum,launch__grid_size,launch__block_size --csv --print-units base --launch-skip "${SKIP_LAUNCHES:-600}" \
  --launch-count "${LAUNCHES:-200}" \
  "$apps/locus-train" --data.train="$data" --data.test= --eval.every=0 --train.output= \
  --train.metrics= --train.log_every=0 --train.epochs=1 --train.max_steps="$steps" \
  --train.batch="$batch" --optim.schedule=constant --optim.warmup_steps=0 --train.backend=cuda \
  --train.precision="$prec" --loader.device_cache_mb=1024 --train.graphs=false \
  > "$out/ncu.csv" 2> "$out/ncu.err"
rc=$?
python3 - "$out/ncu.csv" "$batch" "$prec" "$rc" <<'PY'
import csv, collections, sys
path, batch, prec, rc = sys.argv[1:]
rows, grid = [], {}
with open(path) as f:
    lines = [l for l in f if l.startswith('"')]
for r in csv.DictReader(lines):
    if r.get("Metric Name") == "gpu__time_duration.sum":
        rows.append((r["Kernel Name"], float(r["Metric Value"].replace(",", "")) / 1e3))
    elif r.get("Metric Name") in ("launch__grid_size", "launch__block_size"):
        key = r["Kernel Name"].split("(")[0][:70]
        grid.setdefault(key, {})[r["Metric Name"][8:12]] = r["Metric Value"].replace(",", "")
if not rows:
    print(f"kernel_profile: ncu gave no kernel times (rc {rc})")
    sys.exit()
per = collections.defaultdict(list)
for name, us in rows:
    per[name.split("(")[0][:70]].append(us)
total = sum(us for _, us in rows)
# steps seen: the loss reduction runs once per step
steps = max(1, sum(len(v) for k, v in per.items() if "loss_total_kernel" in k))
print(f"kernel_profile: {prec} batch {batch}: {len(rows)} kernels, {total:.1f} us, "
      f"about {total / steps:.1f} us of device time per step over {steps} step(s)")
for name, v in sorted(per.items(), key=lambda kv: -sum(kv[1])):
    g = grid.get(name, {})
    print(f"  {sum(v):9.1f} us  {len(v):4d} x {sum(v) / len(v):7.2f} us  "
          f"grid {g.get('grid', '?')} x {g.get('bloc', '?')}  {name}")
PY
tail -n 3 "$out/ncu.err" | sed 's/^/  ncu: /'
rm -rf "$out"
