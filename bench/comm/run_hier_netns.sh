#!/usr/bin/env bash
# Flat against hierarchical gradient reduction where the nodes have a network of their own:
# 2 emulated nodes x 2 ranks (scripts/netns-nodes.sh: shared memory inside a node, TCP over a
# veth link between the nodes), the link unlimited and then limited by tc tbf to each RATE in
# both directions; locus_hier_bench at each, ROUNDS times, a table of the hier/flat ratios last.
#   bench/comm/run_hier_netns.sh BUILD_DIR [ROUNDS] [RATE...]   (default: 2 rounds; 4gbit 1gbit)
# Needs root (network namespaces).
set -euo pipefail
build=$(readlink -f "${1:?usage: $0 BUILD_DIR [ROUNDS] [RATE...]}")
rounds=${2:-2}
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive whole number, got '$rounds'" >&2; exit 2; }
rates=(off)
for r in "${@:3}"; do [ "$r" = off ] || rates+=("$r"); done
[ ${#rates[@]} -gt 1 ] || rates+=(4gbit 1gbit)
repo=$(cd "$(dirname "$0")/../.." && pwd)
bench=$build/bench/comm/locus_hier_bench
[ -x "$bench" ] || { echo "no $bench: build the target locus_hier_bench" >&2; exit 1; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

dir=$(mktemp -d /tmp/lhn.XXXX)
trap 'bash "$repo/scripts/netns-nodes.sh" stop "$dir" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
bash "$repo/scripts/netns-nodes.sh" start "$dir" --nodes 2 --slots 2 --lifetime 3000
out=/tmp/hier-netns-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
echo "# $(date -u +%FT%TZ) $(uname -n) $(nproc) cores, git $(git -C "$repo" rev-parse --short HEAD); raw output in $out" >&2
for round in $(seq "$rounds"); do
  for rate in "${rates[@]}"; do
    bash "$repo/scripts/netns-nodes.sh" shape "$dir" "$rate"
    # Up to 16 MiB: at 1 Gbit/s flat's 64 MiB would take about 1 s an iteration.
    bash "$repo/scripts/netns-nodes.sh" mpirun "$dir" -n 4 "$bench" -n 10 -e 16777216 \
      >"$out/$rate-$round.txt" 2>&1 || { cat "$out/$rate-$round.txt" >&2; exit 1; }
    echo "round $round, link $rate: done" >&2
  done
done

# Table: per size, the median over rounds of flat and hierarchical times (us) per rate.
/usr/bin/python3 - "$out" "$rounds" "${rates[@]}" <<'EOF'
import statistics, sys
out, rounds, rates = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = {}
fits = {}
for rate in rates:
    for r in range(1, rounds + 1):
        equal = 0
        for line in open(f"{out}/{rate}-{r}.txt"):
            f = line.split()
            if len(f) >= 9 and f[0].isdigit() and f[1] == "|":
                size = int(f[0]); flat = float(f[2]); hier = float(f[5])
                rows.setdefault(size, {}).setdefault(rate, []).append((flat, hier))
            if line.startswith("# elements where hierarchical differs"):
                if "(bitwise equal)" not in line:
                    sys.exit(f"{rate} round {r}: {line.strip()}")
                equal += 1
        if equal != 1:
            sys.exit(f"{rate} round {r}: the bench did not report the bitwise comparison")
            if line.startswith("# fit "):
                fits.setdefault(rate, []).append(line.strip())
print(f"# flat | hierarchical median us over {rounds} round(s), 4 ranks = 2 nodes x 2; ratio hier/flat")
print("#  size(B) | " + " | ".join(f"{r:>28}" for r in rates))
for size in sorted(rows):
    cells = []
    for rate in rates:
        v = rows[size].get(rate, [])
        if not v:
            cells.append("-")
            continue
        fl = statistics.median(x[0] for x in v); hi = statistics.median(x[1] for x in v)
        cells.append(f"{fl:9.1f} {hi:9.1f} {hi / fl:6.2f}x")
    print(f"{size:10d} | " + " | ".join(f"{c:>28}" for c in cells))
for rate in rates:
    for line in fits.get(rate, []):
        print(f"# {rate}: {line[2:]}")
print("# every hierarchical result bitwise equal to flat's")
EOF
