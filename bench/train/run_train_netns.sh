#!/usr/bin/env bash
# locus-train across 2 emulated nodes x 2 ranks (scripts/netns-nodes.sh: shared memory inside a
# node, TCP over a link between them), train.reduction = flat against hierarchical, the link
# unlimited and then limited to each RATE: one epoch of Fashion-MNIST (configs/fashion-mnist.ini,
# MLP 784-256-128-10, global batch 128, 0.94 MB of gradients a step), the two alternating,
# ROUNDS times; a table of the median samples/s and all-reduce seconds last.
#   bench/train/run_train_netns.sh BUILD_DIR [ROUNDS] [RATE...]   (default: 3 rounds; 1gbit)
# Needs root (network namespaces) and Debian's dataset-fashion-mnist.
set -euo pipefail
build=$(readlink -f "${1:?usage: $0 BUILD_DIR [ROUNDS] [RATE...]}")
rounds=${2:-3}
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive whole number, got '$rounds'" >&2; exit 2; }
rates=(off)
for r in "${@:3}"; do [ "$r" = off ] || rates+=("$r"); done
[ ${#rates[@]} -gt 1 ] || rates+=(1gbit)
repo=$(cd "$(dirname "$0")/../.." && pwd)
nodes_sh=$repo/scripts/netns-nodes.sh
for app in locus-ingest locus-train; do
  [ -x "$build/apps/$app" ] || { echo "no $build/apps/$app: build it" >&2; exit 1; }
done
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

work=$(mktemp -d /tmp/ltn.XXXX)
trap 'bash "$nodes_sh" stop "$work/nodes" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
mkdir "$work/nodes"
bash "$nodes_sh" start "$work/nodes" --nodes 2 --slots 2 --lifetime 3000
cd "$work"
across() { bash "$nodes_sh" mpirun "$work/nodes" -n 4 "$@"; }
across "$build/apps/locus-ingest" --ingest.output=fm-train.h5 >ingest.log 2>&1 ||
  { cat ingest.log >&2; exit 1; }
out=/tmp/train-netns-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
echo "# $(date -u +%FT%TZ) $(uname -n) $(nproc) cores, git $(git -C "$repo" rev-parse --short HEAD); raw output in $out" >&2
for round in $(seq "$rounds"); do
  for rate in "${rates[@]}"; do
    bash "$nodes_sh" shape "$work/nodes" "$rate"
    for reduction in flat hierarchical; do
      log=$out/$rate-$reduction-$round.log
      across "$build/apps/locus-train" --data.train=fm-train.h5 --data.test= --train.epochs=1 \
        --train.metrics= --train.output= --checkpoint.dir= --eval.every=0 \
        --train.reduction="$reduction" >"$log" 2>&1 || { cat "$log" >&2; exit 1; }
    done
    echo "round $round, link $rate: done" >&2
  done
done

/usr/bin/python3 - "$out" "$rounds" "${rates[@]}" <<'EOF'
import re, statistics, sys
out, rounds, rates = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
pat = re.compile(r"^trained \d+ steps .* ([0-9.]+) samples/s, data wait [0-9.]+%, all-reduce ([0-9.]+) s")
print(f"# locus-train, Fashion-MNIST MLP, 1 epoch, 4 ranks = 2 nodes x 2; median of {rounds} round(s)")
print(f"# {'link':>6} | {'flat samples/s':>14} {'all-reduce s':>12} | {'hier samples/s':>14} {'all-reduce s':>12} | hier/flat samples/s")
for rate in rates:
    cells = {}
    for red in ("flat", "hierarchical"):
        sps, ar = [], []
        for r in range(1, rounds + 1):
            m = [pat.match(l) for l in open(f"{out}/{rate}-{red}-{r}.log")]
            m = [x for x in m if x]
            if len(m) != 1:
                sys.exit(f"{out}/{rate}-{red}-{r}.log: no summary line")
            sps.append(float(m[0].group(1))); ar.append(float(m[0].group(2)))
        cells[red] = (statistics.median(sps), statistics.median(ar))
    f, h = cells["flat"], cells["hierarchical"]
    print(f"  {rate:>6} | {f[0]:14.0f} {f[1]:12.2f} | {h[0]:14.0f} {h[1]:12.2f} | {h[0] / f[0]:.2f}x")
EOF
