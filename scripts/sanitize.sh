#!/usr/bin/env bash
# Builds locus with sanitizers (no CUDA) and runs tests under them, with the runtime options and
# the suppressions of tests/sanitizers/ (each says why it is there; none is for locus code).
#   scripts/sanitize.sh asan [ctest args...]   ASan + UBSan, in build-asan/
#   scripts/sanitize.sh tsan [ctest args...]   TSan, in build-tsan/
#   scripts/sanitize.sh asan --build-only [TARGET...]   configure and build only: the targets
#                                 given (tests/fuzz/ci.sh), else those of CI's selection (.ci/run)
# Without ctest args it runs the selection CI runs (below); e.g. `scripts/sanitize.sh asan -L mpi`
# or `scripts/sanitize.sh tsan -LE slurm` for the long versions (README, "Sanitizers").
# The ASan build is also the fuzz build: clang-14 with LOCUS_FUZZ (ASan + UBSan + libFuzzer's
# coverage instrumentation on every target, -O1, line tables), so CI compiles the libraries
# once for the fuzz targets and the ASan suites. Both sanitizer builds use -O1 and line tables
# only: the sanitizers find the same bugs and report file:line, and the builds take about half
# the time of -O2 -g.
# A finding fails the test that made it: ASan and TSan exit non-zero (exitcode=66) and UBSan
# aborts (-fno-sanitize-recover), and the report is in the test's output.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kind=${1:?usage: scripts/sanitize.sh asan|tsan [ctest args...]}
shift
supp=$root/tests/sanitizers
case $kind in
  asan)
    config=(-DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14 -DLOCUS_FUZZ=ON
            -DLOCUS_FUZZ_SECONDS="${LOCUS_FUZZ_SECONDS:-20}")
    # The unit and MPI suites of the libraries: parsers, HDF5 round trips, the reducer, the
    # loader, checkpoints, the model and optimizers, inference; and test_cuda_refusal, since
    # this build is also CI's build without CUDA (train.backend = cuda must be refused there).
    targets=(locus_no_dlclose test_comm test_reducer test_hier_reducer test_link test_watchdog test_work_queue
             test_h5 test_sources test_raw_io test_row_reader test_ingest test_loader test_checkpoint
             test_train_model test_train_optim test_monitor test_telemetry test_scorer
             test_cuda_refusal)
    select=(-R '^(test_comm|test_reducer|test_hier_reducer|test_link|test_watchdog|test_work_queue|test_h5|test_sources|test_raw_io|test_row_reader|test_ingest|test_loader|test_checkpoint|test_train_model|test_train_optim|test_monitor|test_telemetry|test_scorer|test_cuda_refusal)(\.np[12])?$')
    # fast_unwind_on_malloc=0: Open MPI is built without frame pointers, and only full unwinding
    # attributes its allocations to it (else a leak may show a broken stack, unsuppressible).
    export ASAN_OPTIONS="detect_leaks=1:exitcode=66:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1:fast_unwind_on_malloc=0"
    preload=libno_dlclose
    export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=0"
    export UBSAN_OPTIONS="suppressions=$supp/ubsan.supp:print_stacktrace=1:halt_on_error=1"
    ;;
  tsan)
    config=(-DLOCUS_SANITIZE=thread "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
            "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG")
    # The threads of locus: the loader's producer, the asynchronous checkpointer, the infer
    # compute thread and its reader ring, the parallel row reader, the progress watchdog; the
    # trainer reading the batches the producer shows ahead (test_trainer_prefetch); and the
    # model of the NCCL stage link's channels, a thread each (test_pipeline, 2 and 4 ranks).
    targets=(test_loader test_checkpoint test_checkpoint_resume test_pipeline_parts test_watchdog
             test_row_reader test_trainer_prefetch test_pipeline)
    select=(-R '^(test_loader|test_checkpoint|test_checkpoint_resume|test_pipeline_parts|test_watchdog|test_trainer_prefetch)\.np[12]$|^test_pipeline\.np[24]$|^test_row_reader$')
    preload=""
    export TSAN_OPTIONS="suppressions=$supp/tsan.supp:exitcode=66:halt_on_error=0:second_deadlock_stack=1:history_size=4"
    ;;
  *)
    echo "scripts/sanitize.sh: unknown kind '$kind': use asan or tsan" >&2
    exit 2
    ;;
esac
build=$root/build-$kind
# Single-threaded BLAS (its pool is not instrumented) and Open MPI as in the other tests.
export OPENBLAS_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
build_only=0
if [[ ${1:-} == --build-only ]]; then build_only=1; shift; (($# == 0)) || targets=("$@")
elif (($# > 0)); then select=("$@"); targets=(); fi
LOCUS_BUILD_DIR=$build "$root/scripts/build.sh" -DLOCUS_WITH_CUDA=OFF "${config[@]}" \
  -DLOCUS_WERROR=ON -DLOCUS_BUILD_BENCH=OFF -- "${targets[@]}"
((build_only == 0)) || exit 0
cd "$build"
if [[ -n $preload ]]; then
  lib=$(find "$build/tests" -name "liblocus_no_dlclose.so" | head -n 1)
  [[ -n $lib ]] || { echo "scripts/sanitize.sh: liblocus_no_dlclose.so was not built" >&2; exit 1; }
  export LD_PRELOAD=$lib
fi
ctest -j "$(nproc)" --output-on-failure "${select[@]}"
