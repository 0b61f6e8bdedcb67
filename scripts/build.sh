#!/usr/bin/env bash
# Configures and builds locus (Release with debug info) into build/, or $LOCUS_BUILD_DIR.
# Arguments before `--` go to cmake's configure step; after it, the targets to build (default:
# all). Uses ccache when it is installed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${LOCUS_BUILD_DIR:-$root/build}
[[ $build = /* ]] || build=$root/$build
cmake_args=() targets=()
while [[ $# -gt 0 ]]; do
  if [[ $1 == -- ]]; then shift; targets=("$@"); break; fi
  cmake_args+=("$1"); shift
done
if command -v ccache > /dev/null; then
  cmake_args+=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
               -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
log="$root/build.log"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo "${cmake_args[@]}" > "$log" 2>&1 ||
  { cat "$log"; exit 1; }
target_args=()
for t in "${targets[@]}"; do target_args+=(--target "$t"); done
cmake --build "$build" -j "$(nproc)" "${target_args[@]}" >> "$log" 2>&1 ||
  { tail -60 "$log"; exit 1; }
echo "build: ok ($build; log in build.log)"
