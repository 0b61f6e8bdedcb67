#!/usr/bin/env bash
# The fuzz step of CI (and the short run by hand): builds the fuzz targets with clang-14 into
# build-fuzz/ (LOCUS_FUZZ; ASan + UBSan), then ctest -L fuzz replays every seed and regression
# input once and fuzzes each target for LOCUS_FUZZ_SECONDS (default 20), two at a time.
# The long run: tests/fuzz/run_fuzz.sh build-fuzz --seconds 600 (docs/RELIABILITY.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${LOCUS_FUZZ_BUILD_DIR:-$root/build-fuzz}
LOCUS_BUILD_DIR=$build "$root/scripts/build.sh" -DCMAKE_C_COMPILER=clang-14 \
  -DCMAKE_CXX_COMPILER=clang++-14 -DLOCUS_FUZZ=ON -DLOCUS_WERROR=ON -DLOCUS_BUILD_TESTS=OFF \
  -DLOCUS_BUILD_BENCH=OFF -DLOCUS_WITH_CUDA=OFF -DLOCUS_FUZZ_SECONDS="${LOCUS_FUZZ_SECONDS:-20}" \
  -- locus_fuzz
cd "$build"
ctest -L fuzz -j 2 --output-on-failure
