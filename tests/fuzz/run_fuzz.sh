#!/usr/bin/env bash
# Runs the libFuzzer targets of a LOCUS_FUZZ build (build-asan/, built by tests/fuzz/ci.sh or
# scripts/sanitize.sh asan --build-only locus_fuzz).
#   run_fuzz.sh BUILD_DIR [--target T] [--replay] [--seconds N]
# --replay runs every seed and regression input of each target once (deterministic) and fails
# on any crash. Otherwise each target fuzzes for N seconds (default 20) from a temporary copy
# of its seeds and regressions (the repository corpus is never written), then prints one line:
# executions, coverage (cov = edges, ft = features, libFuzzer's final stats) and crashes.
# Crash, timeout and out-of-memory inputs are kept under BUILD_DIR/fuzz-artifacts/<target>/;
# any makes the script fail. Extra libFuzzer flags: LOCUS_FUZZ_FLAGS.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
usage() { echo "usage: $0 BUILD_DIR [--target T] [--replay] [--seconds N]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
build=$(cd "$1" && pwd); shift
seconds=20 replay=0 only=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --seconds) seconds=$2; shift 2 ;;
    --target) only=$2; shift 2 ;;
    --replay) replay=1; shift ;;
    *) usage ;;
  esac
done
# Open MPI's own allocations outlive MPI_Finalize (and its dlclosed components cannot be
# named in a suppression), so leak checking is off; ASan and UBSan findings abort.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=0:abort_on_error=1:symbolize=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# -timeout: one input running 10 s is a hang; -rss_limit_mb: growth past 2 GiB is a finding.
flags=(-timeout=10 -rss_limit_mb=2048 -close_fd_mask=1 ${LOCUS_FUZZ_FLAGS:-})

targets=()
for dir in "$here"/corpus/*/; do
  t=$(basename "$dir")
  [[ -z $only || $t == "$only" ]] && targets+=("$t")
done
[[ ${#targets[@]} -gt 0 ]] || { echo "no fuzz target named '$only' (tests/fuzz/corpus/)" >&2; exit 2; }

status=0
for t in "${targets[@]}"; do
  bin=$build/tests/fuzz/$t
  [[ -x $bin ]] || { echo "$t: not built ($bin); build the locus_fuzz target" >&2; exit 2; }
  inputs=()
  for d in "$here/corpus/$t" "$here/regressions/$t"; do
    [[ -d $d ]] && while IFS= read -r -d '' f; do inputs+=("$f"); done < <(find "$d" -type f -print0 | sort -z)
  done
  if [[ $replay == 1 ]]; then
    if "$bin" "${flags[@]}" "${inputs[@]}" > "$build/fuzz-$t.log" 2>&1; then
      printf '%-22s replay: %d inputs, 0 crashes\n' "$t" "${#inputs[@]}"
    else
      echo "$t: replay FAILED (log: $build/fuzz-$t.log):"; tail -40 "$build/fuzz-$t.log"; status=1
    fi
    continue
  fi
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
  mkdir -p "$work/corpus" "$work/artifacts"
  [[ ${#inputs[@]} -gt 0 ]] && cp "${inputs[@]}" "$work/corpus/" 2> /dev/null || true
  rc=0
  "$bin" "${flags[@]}" -max_total_time="$seconds" -print_final_stats=1 \
    -artifact_prefix="$work/artifacts/" "$work/corpus" > "$build/fuzz-$t.log" 2>&1 || rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$build/fuzz-$t.log" | tail -1)
  cov=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+' "$build/fuzz-$t.log" | tail -1)
  found=$(find "$work/artifacts" -type f | wc -l)
  printf '%-22s %4ss  executions %-10s %-22s corpus %5d  crashes %d\n' "$t" "$seconds" \
    "${execs:-?}" "${cov:-cov: ?}" "$(find "$work/corpus" -type f | wc -l)" "$found"
  if [[ $rc != 0 || $found != 0 ]]; then
    mkdir -p "$build/fuzz-artifacts/$t"
    cp "$work/artifacts/"* "$build/fuzz-artifacts/$t/" 2> /dev/null || true
    echo "$t: FAILED (exit $rc); inputs in $build/fuzz-artifacts/$t, log $build/fuzz-$t.log:"
    grep -E 'ERROR|SUMMARY|locus fuzz:|runtime error' "$build/fuzz-$t.log" | head -10
    status=1
  fi
  rm -rf "$work"; trap - EXIT
done
exit $status
