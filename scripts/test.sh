#!/usr/bin/env bash
# Installs what is missing, builds with warnings as errors (scripts/build.sh's default, the same
# build as scripts/run.sh's, so after it only what it did not build is compiled), and runs the
# whole test suite (unit, MPI at 1/2/4 ranks, end-to-end apps, Slurm). Extra args go to ctest
# (e.g. -L mpi).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/scripts/install-deps.sh"
"$root/scripts/build.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cd "$root/build"
ctest -j "$(nproc)" --output-on-failure "$@"
