#!/usr/bin/env bash
# Line and function coverage of locus's code (lib/, apps/) by its CPU test suite: builds with
# -DLOCUS_COVERAGE=ON (cmake/LocusCoverage.cmake) into build-cov/ (no CUDA: GPU code is tested on
# a GPU only; -O1 so that lines map to code), zeroes the counters, runs ctest, and reports with
# gcovr.
#   scripts/coverage.sh                  the whole suite but the gpu label (16 minutes here
#                                        with the build, 10 of them ctest); the figures in
#                                        docs/RELIABILITY.md, "Coverage"
#   scripts/coverage.sh -R ingest        ctest arguments instead of `-LE gpu`
#   scripts/coverage.sh --report-only    the report of the counters already there
# It prints a table last: lines and functions run, per library and for the apps. The detail,
# file by file and line by line, is build-cov/coverage/index.html; build-cov/coverage/summary.json
# holds the per-file figures. Counts from every process: the apps started by the Python and
# Slurm tests write theirs at exit as the test binaries do, and a rank that ends the job
# (mpi::abort) before its MPI_Abort; the peers MPI_Abort kills, and a SIGKILLed rank, write none.
# Not in CI (the suite a second time, instrumented): the long versions, README "Two commands".
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$root/build-cov
out=$build/coverage
command -v gcovr > /dev/null || apt-get install -y -q gcovr > /dev/null

report_only=0
select=(-LE gpu)
if [[ ${1:-} == --report-only ]]; then report_only=1
elif (($# > 0)); then select=("$@"); fi

if ((report_only == 0)); then
  LOCUS_BUILD_DIR=$build "$root/scripts/build.sh" -DLOCUS_WITH_CUDA=OFF -DLOCUS_BUILD_BENCH=OFF \
    -DLOCUS_COVERAGE=ON "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG" \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g -DNDEBUG"
  find "$build" -name '*.gcda' -delete
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # A failed test still leaves its counts; the report is made either way and the exit code is
  # ctest's.
  set +e
  (cd "$build" && ctest -j "$(nproc)" --output-on-failure "${select[@]}")
  status=$?
  set -e
else
  status=0
fi

mkdir -p "$out"
# Headers count where they are (lib/*/include); the tests and benchmarks are not what is measured.
# Branch figures are left out: with exceptions, gcc's branches are mostly the throw paths'
# unwinding, which no test could take one by one.
gcovr --root "$root" --object-directory "$build" -j "$(nproc)" \
  --filter "$root/lib/" --filter "$root/apps/" --exclude-directories "$build/CMakeFiles" \
  --json-summary "$out/summary.json" --json-summary-pretty \
  --html-details "$out/index.html" --html-title "locus: coverage by the CPU test suite" > /dev/null
/usr/bin/python3 - "$out/summary.json" <<'EOF'
import json, sys
files = json.load(open(sys.argv[1]))["files"]
groups = {}
for f in files:
    parts = f["filename"].split("/")
    key = "/".join(parts[:2]) if parts[0] == "lib" else parts[0]
    g = groups.setdefault(key, [0, 0, 0, 0, 0])
    g[0] += f["line_covered"]; g[1] += f["line_total"]
    g[2] += f["function_covered"]; g[3] += f["function_total"]; g[4] += 1
total = [sum(g[i] for g in groups.values()) for i in range(5)]
pct = lambda a, b: 100.0 * a / b if b else 100.0
print(f"{'code':<12} {'files':>5} {'lines run':>17} {'functions run':>17}")
for key in sorted(groups) + ["all"]:
    g = total if key == "all" else groups[key]
    print(f"{key:<12} {g[4]:>5} {g[0]:>7}/{g[1]:<6} {pct(g[0], g[1]):5.1f}% "
          f"{g[2]:>5}/{g[3]:<5} {pct(g[2], g[3]):5.1f}%")
EOF
echo "coverage: detail in $out/index.html"
exit "$status"
