#!/usr/bin/env bash
# Configures and builds locus (Release with debug info, warnings as errors) into build/, or
# $LOCUS_BUILD_DIR. Arguments before `--` go to cmake's configure step (they come after the
# defaults, so e.g. -DLOCUS_WERROR=OFF overrides); after it, the targets to build (default:
# all). Uses ccache when it is installed.
# scripts/run.sh and scripts/test.sh both call this without flags, so they share one build:
# whichever runs second only builds what the first did not. The full log goes to build.log
# (beside another build directory D, D.log: builds of two directories may run at once);
# the terminal gets one line per finished target ("[ NN%] Built target X") and, on failure,
# the log's tail.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${LOCUS_BUILD_DIR:-$root/build}
[[ $build = /* ]] || build=$root/$build
build=${build%/}  # its log is "$build.log"
cmake_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DLOCUS_WERROR=ON) targets=()
while [[ $# -gt 0 ]]; do
  if [[ $1 == -- ]]; then shift; targets=("$@"); break; fi
  cmake_args+=("$1"); shift
done
if command -v ccache > /dev/null; then
  cmake_args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
               -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
log="$build.log"
start=$SECONDS
echo "build: configuring $build (full log in $log)"
cmake -S "$root" -B "$build" "${cmake_args[@]}" > "$log" 2>&1 || { cat "$log"; exit 1; }
target_args=()
for t in "${targets[@]}"; do target_args+=(--target "$t"); done
echo "build: compiling ${targets[*]:-everything} with $(nproc) jobs"
# Make prints "[ NN%] Built target X" as each target completes, up to date or not. The log gets
# every line; the terminal those from the first target that had work to do on (an up-to-date
# build stays quiet) and a count of the files compiled.
progress() {
  local line busy=0
  compiled=0
  while IFS= read -r line; do
    printf '%s\n' "$line" >> "$log"
    case $line in
      *"] Building "*" object "*) busy=1; compiled=$((compiled + 1)) ;;
      *"] Linking "*) busy=1 ;;
      *"] Built target "*) [[ $busy -eq 0 ]] || echo "  $line" ;;
    esac
  done
  return 0
}
shopt -s lastpipe  # progress runs in this shell, so `compiled` survives the pipeline
set +o pipefail
cmake --build "$build" -j "$(nproc)" "${target_args[@]}" 2>&1 | progress
rc=${PIPESTATUS[0]}
set -o pipefail
if [[ $rc -ne 0 ]]; then
  echo "build: FAILED (exit $rc); the last 60 lines of $log:"
  tail -60 "$log"
  exit 1
fi
echo "build: ok in $((SECONDS - start)) s, $compiled files compiled ($build; log in $(basename "$log"))"
