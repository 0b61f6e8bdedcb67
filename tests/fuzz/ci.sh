#!/usr/bin/env bash
# The fuzz step of CI (and the short run by hand): builds the fuzz targets into build-asan/ --
# the ASan build of scripts/sanitize.sh (clang-14, LOCUS_FUZZ: ASan + UBSan + coverage), so CI
# compiles the libraries once for both -- then ctest -L fuzz replays every seed and regression
# input once and fuzzes each target for LOCUS_FUZZ_SECONDS (default 20), two at a time.
# The long run: tests/fuzz/run_fuzz.sh build-asan --seconds 600 (docs/RELIABILITY.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
"$root/scripts/sanitize.sh" asan --build-only locus_fuzz
cd "$root/build-asan"
ctest -L fuzz -j 2 --output-on-failure
