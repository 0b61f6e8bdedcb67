#!/usr/bin/env bash
# The whole GPU verification in one command, run on the lent GPU host from the repository root
# with the bundle that bench/common/make_gpu_bundle.sh packed here (carried by the device tool):
#   bench/gpu/run_gpu.sh .gpu-bundle
# 1. the machine: nvidia-smi -L, driver and CUDA versions, PyTorch's view of the GPU
# 2. libraries: the bundle's lib/ first; sonames the host still cannot resolve are taken from
#    lib-extra.tar.xz, the host's CUDA directories or PyTorch's nvidia/* wheels
# 3. every GPU test binary (gtest, each test's result as it ends; MPI tests at their ctest rank counts),
#    compute-sanitizer (memcheck, racecheck, synccheck, initcheck) over the kernel tests, the
#    device-side gather's bench by grid cap (locus_gather_bench, about 15 s), the NCCL tests
#    and the NCCL reducer's bench at 2 and 4 ranks on the one GPU (host-id phase), the reducer's
#    bench at 1 rank
# 4. locus-train on the GPU (gpu_train_bench.sh: Fashion-MNIST, the deep MLP, and SimpleNet on
# a synthetic file that PyTorch trains on too), 5. locus-infer on the GPU against h5py +
# PyTorch on a 1M-row file (infer_gpu_bench.py), 6. PyTorch on the GPU (torch_gpu_bench.py),
# 7. counts.py with the measured peaks, and a short summary table last.
# Without a GPU it says so, still runs the tests (they skip) and PyTorch's CPU smoke test.
# Full logs go to $OUT (the device tool returns it; default /tmp/gpu-run-out), as 8 files:
# summary.txt run.log tests.tar.gz locus.tar.gz gpu_train_bench.tsv infer_gpu_bench.tsv
# torch_gpu_bench.jsonl counts.txt. Time: soft budgets per phase (nothing new starts after
# them) and hard limits (tests 210 s, compute-sanitizer 85 s, locus 190 s, infer 150 s, PyTorch
# 170 s; the deep MLP 120 s and SimpleNet 90 s on top), all clipped by DEADLINE_S (below) so the whole run ends within it;
# where the tests need longer, run them alone (SKIP="locus torch") and the benchmarks in a
# second call:
#   TEST_BUDGET_S=180 TEST_TIMEOUT=90 APP_TEST_TIMEOUT=240   LOCUS_BUDGET_S=120 STEP_TIMEOUT=40
#   SANITIZE_BUDGET_S=60 SANITIZE_TIMEOUT=60 SANITIZE_SPECS (tool:binary[:gtest filter] ...)
#   HOSTID_BUDGET_S=240 HOSTID_TEST_TIMEOUT GATHER_TIMEOUT=60
#   TORCH_BUDGET_S=120 REDUCER_TIMEOUT=60 INFER_TIMEOUT=150 INFER_ROWS=1048576
#   SKIP may also name "sanitizer", "gather", "reducer" (both reducer benches), "reducer1" (the 1-rank one),
#   "infer", "deep", "simplenet", "hostid", "monitors", "profile"
#   SimpleNet 1024-512-10 Adam (after the deep MLP): SIMPLENET_ROWS=65536 (rows of the synthetic
#   file, 1024 features; PyTorch's simplenet trains on it too) SIMPLENET_RUNS (gpu_train_bench.sh
#   ROWS; default fp32, batch 64 and 4096, device cache and streamed) SIMPLENET_EPOCHS=10
#   SIMPLENET_BUDGET_S=30 (soft) SIMPLENET_STEP_TIMEOUT=30 SIMPLENET_TIMEOUT=60 (hard; the
#   file's writer has 30 s of its own). The cached runs hold the file in 1024 MiB of device
#   memory: beyond about 250000 rows give SIMPLENET_RUNS with a larger cache_mb.
#   LAUNCH=auto|direct|mpirun   PYTHON=python3   SKIP="tests locus torch" (phases to leave out)
#   ROWS, EPOCHS, EXTRA: passed to gpu_train_bench.sh; TORCH_ARGS: extra torch_gpu_bench.py flags
#   DEADLINE_S=570: the whole run's limit. Every phase's limits are clipped so that the summary
#   (20 s kept for it) is printed before it; a phase that would start with under 30 s left is
#   not run. Give what the device session has left (its per-command limit is 600 s).
set -uo pipefail
t_start=$SECONDS
deadline=${DEADLINE_S:-570}
here=$(cd "$(dirname "$0")" && pwd)
repo=$PWD  # run from the repository root: tests/apps/ are read from here
bundle=$(cd "${1:?usage: bench/gpu/run_gpu.sh BUNDLE_DIR}" 2> /dev/null && pwd) ||
  { echo "run_gpu.sh: no bundle at ${1-} (pack it with bench/common/make_gpu_bundle.sh and name it in the device call's carry)" >&2; exit 2; }
[[ -f $bundle/bin.tar.xz || -d $bundle/apps ]] ||
  { echo "run_gpu.sh: $bundle holds neither bin.tar.xz nor apps/: not a bundle of make_gpu_bundle.sh" >&2; exit 2; }
out=${OUT:-/tmp/gpu-run-out}
mkdir -p "$out"
work=$(mktemp -d /tmp/gpu-run.XXXXXX)
py=${PYTHON:-python3}
# make_gpu_bundle.sh packs the binaries and libraries (apps/ tests/ bench/ lib/) in one archive:
# unpacked into this run's scratch directory beside links to the rest of the bundle, which is
# never written to (tar's xz, else Python's).
if [[ -f $bundle/bin.tar.xz ]]; then
  view=$work/bundle
  mkdir -p "$view"
  tar -C "$view" -xJf "$bundle/bin.tar.xz" 2> /dev/null ||
    "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$bundle/bin.tar.xz" "$view" ||
    { echo "run_gpu.sh: cannot unpack $bundle/bin.tar.xz" >&2; exit 1; }
  for f in "$bundle"/*; do
    [[ $f == */bin.tar.xz || -e $view/${f##*/} ]] || ln -s "$f" "$view/"
  done
  bundle=$view
fi
skip=" ${SKIP:-} "
log=$out/run.log
: > "$log"
say() { echo "$*" | tee -a "$log"; }
section() { say ""; say "=== $* ($((SECONDS - t_start)) s)"; }
# left: seconds until the deadline, less the 20 s kept for the summary
left() { echo $((deadline - 20 - (SECONDS - t_start))); }
# clip T: T seconds, or what is left before the deadline where that is less (at least 5)
clip() {
  local l
  l=$(left)
  if ((l < $1)); then echo $((l < 5 ? 5 : l)); else echo "$1"; fi
}
# late: true, and says so, where too little is left before the deadline to start a phase
late() {
  (($(left) >= 30)) && return 1
  say "not run: the run's deadline (DEADLINE_S=$deadline) is near, $((SECONDS - t_start)) s gone"
}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1
export OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1

section "machine"
gpu=0
if command -v nvidia-smi > /dev/null && timeout -k 5 60 nvidia-smi -L >> "$work/smi" 2>&1; then
  gpu=1
  tee -a "$log" < "$work/smi"
  timeout -k 5 60 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit \
    --format=csv 2>&1 | tee -a "$log"
  timeout -k 5 60 nvidia-smi 2>&1 | grep -m1 'CUDA Version' | tee -a "$log"
else
  say "no GPU: nvidia-smi is missing or sees no device ($(head -n 1 "$work/smi" 2> /dev/null));" \
      "running what needs none (tests skip their cases; PyTorch smoke test on the CPU)"
fi
command -v nvcc > /dev/null && nvcc --version | tail -n 2 | tee -a "$log"
timeout -k 5 90 "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")' 2>&1 | tee -a "$log"
command -v mpirun > /dev/null && mpirun --version 2>&1 | head -n 1 | tee -a "$log"
say "bundle: $(head -n 1 "$bundle/MANIFEST" 2> /dev/null)"
say "host: $(uname -r), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"

section "libraries"
fill=$work/libfill
mkdir -p "$fill"
cuda_dirs=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-*/lib64 2> /dev/null | tr '\n' ':')
export LD_LIBRARY_PATH=$bundle/lib:$fill:${cuda_dirs}${LD_LIBRARY_PATH:-}
bins=$(find "$bundle/apps" "$bundle/tests" "$bundle/bench" -type f -perm -u+x 2> /dev/null)
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2> /dev/null)
# Libraries the binaries open at run time (not in ldd's list): cuBLASLt (lib/train/src/cuda/
# cublaslt_api.hpp). Named here when no directory of LD_LIBRARY_PATH holds them.
dlopened_missing() {
  local so d found
  for so in libcublasLt.so.13; do
    found=""
    for d in ${LD_LIBRARY_PATH//:/ }; do [[ -e $d/$so ]] && { found=1; break; }; done
    [[ -n $found ]] || echo "$so"
  done
}
for _ in 1 2 3; do  # a soname found may need others
  notfound=$( (for b in $bins; do ldd "$b" 2> /dev/null; done | awk '/not found/ {print $1}'
               dlopened_missing) | sort -u)
  [[ -z $notfound ]] && break
  if [[ ! -d $work/lib-extra && -f $bundle/lib-extra.tar.xz ]]; then
    mkdir -p "$work/lib-extra"
    tar -C "$work/lib-extra" -xJf "$bundle/lib-extra.tar.xz" 2> /dev/null ||
      "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$bundle/lib-extra.tar.xz" "$work/lib-extra" ||
      say "cannot unpack $bundle/lib-extra.tar.xz"
  fi
  for so in $notfound; do
    src=""
    for d in "$work/lib-extra" ${cuda_dirs//:/ } "$site"/nvidia/*/lib "$site"/nvidia/*/*/lib; do
      [[ -e $d/$so ]] && { src=$d/$so; break; }
    done
    [[ -n $src ]] && ln -sf "$src" "$fill/$so" && say "library $so: $src"
  done
done
notfound=$( (for b in $bins; do ldd "$b" 2> /dev/null; done | awk '/not found/ {print $1}'
             dlopened_missing) | sort -u)
[[ -n $notfound ]] && say "UNRESOLVED libraries (binaries needing them cannot start): $notfound"
say "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"

# run_mpi RANKS TIMEOUT CMD... : one rank directly (singleton MPI), several under mpirun
run_mpi() {
  local n=$1 t=$2; shift 2
  if ((n == 1)) && [[ ${LAUNCH:-auto} != mpirun ]]; then
    OMPI_MCA_ess_singleton_isolated=1 timeout -k 5 "$t" "$@"
  else
    timeout -k 5 "$t" mpirun --allow-run-as-root --oversubscribe --bind-to none -n "$n" "$@"
  fi
}

# record_gtest NAME RANKS RC LOG START: a gtest binary's totals (the MPI test main prints rank
# 0's, gathered over all ranks) as a row of tests.tsv, its log into run.log, a line on screen.
# A binary killed at its limit prints no totals: the tests that ended before are counted.
record_gtest() {
  local name=$1 ranks=$2 rc=$3 tl=$4 start=$5 p f k st=ok
  p=$(grep -m1 -oP '\[  PASSED  \] \K[0-9]+' "$tl" || echo 0)
  f=$(grep -m1 -oP '\[  FAILED  \] \K[0-9]+(?= tests?,)' "$tl" || echo 0)
  k=$(grep -m1 -oP '\[  SKIPPED \] \K[0-9]+(?= tests?[,.])' "$tl" || echo 0)
  if ! grep -q '^\[==========\] .* ran\.' "$tl"; then
    p=$(grep -c '^\[       OK \] ' "$tl")
    f=$(grep -cP '^\[  FAILED  \] \S+ \([0-9]+ ms\)$' "$tl")
    k=$(grep -cP '^\[  SKIPPED \] \S+ \([0-9]+ ms\)$' "$tl")
  fi
  ((rc != 0)) && st="rc=$rc"
  ((rc == 124 || rc == 137)) && st=timeout
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$ranks" "$st" "$p" "$f" "$k" "$((SECONDS - start))" >> "$tests_tsv"
  { echo "--- $name (ranks $ranks, rc $rc)"; cat "$tl"; } >> "$log"
  say "$name: $st, passed $p failed $f skipped $k"
}

# record_script NAME RANKS RC LOG START: an app test script's totals ('N passed, N failed';
# exit 77 where it skips), as record_gtest.
record_script() {
  local name=$1 ranks=$2 rc=$3 tl=$4 start=$5 p f k=0 st=ok
  p=$(grep -m1 -oP '^\K[0-9]+(?= passed, [0-9]+ failed)' "$tl" || echo 0)
  f=$(grep -m1 -oP '^[0-9]+ passed, \K[0-9]+(?= failed)' "$tl" || echo 0)
  if ! grep -qP '^[0-9]+ passed, [0-9]+ failed' "$tl"; then  # killed: the cases that ended
    p=$(grep -c '^\[ OK \] ' "$tl")
    f=$(grep -c '^\[FAIL\] ' "$tl")
  fi
  ((rc == 77)) && { k=1; st=skipped; }
  ((rc != 0 && rc != 77)) && st="rc=$rc"
  ((rc == 124 || rc == 137)) && st=timeout
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$ranks" "$st" "$p" "$f" "$k" "$((SECONDS - start))" >> "$tests_tsv"
  { echo "--- $name (ranks $ranks, rc $rc)"; cat "$tl"; } >> "$log"
  say "$name: $st, passed $p failed $f"
}

section "GPU tests"
tests_tsv=$work/tests.tsv
printf 'test\tranks\tstatus\tpassed\tfailed\tskipped\tseconds\n' > "$tests_tsv"
mkdir -p "$work/tests"
if [[ $skip == *" tests "* ]]; then
  say "skipped (SKIP)"
elif [[ ! -s $bundle/tests/manifest.tsv ]]; then
  say "no GPU test binaries in the bundle (none built yet?)"
else
  # ctest's environment for the tests (LOCUS_TEST_ENV): the bundle stands in for the build
  # directory (apps/ at its top), the repository root is the source directory; each test runs
  # in a scratch directory, as ctest runs it in its build folder.
  export LOCUS_SOURCE_DIR=$PWD LOCUS_BINARY_DIR=$bundle OMPI_MCA_rmaps_base_oversubscribe=1
  mkdir -p "$work/scratch"
  t0=$SECONDS
  while IFS=$'\t' read -r name bin ranks; do
    tl=$work/tests/$name.log
    if ((SECONDS - t0 > ${TEST_BUDGET_S:-180} || $(left) < 20)); then
      printf '%s\t%s\tnot run\t-\t-\t-\t-\n' "$name" "$ranks" >> "$tests_tsv"; continue
    fi
    s=$SECONDS
    if [[ $bin == script:* ]]; then
      # An app test (tests/apps/NAME.py BINDIR RANKS, from this repository) on the bundle's
      # apps; it prints 'N passed, N failed' and exits 77 where it skips.
      left=$((${TEST_BUDGET_S:-180} + 30 - (SECONDS - t0)))
      tmax=${APP_TEST_TIMEOUT:-240}
      ((left < tmax)) && tmax=$((left < 30 ? 30 : left))
      tmax=$(clip "$tmax")
      (cd "$work/scratch" && LOCUS_MPIEXEC=mpirun timeout -k 5 "$tmax" \
         "$py" "$LOCUS_SOURCE_DIR/tests/apps/${bin#script:}" "$bundle/apps" "$ranks") \
        > "$tl" 2>&1 < /dev/null
      record_script "$name" "$ranks" "$?" "$tl" "$s"
      continue
    fi
    xml=()
    ((ranks == 1)) && xml=(--gtest_output=xml:"$work/tests/$name.xml")
    # shellcheck disable=SC2094
    # the per-test limit shrinks so that the phase ends within its budget + 30 s
    left=$((${TEST_BUDGET_S:-180} + 30 - (SECONDS - t0)))
    tmax=${TEST_TIMEOUT:-90}
    ((left < tmax)) && tmax=$((left < 20 ? 20 : left))
    tmax=$(clip "$tmax")
    (cd "$work/scratch" && run_mpi "$ranks" "$tmax" "$bundle/tests/$bin" --gtest_brief=0 \
       --gtest_color=no "${xml[@]}") > "$tl" 2>&1 < /dev/null
    rc=$?
    # Never got to gtest (no "[==========] Running" line; a timeout, a hang, is not retried):
    # the singleton MPI start may be what failed; once more under mpirun, within what is left
    # of the budget.
    if ((rc != 0 && rc != 124 && rc != 137 && ranks == 1)) && [[ ${LAUNCH:-auto} == auto ]] &&
       ! grep -q '^\[==========\]' "$tl"; then
      mv "$tl" "$tl.direct"
      left=$((${TEST_BUDGET_S:-180} + 30 - (SECONDS - t0)))
      ((left < tmax)) && tmax=$((left < 20 ? 20 : left))
      tmax=$(clip "$tmax")
      (cd "$work/scratch" && LAUNCH=mpirun run_mpi 1 "$tmax" "$bundle/tests/$bin" --gtest_brief=0 \
         --gtest_color=no "${xml[@]}") > "$tl" 2>&1 < /dev/null
      rc=$?
      { echo "(direct start failed, output:)"; cat "$tl.direct"; } >> "$tl"
    fi
    record_gtest "$name" "$ranks" "$rc" "$tl" "$s"
  done < "$bundle/tests/manifest.tsv"
fi
tar -C "$work" -czf "$out/tests.tar.gz" tests tests.tsv 2> /dev/null

section "compute-sanitizer over the kernel tests"
# The GPU tests check values; compute-sanitizer checks what they cannot see: a read or write
# out of bounds that lands in memory nobody compares (memcheck), a read of device memory never
# written (initcheck), a shared-memory race (racecheck), a barrier not every thread reaches
# (synccheck). memcheck and initcheck check every kernel, cuBLASLt's too: a wrong leading
# dimension or size that locus passes faults inside the library's kernel. racecheck and
# synccheck check locus's kernels only (their names hold the namespace `locus`): the library's
# shared-memory protocols are its own. Entries tool:binary[:gtest filter], in order, under a
# soft budget (SANITIZE_BUDGET_S, default 60 s: nothing starts after it) and a limit per entry
# (SANITIZE_TIMEOUT, default 60 s, shrunk to end within the budget + 20 s). SANITIZE_SPECS
# replaces the list. A row per entry in sanitizer.tsv: the errors it reported, how many of them
# were failed CUDA API calls (locus tolerates some on purpose: a refused cudaHostRegister falls
# back to a copy), and the first finding -- the first that is not an API call's where any is.
san_tsv=$work/sanitizer.tsv
printf 'tool\tbinary\tstatus\terrors\tapi\tpassed\tfailed\tseconds\tfirst\n' > "$san_tsv"
san_specs=${SANITIZE_SPECS:-"memcheck:test_cuda_kernels memcheck:test_infer_cuda_kernels
  racecheck:test_cuda_kernels synccheck:test_cuda_kernels initcheck:test_cuda_kernels
  initcheck:test_infer_cuda_kernels
  memcheck:test_cuda_trainer:*Fp32Matches*:*UnalignedLayerSlices*:*DeviceCacheAndDeviceGather*:*OddAndWideRows*:*ResumeOnTheGpu*"}
san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer \
        /usr/local/cuda-*/bin/compute-sanitizer 2> /dev/null | head -n 1)
if [[ $skip == *" sanitizer "* ]]; then
  say "skipped (SKIP)"
elif [[ -z $san ]]; then
  say "no compute-sanitizer on this host: not run"
elif ! ((gpu)); then
  say "no GPU: not run"
elif late; then
  :
else
  say "$("$san" --version 2> /dev/null | grep -m1 -i version)"
  mkdir -p "$work/scratch"
  t0=$SECONDS sb=${SANITIZE_BUDGET_S:-60} k=0
  set -f  # the gtest filters hold '*'
  for spec in $san_specs; do
    k=$((k + 1))
    set +f
    IFS=: read -r tool bin filter <<< "$spec"
    [[ -x $bundle/tests/$bin ]] || continue
    if ((SECONDS - t0 > sb || $(left) < 20)); then
      printf '%s\t%s\tnot run\t-\t-\t-\t-\t-\t-\n' "$tool" "$bin" >> "$san_tsv"; continue
    fi
    limit=${SANITIZE_TIMEOUT:-60}
    rest=$((sb + 20 - (SECONDS - t0)))
    ((rest < limit)) && limit=$((rest < 20 ? 20 : rest))
    limit=$(clip "$limit")
    scope=()
    [[ $tool == racecheck || $tool == synccheck ]] && scope=(--kernel-name kns=locus)
    tl=$work/tests/sanitize-$k-$tool-$bin.log s=$SECONDS
    (cd "$work/scratch" && OMPI_MCA_ess_singleton_isolated=1 timeout -k 5 "$limit" \
       "$san" --tool "$tool" --error-exitcode 86 --print-limit 20 "${scope[@]}" \
       "$bundle/tests/$bin" --gtest_brief=0 --gtest_color=no ${filter:+"--gtest_filter=$filter"}) \
      > "$tl" 2>&1 < /dev/null
    rc=$?
    # memcheck, initcheck, synccheck: "ERROR SUMMARY: N errors"; racecheck: "RACECHECK SUMMARY:
    # N hazards displayed (E errors, W warnings)", whose errors count here.
    errors=$(grep -m1 -oP '(ERROR SUMMARY: |RACECHECK SUMMARY: .*\()\K[0-9]+(?= errors?)' "$tl" || echo '?')
    api=$(grep -cP '^========= Program hit .* on CUDA API call' "$tl")
    passed=$(grep -c '^\[       OK \] ' "$tl")
    failed=$(grep -cP '^\[  FAILED  \] \S+ \([0-9]+ ms\)$' "$tl")
    quiet='COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|Target application'
    first=$(grep -m1 -A1 -P "^========= (?!$quiet|Program hit .* on CUDA API call)\\S" "$tl")
    [[ -n $first ]] || first=$(grep -m1 -A1 -P "^========= (?!$quiet)\\S" "$tl")
    first=$(sed 's/^=========  *//' <<< "$first" | tr '\n' ' ' | cut -c1-160)
    st=ok
    ((rc == 86)) && st=findings
    ((rc == 86)) && [[ $errors == "$api" ]] && st=api-calls
    ((rc != 0 && rc != 86)) && st="rc=$rc"
    ((rc == 124 || rc == 137)) && st=timeout
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$tool" "$bin" "$st" "$errors" "$api" "$passed" \
      "$failed" "$((SECONDS - s))" "${first:--}" >> "$san_tsv"
    { echo "--- compute-sanitizer --tool $tool $bin ${filter:+($filter)} (rc $rc)"; cat "$tl"; } >> "$log"
    say "$tool $bin: $st, errors $errors ($api failed API calls), tests passed $passed failed $failed, $((SECONDS - s)) s"
  done
  set +f
fi
cp "$san_tsv" "$work/tests/" 2> /dev/null
tar -C "$work" -czf "$out/tests.tar.gz" tests tests.tsv 2> /dev/null

section "device-side gather from mapped host memory (locus_gather_bench)"
gather_table=$work/gather_bench.txt
if [[ $skip == *" gather "* ]]; then
  say "skipped (SKIP)"
elif [[ ! -x $bundle/bench/locus_gather_bench ]]; then
  say "not in the bundle (a build without CUDA?)"
elif late; then
  :
elif ((gpu)); then
  timeout -k 5 "$(clip "${GATHER_TIMEOUT:-60}")" "$bundle/bench/locus_gather_bench" > "$gather_table" 2>&1 < /dev/null
  say "rc $?"
  tee -a "$log" < "$gather_table"
else
  say "no GPU: not run"
fi

section "NCCL with 2 ranks on one GPU (a host id per rank: test device only)"
# The phase's entries, binary:ranks:seconds[:gtest filter[:tcp]] (an app test script as
# NAME.py:ranks:seconds; the loop below says what each covers).
hostid_specs="test_nccl_reducer:2:90 test_nccl_link:2:90 test_train_nccl_app.py:2:90
  test_cuda_pipeline:2:150 test_cuda_pipeline:2:60:*EagerLimit*:tcp test_nccl_link:4:90
  test_cuda_pipeline:4:150:*NcclLink* test_cuda_trainer:2:150"
# hostid_name SPEC: the entry's row name in tests.tsv ("" where the bundle lacks it)
hostid_name() {
  local t n limit filter transport
  IFS=: read -r t n limit filter transport <<< "$1"
  if [[ $t == *.py ]]; then
    [[ -f $repo/tests/apps/$t ]] || return 0
    t=app_${t#test_}
    echo "${t%_app.py}.hostid.np$n"
  else
    [[ -x $bundle/tests/$t ]] || return 0
    echo "$t.hostid${transport:+-$transport}.np$n"
  fi
}
# hostid_unrun STATUS: a row per entry that did not run, so that the summary counts it
hostid_unrun() {
  local spec name
  set -f
  for spec in $hostid_specs; do
    name=$(hostid_name "$spec")
    [[ -n $name ]] && printf '%s\t%s\t%s\t-\t-\t-\t-\n' "$name" "$(cut -d: -f2 <<< "$spec")" "$1" >> "$tests_tsv"
  done
  set +f
}
# NCCL refuses two ranks of one communicator on one GPU; with its own NCCL_HOSTID and the socket
# transport each rank looks like another node (hostid_rank.sh). First PyTorch's NCCL without and
# with the trick, then, where it works, locus's NCCL reducer, stage link and trainers through it.
if [[ $skip == *" hostid "* ]]; then
  say "skipped (SKIP)"
elif late; then
  ((gpu)) && hostid_unrun deadline
elif ((gpu)); then
  # A soft budget (HOSTID_BUDGET_S, default 240 s) as in the tests phase, from the probe on:
  # nothing starts after it, and each limit shrinks so that the phase ends within it + 30 s (at
  # least 30 s each). The probe tries the trick alone (PyTorch's refusal of two ranks on one GPU
  # without it was shown in run 1; HOSTID_PROBE_PLAIN=1 tries that too).
  t0=$SECONDS hb=${HOSTID_BUDGET_S:-240}
  probe_cases=hostid
  [[ ${HOSTID_PROBE_PLAIN:-0} == 1 ]] && probe_cases=plain,hostid
  timeout -k 5 "$(clip "${HOSTID_TIMEOUT:-60}")" "$py" "$here/nccl_hostid_probe.py" --timeout 40 \
    --cases "$probe_cases" 2>&1 | tee -a "$log" | tee "$work/hostid.log"
  if grep -q '^nccl_hostid hostid ok' "$work/hostid.log"; then
    mkdir -p "$work/scratch"
    # First (about 10 s; the entries below may spend the whole budget) the host's cost of
    # enqueueing each NCCL call at 2 ranks (world size 1 takes a shortcut): the reducer's
    # non-blocking communicator against a blocking one. The device times of this run are those
    # of sockets between two processes on one GPU: not figures of a real link.
    # SKIP="reducer" leaves it out (SKIP="reducer1" the 1-rank bench below only).
    limit=$(clip "${REDUCER_TIMEOUT:-60}")
    if [[ $skip == *" reducer "* ]]; then
      say "locus_nccl_reducer_bench at 2 ranks (host ids): skipped (SKIP)"
    elif [[ -x $bundle/bench/locus_nccl_reducer_bench ]]; then
      (cd "$work/scratch" && run_mpi 2 "$limit" "$here/hostid_rank.sh" \
         "$bundle/bench/locus_nccl_reducer_bench" --min-bytes 65536 --max-bytes 1048576 --iters 10) \
        > "$work/nccl_reducer_hostid.txt" 2>&1 < /dev/null
      say "locus_nccl_reducer_bench at 2 ranks (host ids): rc $?"
      tee -a "$log" < "$work/nccl_reducer_hostid.txt"
    fi
    # The NCCL reducer and stage link; locus-train over the NCCL reducer with a rank killed or
    # stopped in it (an app test script: NAME.py:ranks:seconds); the pipeline trainers over the
    # link (2 stages: NCCL link
    # bitwise the host-staged one; every pipeline test there goes through NCCL, three
    # communicators per trainer over sockets, hence the longer limit); the pipeline's labels
    # past MPI's eager limit once more with MPI over TCP (a send left pending there needs its
    # rank's progress); the link as a 4-rank pipeline, and the trainer over it with 4 stages and
    # with 2 stages x 2 replicas (the link beside the NCCL reducer); last the whole-model
    # trainer over the NCCL reducer (run 1 passed its first 5 tests that way; dropped first).
    # Each entry: binary:ranks:seconds[:gtest filter[:tcp]] (HOSTID_TEST_TIMEOUT overrides the
    # seconds; tcp: Open MPI's ob1 over TCP on loopback instead of shared memory).
    set -f  # the entries' gtest filters hold '*'
    for spec in $hostid_specs; do
      set +f
      IFS=: read -r t n limit filter transport <<< "$spec"
      name=$(hostid_name "$spec")
      [[ -n $name ]] || continue
      if ((SECONDS - t0 > hb || $(left) < 20)); then
        printf '%s\t%s\tnot run\t-\t-\t-\t-\n' "$name" "$n" >> "$tests_tsv"; continue
      fi
      limit=${HOSTID_TEST_TIMEOUT:-$limit}
      left=$((hb + 30 - (SECONDS - t0)))
      ((left < limit)) && limit=$((left < 30 ? 30 : left))
      limit=$(clip "$limit")
      tl=$work/tests/$name.log s=$SECONDS
      if [[ $t == *.py ]]; then
        # Each rank of each run through hostid_rank.sh; the script itself must see NCCL run.
        (cd "$work/scratch" && LOCUS_SOURCE_DIR=$repo LOCUS_BINARY_DIR=$bundle LOCUS_MPIEXEC=mpirun \
           LOCUS_RANK_WRAPPER=$here/hostid_rank.sh LOCUS_REQUIRE_NCCL=1 timeout -k 5 "$limit" \
           "$py" "$repo/tests/apps/$t" "$bundle/apps" "$n") > "$tl" 2>&1 < /dev/null
        record_script "$name" "$n" "$?" "$tl" "$s"
        continue
      fi
      (cd "$work/scratch" || exit 1
       if [[ $transport == tcp ]]; then
         export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo
       fi
       run_mpi "$n" "$limit" "$here/hostid_rank.sh" "$bundle/tests/$t" --gtest_brief=0 \
         --gtest_color=no ${filter:+"--gtest_filter=$filter"}) > "$tl" 2>&1 < /dev/null
      record_gtest "$name" "$n" "$?" "$tl" "$s"
    done
    set +f
  else
    say "the host-id probe did not succeed: the NCCL reducer, stage link and NCCL trainer" \
        "tests did NOT run (see the probe's lines above)"
    hostid_unrun "probe failed"
  fi
else
  say "no GPU: not run"
fi
tar -C "$work" -czf "$out/tests.tar.gz" tests tests.tsv 2> /dev/null

section "NCCL reducer (locus_nccl_reducer_bench, 1 rank)"
reducer_table=$work/nccl_reducer_bench.txt
if [[ $skip == *" reducer "* || $skip == *" reducer1 "* ]]; then
  say "skipped (SKIP)"
elif [[ ! -x $bundle/bench/locus_nccl_reducer_bench ]]; then
  say "not in the bundle (a build without NCCL?)"
elif late; then
  :
elif ((gpu)); then
  run_mpi 1 "$(clip "${REDUCER_TIMEOUT:-60}")" "$bundle/bench/locus_nccl_reducer_bench" --iters 20 \
    > "$reducer_table" 2>&1 < /dev/null
  say "rc $?"
  cat "$reducer_table" | tee -a "$log"
else
  say "no GPU: not run"
fi

section "locus-train on the GPU (gpu_train_bench.sh)"
if [[ $skip == *" locus "* ]]; then
  say "skipped (SKIP)"
elif late; then
  :
else
  # The soft budget shrinks with the hard limit where the deadline clips it.
  lb=${LOCUS_BUDGET_S:-120} st=${STEP_TIMEOUT:-40}
  hard=$(clip $((lb + st + 30)))
  ((hard < lb + st + 30)) && lb=$((hard - st - 30 < 5 ? 5 : hard - st - 30))
  DATA='' TITLE='' BUDGET_S=$lb STEP_TIMEOUT=$st PYTHON=$py timeout -k 10 "$hard" \
    "$here/gpu_train_bench.sh" "$bundle" "$work/locus" 2>&1 | tee -a "$log"
  cp "$work/locus/gpu_train_bench.tsv" "$out/" 2> /dev/null
  tar -C "$work" -czf "$out/locus.tar.gz" --exclude='*.h5' locus 2> /dev/null
fi

section "locus-train, deep MLP 784-2048x7-10 bf16 AdamW (gpu_train_bench.sh)"
if [[ $skip == *" deep "* ]]; then
  say "skipped (SKIP)"
elif late; then
  :
elif ((gpu)); then
  # The workload of torch_gpu_bench.py's deep-mlp (AdamW lr 3e-4, weight decay 0.01, no
  # clipping), batch 4096, device cache and streamed.
  ROWS=${DEEP_ROWS:-"cuda:bf16:4096:1024:true cuda:bf16:4096:0:true"} EPOCHS=${DEEP_EPOCHS:-6} \
    EXTRA="--model.widths=784,2048,2048,2048,2048,2048,2048,2048,10 --optim.optimizer=adamw
           --optim.lr=0.0003 --optim.weight_decay=0.01 --optim.clip_max_norm=0" \
    DATA='' TITLE="deep MLP 784-2048x7-10 bf16 AdamW" \
    BUDGET_S=${DEEP_BUDGET_S:-40} STEP_TIMEOUT=${STEP_TIMEOUT:-40} PYTHON=$py \
    timeout -k 10 "$(clip 120)" "$here/gpu_train_bench.sh" "$bundle" "$work/locus/deep" 2>&1 |
    tee -a "$log"
  rm -f "$work/locus/deep/train.h5"
else
  say "no GPU: not run"
fi

section "locus-train, SimpleNet 1024-512-10 Adam (gpu_train_bench.sh)"
sn_data=$work/simplenet.h5
if [[ $skip == *" simplenet "* ]]; then
  say "skipped (SKIP)"
elif late; then
  :
elif ((gpu)); then
  # The workload of torch_gpu_bench.py's simplenet (Adam lr 1e-3, betas 0.9/0.999, eps 1e-8, no
  # weight decay, no clipping, ReLU, fp32 without tf32), batch 64 and 4096, device cache and
  # streamed, on a synthetic file (make_simplenet_data.py: 1024 N(0, 1) features, labels of a
  # fixed linear teacher, seed 1) that the PyTorch phase below reads too (--simplenet-data).
  # The file (256 MiB at 65536 rows) stays under $work until the end.
  timeout -k 5 "$(clip 30)" "$py" "$here/make_simplenet_data.py" "$sn_data" --rows "${SIMPLENET_ROWS:-65536}" \
    2>&1 | tee -a "$log"
  if [[ -f $sn_data ]]; then
    sb=${SIMPLENET_BUDGET_S:-30}
    ROWS=${SIMPLENET_RUNS:-"cuda:fp32:64:1024:true cuda:fp32:4096:1024:true cuda:fp32:64:0:true cuda:fp32:4096:0:true"} \
      EPOCHS=${SIMPLENET_EPOCHS:-10} DATA=$sn_data TITLE="SimpleNet 1024-512-10 Adam" \
      EXTRA="--model.widths=1024,512,10 --model.activation=relu --optim.optimizer=adam
             --optim.lr=0.001 --optim.beta1=0.9 --optim.beta2=0.999 --optim.eps=1e-08
             --optim.weight_decay=0 --optim.clip_max_norm=0" \
      BUDGET_S=$sb STEP_TIMEOUT=${SIMPLENET_STEP_TIMEOUT:-30} PYTHON=$py \
      timeout -k 10 "$(clip "${SIMPLENET_TIMEOUT:-60}")" "$here/gpu_train_bench.sh" "$bundle" "$work/locus/simplenet" \
      2>&1 | tee -a "$log"
  else
    say "make_simplenet_data.py wrote no file: not run"
  fi
else
  say "no GPU: not run"
fi

section "the training monitors' cost on the GPU (locus_monitor_bench, 1 rank)"
# anomaly = warn judges each step after its update is enqueued (gated on the device): the
# detectors against none, alternating, on the device-cached Fashion-MNIST MLP at batch 128.
if [[ $skip == *" monitors "* ]]; then
  say "skipped (SKIP)"
elif late; then
  :
elif ((gpu)) && [[ -x $bundle/bench/locus_monitor_bench && -f $work/locus/train.h5 ]]; then
  run_mpi 1 "$(clip "${MONITOR_TIMEOUT:-60}")" "$bundle/bench/locus_monitor_bench" --data "$work/locus/train.h5" \
    --backend cuda --cache-mb 1024 --batch 128 --steps "${MONITOR_STEPS:-2000}" --rounds 3 \
    --log-every 100 > "$work/locus/monitor_bench.txt" 2>&1 < /dev/null
  say "rc $?"
  tee -a "$log" < "$work/locus/monitor_bench.txt"
else
  say "not run (no GPU, no locus_monitor_bench in the bundle, or no dataset from the locus phase)"
fi

section "kernel times of a locus-train step (Nsight Compute, eager launches)"
if [[ $skip == *" profile "* ]]; then
  say "skipped (SKIP)"
elif late; then
  :
elif ((gpu)) && [[ -f $work/locus/train.h5 ]]; then
  for pb in ${PROFILE:-fp32:128 bf16:128}; do
    (($(left) < 30)) && { say "profile $pb: not run (the deadline is near)"; continue; }
    timeout -k 5 "$(clip 150)" "$here/kernel_profile.sh" "$bundle/apps" "$work/locus/train.h5" "${pb#*:}" \
      "${pb%%:*}" 2>&1 | tee -a "$log" >> "$work/locus/kernel_profile.txt"
  done
else
  say "not run (no GPU or no dataset from the locus phase)"
fi

# locus.tar.gz (again, with the deep MLP's, SimpleNet's and the monitors' results)
[[ -d $work/locus ]] && tar -C "$work" -czf "$out/locus.tar.gz" --exclude='*.h5' locus 2> /dev/null

section "locus-infer on the GPU vs h5py + PyTorch (infer_gpu_bench.py)"
infer_line=$work/infer_gpu_line.txt
if [[ $skip == *" infer "* ]]; then
  say "skipped (SKIP)"
elif late; then
  :
else
  # >= 1M rows end to end (HDF5 read to durable output), both twice, alternated; the input
  # (3.3 GB) is written under $work and removed with it. Without a GPU, the same steps on the
  # cpu backend and 65536 rows: a check of the script and of the reports it reads, no figures.
  if ((gpu)); then
    infer_args=(--rows "${INFER_ROWS:-1048576}" --out "$out/infer_gpu_bench.tsv")
  else
    say "no GPU: the script's steps on the cpu backend, 65536 rows (a check, not a benchmark)"
    infer_args=(--device cpu --rows 65536 --batch 4096 --block 16384 --ranks 2)
  fi
  timeout -k 10 "$(clip "${INFER_TIMEOUT:-150}")" "$py" "$here/infer_gpu_bench.py" --apps "$bundle/apps" \
    --work "$work/infer" "${infer_args[@]}" 2>&1 | tee -a "$log" | tee "$work/infer.log"
  grep '^infer_gpu ' "$work/infer.log" > "$infer_line" ||
    { say "infer_gpu_bench.py gave no result line"
      echo "infer_gpu NO RESULT (see run.log: infer_gpu_bench.py's lines)" > "$infer_line"; }
  # The same file's features read stripe by stripe as locus-infer reads them: H5Dread, plain
  # pread, io::RowReader at 1-8 threads (this host's page-cache copy speed; no GPU involved).
  if [[ -x $bundle/bench/locus_row_read && -f $work/infer/infer-input.h5 ]] && (($(left) >= 20)); then
    timeout -k 5 "$(clip 60)" "$bundle/bench/locus_row_read" --reps 3 --threads 1,2,4,8 \
      "$work/infer/infer-input.h5" 2>&1 | tee -a "$log" | tee "$work/row_read.txt"
    awk '/RowReader|H5Dread|plain bytes/ {print "row_read " $0}' "$work/row_read.txt" >> "$infer_line"
  fi
  rm -rf "$work/infer"
fi

section "PyTorch on the GPU (torch_gpu_bench.py)"
if [[ $skip == *" torch "* ]]; then
  say "skipped (SKIP)"
elif late; then
  :
else
  tb=${TORCH_BUDGET_S:-120}
  hard=$(clip $((tb + 50)))
  ((hard < tb + 50)) && tb=$((hard - 50 < 10 ? 10 : hard - 50))
  targs=(--out "$out/torch_gpu_bench.jsonl" --budget-s "$tb")
  ((gpu)) || targs+=(--device cpu --quick)
  # simplenet on the rows locus-train's SimpleNet phase trained on
  [[ -f $sn_data ]] && targs+=(--simplenet-data "$sn_data")
  # shellcheck disable=SC2206
  targs+=(${TORCH_ARGS:-})
  timeout -k 10 "$hard" "$py" "$here/torch_gpu_bench.py" "${targs[@]}" 2>&1 | tee -a "$log"
fi

section "counts with the measured peaks"
peaks=$("$py" - "$out/torch_gpu_bench.jsonl" <<'EOF' 2>> "$log"
import json, sys
try:
    pk = next(r for r in map(json.loads, open(sys.argv[1])) if r.get("kind") == "peaks" and r.get("size") == 8192)
except (OSError, StopIteration):
    sys.exit()
m = {"bf16": "matmul_bf16_TFLOP_s", "fp32": "matmul_fp32_TFLOP_s", "tf32": "matmul_tf32_TFLOP_s"}
args = [f"--{k}-tflops={pk[v]:.1f}" for k, v in m.items() if v in pk]
if "d2d_TB_s" in pk: args.append(f"--mem-tbs={pk['d2d_TB_s']:.3f}")
if "h2d_pinned_GB_s" in pk: args.append(f"--h2d-gbs={pk['h2d_pinned_GB_s']:.1f}")
names = {"--bf16": "bf16", "--fp32": "fp32", "--tf32": "tf32", "--mem-": "mem", "--h2d-": "h2d"}
got = [n for p, n in names.items() for a in args if a.startswith(p)]
print(" ".join(args + ["--measured=" + ",".join(got)] if args else []))
EOF
)
# shellcheck disable=SC2086
"$py" "$here/counts.py" $peaks > "$out/counts.txt" 2>&1
say "counts.py ${peaks:-(defaults: no GPU peaks measured)}"
cat "$out/counts.txt" >> "$log"

section "summary"
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2> /dev/null | head -n 1)
"$py" "$here/summarize_gpu.py" --gpu "$gpu" --gpu-name "$gpu_name" --tests "$tests_tsv" --locus "$out/gpu_train_bench.tsv" \
  --torch "$out/torch_gpu_bench.jsonl" --simplenet "$work/locus/simplenet/gpu_train_bench.tsv" \
  > "$out/summary.txt" 2>> "$log" ||
  { echo "summarize_gpu.py failed; raw tables:"
    cat "$tests_tsv" "$out/gpu_train_bench.tsv" "$work/locus/simplenet/gpu_train_bench.tsv" 2> /dev/null
  } > "$out/summary.txt"
if [[ -s $infer_line ]]; then
  { echo; echo "locus-infer on the GPU, end to end (HDF5 read to durable output) vs h5py + PyTorch CUDA:"
    cat "$infer_line"; } >> "$out/summary.txt"
fi
if [[ -s $work/locus/deep/gpu_train_bench.tsv ]]; then
  { echo; echo "locus-train, deep MLP 784-2048x7-10 bf16 AdamW batch 4096 (samples/s, data wait):"
    awk -F'\t' 'NR > 1 {printf "  cache %s graphs %s: %s %s, data wait %s\n", $4, $5, $6, $7, $8}' \
      "$work/locus/deep/gpu_train_bench.tsv"; } >> "$out/summary.txt"
fi
if [[ -s $work/locus/monitor_bench.txt ]]; then
  { echo; echo "training monitors on the GPU (locus_monitor_bench, cached, batch 128):"
    grep -E '^\||ranks,' "$work/locus/monitor_bench.txt"; } >> "$out/summary.txt"
fi
if [[ -s $work/locus/kernel_profile.txt ]]; then
  { echo; echo "device time per step by kernel (ncu, eager; the top 6 of each):"
    awk '/^kernel_profile:/ {print; n = 0; next} /^  / && n++ < 6 {print}' \
      "$work/locus/kernel_profile.txt"; } >> "$out/summary.txt"
fi
if (($(wc -l < "$san_tsv") > 1)); then
  { echo; echo "compute-sanitizer over the kernel tests (errors each tool reported, of them failed API calls; the tests' results under it):"
    awk -F'\t' 'NR > 1 {printf "  %-9s %-24s %-9s errors %-3s api %-3s passed %-3s failed %-3s %4ss  %s\n", $1, $2, $3, $4, $5, $6, $7, $8, ($3 == "findings" || $3 == "api-calls" ? "first: " $9 : "")}' \
      "$san_tsv"; } >> "$out/summary.txt"
fi
if [[ -s $gather_table ]]; then
  { echo; echo "loader.gather = device, by grid cap (GB/s alone, beside GEMMs; their slowdown):"
    cat "$gather_table"; } >> "$out/summary.txt"
fi
if [[ -s $work/nccl_reducer_hostid.txt ]]; then
  { echo; echo "NCCL reducer at 2 ranks on one GPU over sockets (host ids): host_* = enqueue cost"
    grep -v '^#' "$work/nccl_reducer_hostid.txt" | head -n 12; } >> "$out/summary.txt"
fi
if [[ -s $reducer_table ]]; then
  { echo; echo "NCCL reducer at 1 rank (machinery overhead; staged = D2H+H2D round trip):"
    grep -v '^#' "$reducer_table" | head -n 20; } >> "$out/summary.txt"
fi
cat "$out/summary.txt" >> "$log"
rm -rf "$work"
echo
cat "$out/summary.txt"
echo "(total $((SECONDS - t_start)) s; full logs in $out: $(ls "$out" | tr '\n' ' '))"
