#!/usr/bin/env bash
# Flat against hierarchical gradient reduction where the nodes have a network of their own:
# NODES emulated nodes x SLOTS ranks (default 2 x 2; scripts/netns-nodes.sh: shared memory
# inside a node, TCP over a veth link from each node to a bridge), the links unlimited and then
# limited by tc tbf to each RATE in both directions; locus_hier_bench at each, ROUNDS times, a
# table of the hier/flat ratios last.
#   [NODES=n] [SLOTS=s] [BASELINE=BENCH] bench/comm/run_hier_netns.sh BUILD_DIR [ROUNDS] [RATE...]
#   (default: 2 rounds; 4gbit 1gbit)
# BASELINE: another build's locus_hier_bench (e.g. of an earlier commit), run right before this
# build's at every round and rate; a second table compares the two hierarchical engines.
# Needs root (network namespaces).
set -euo pipefail
build=$(readlink -f "${1:?usage: $0 BUILD_DIR [ROUNDS] [RATE...]}")
rounds=${2:-2}
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive whole number, got '$rounds'" >&2; exit 2; }
nodes=${NODES:-2} slots=${SLOTS:-2}
[[ "$nodes" =~ ^[1-9][0-9]*$ && "$slots" =~ ^[1-9][0-9]*$ ]] || { echo "NODES and SLOTS must be positive whole numbers, got '$nodes' and '$slots'" >&2; exit 2; }
rates=(off)
for r in "${@:3}"; do [ "$r" = off ] || rates+=("$r"); done
[ ${#rates[@]} -gt 1 ] || rates+=(4gbit 1gbit)
repo=$(cd "$(dirname "$0")/../.." && pwd)
bench=$build/bench/comm/locus_hier_bench
[ -x "$bench" ] || { echo "no $bench: build the target locus_hier_bench" >&2; exit 1; }
baseline=${BASELINE:+$(readlink -f "$BASELINE")}
[ -z "$baseline" ] || [ -x "$baseline" ] || { echo "BASELINE=$BASELINE is not an executable" >&2; exit 2; }
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

dir=$(mktemp -d /tmp/lhn.XXXX)
trap 'bash "$repo/scripts/netns-nodes.sh" stop "$dir" >/dev/null 2>&1 || true; rm -rf "$dir"' EXIT
bash "$repo/scripts/netns-nodes.sh" start "$dir" --nodes "$nodes" --slots "$slots" --lifetime 3000
out=/tmp/hier-netns-$(date +%Y%m%d-%H%M%S)
mkdir -p "$out"
echo "# $(date -u +%FT%TZ) $(uname -n) $(nproc) cores, git $(git -C "$repo" rev-parse --short HEAD); raw output in $out" >&2
for round in $(seq "$rounds"); do
  for rate in "${rates[@]}"; do
    bash "$repo/scripts/netns-nodes.sh" shape "$dir" "$rate"
    # Up to 16 MiB: at 1 Gbit/s flat's 64 MiB would take about 1 s an iteration.
    for which in ${baseline:+baseline} current; do
      exe=$bench
      [ "$which" = current ] || exe=$baseline
      bash "$repo/scripts/netns-nodes.sh" mpirun "$dir" -n $((nodes * slots)) "$exe" -n 10 -e 16777216 \
        >"$out/$which-$rate-$round.txt" 2>&1 || { cat "$out/$which-$rate-$round.txt" >&2; exit 1; }
    done
    echo "round $round, link $rate: done" >&2
  done
done

# Tables: per size, the median over rounds of flat and hierarchical times (us) per rate; with
# BASELINE, the baseline's hierarchical time against this build's.
/usr/bin/python3 - "$out" "$rounds" "$nodes" "$slots" "${baseline:+yes}" "${rates[@]}" <<'PY'
import statistics, sys
out, rounds, nodes, slots = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
compare, rates = sys.argv[5] == "yes", sys.argv[6:]


def read(which):
    rows, fits, notes = {}, {}, set()
    for rate in rates:
        for r in range(1, rounds + 1):
            equal = 0
            for line in open(f"{out}/{which}-{rate}-{r}.txt"):
                f = line.split()
                if len(f) >= 9 and f[0].isdigit() and f[1] == "|":
                    rows.setdefault(int(f[0]), {}).setdefault(rate, []).append((float(f[2]), float(f[5])))
                if line.startswith("# elements where hierarchical differs"):
                    if "(bitwise equal)" not in line:
                        sys.exit(f"{which} {rate} round {r}: {line.strip()}")
                    equal += 1
                if line.startswith("# fit "):
                    fits.setdefault(rate, []).append(line.strip())
                if line.startswith("# hierarchical:"):
                    notes.add(line.strip())
            if equal != 1:
                sys.exit(f"{which} {rate} round {r}: the bench did not report the bitwise comparison")
    return rows, fits, notes


def med(v, k):
    return statistics.median(x[k] for x in v)


def cell(a, b):
    return f"{a:9.1f} {b:9.1f} {b / a:6.2f}x"


cur, fits, notes = read("current")
print(f"# flat | hierarchical median us over {rounds} round(s), {nodes * slots} ranks = {nodes} nodes x {slots}; ratio hier/flat")
for n in sorted(notes):
    print(n)
print("#  size(B) | " + " | ".join(f"{r:>28}" for r in rates))
for size in sorted(cur):
    cells = [cell(med(v, 0), med(v, 1)) if (v := cur[size].get(rate)) else "-" for rate in rates]
    print(f"{size:10d} | " + " | ".join(f"{c:>28}" for c in cells))
for rate in rates:
    for line in fits.get(rate, []):
        print(f"# {rate}: {line[2:]}")
print("# every hierarchical result bitwise equal to flat's")
if compare:
    base, _, base_notes = read("baseline")
    print()
    print(f"# hierarchical: BASELINE | this build, median us over {rounds} round(s); ratio this/baseline")
    for n in sorted(base_notes):
        print(f"# baseline {n[2:]}")
    print("#  size(B) | " + " | ".join(f"{r:>28}" for r in rates))
    for size in sorted(cur):
        cells = []
        for rate in rates:
            v, b = cur[size].get(rate), base.get(size, {}).get(rate)
            cells.append(cell(med(b, 1), med(v, 1)) if v and b else "-")
        print(f"{size:10d} | " + " | ".join(f"{c:>28}" for c in cells))
PY
