#!/usr/bin/env bash
# Packs what the GPU verification (bench/gpu/run_gpu.sh) needs on a lent GPU host that has
# CUDA 13, PyTorch and Open MPI 4 but none of this project's Debian libraries: the stripped
# apps, every GPU test binary with its ctest registration (name, rank count), any bench/gpu
# programs, the Debian shared libraries the binaries link that such a host lacks, Fashion-
# MNIST's training set and the bench/gpu scripts. Never the CUDA, NCCL or MPI libraries (the
# host has its own; the working tree that travels is limited to 64 MiB).
#   bench/common/make_gpu_bundle.sh [BUILD_DIR=build] [OUT_DIR=.gpu-bundle]
#     ALLOW_MISSING=1  pack even if an app is missing (default: stop)
#     MAX_MB=56        stop if the bundle is larger (64 MiB minus the repository and a margin)
#     TEST_SELECT="-L gpu"  the ctest selection whose binaries are packed (e.g. "-R ^test_comm"
#                      to dry-run the test runner where no GPU test is built yet)
# Layout: bin.tar.xz (apps/ tests/ (+ tests/manifest.tsv: ctest name, binary, ranks) bench/
# lib/ (always on LD_LIBRARY_PATH: parallel HDF5, Boost.Program_options 1.74, fmt, szip/aec);
# run_gpu.sh unpacks it into the bundle's directory) lib-extra.tar.xz
# (the rest of the binaries' closure, e.g. OpenBLAS and libgfortran: run_gpu.sh unpacks only
# the sonames the host cannot resolve) fm/ scripts/ MANIFEST.
# Then, on the GPU host (through the device tool, carrying OUT_DIR): bench/gpu/run_gpu.sh OUT_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
build=$(cd "${1:-$repo/build}" && pwd)
out=${2:-$repo/.gpu-bundle}
fm=${FM_DIR:-/usr/share/datasets/fashion-mnist}
max_mb=${MAX_MB:-56}
# Sonames the host provides, or that must come from the host (CUDA, NCCL, MPI and its deps,
# the C and C++ run-times): never packed.
host_re='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libresolv\.|libutil\.|libstdc\+\+|libgcc_s|libmpi|libopen-rte|libopen-pal|libpmix|libhwloc|libevent|libcuda|libcudart|libcublas|libcublasLt|libnccl|libnvidia|libnvrtc|libnvJitLink|libcufft|libcurand|libcusolver|libcusparse)'
# Always used, in bin.tar.xz's lib/ (the host's own, if any, are other versions).
tier1_re=${TIER1_RE:-'^(libhdf5|libboost_program_options|libfmt|libsz\.|libaec\.)'}

rm -rf "$out"
mkdir -p "$out"/{apps,tests,bench,lib,fm,scripts}
missing=()
for app in locus-ingest locus-train locus-infer locus-ckpt; do
  if [[ -x $build/apps/$app ]]; then
    install -s "$build/apps/$app" "$out/apps/"
  else
    missing+=("apps/$app")
  fi
done
if ((${#missing[@]})) && [[ ${ALLOW_MISSING:-0} != 1 ]]; then
  echo "make_gpu_bundle.sh: not built: ${missing[*]} (in $build): build them first" \
       "(cmake --build $build --target locus-train locus-ingest locus-infer locus-ckpt)," \
       "or set ALLOW_MISSING=1 to pack without them" >&2
  exit 2
fi

# GPU tests: ctest's registrations of label gpu (name, binary, ranks), plus any executable
# under a gpu/ folder of the build's tests that ctest does not list -- but those ctest lists
# without the label: they need no device (test_cuda_host) and run in CI.
manifest=$out/tests/manifest.tsv
: > "$manifest"
if command -v ctest > /dev/null; then
  # shellcheck disable=SC2086
  (cd "$build" && ctest ${TEST_SELECT:--L gpu} --show-only=json-v1 2> /dev/null) | python3 -c '
import json, os, sys
try:
    d = json.load(sys.stdin)
except ValueError:
    sys.exit()
for t in d.get("tests", []):
    cmd = t.get("command") or []
    ranks = 1
    if "-n" in cmd:
        ranks = int(cmd[cmd.index("-n") + 1])
        cmd = cmd[cmd.index("-n") + 2:]
    name = t["name"]
    # An app test (tests/apps/*.py BINDIR RANKS): run_gpu.sh runs the script from the
    # repository with the bundle apps.
    script = next((c for c in cmd if c.endswith(".py") and "/tests/apps/" in c), None)
    if script:
        print(f"{name}\tscript:{os.path.basename(script)}\t{cmd[-1]}")
        continue
    exe = next((c for c in cmd if os.path.isfile(c) and os.access(c, os.X_OK)), None)
    if exe:
        print(f"{name}\t{exe}\t{ranks}")
' > "$manifest.abs" || true
fi
touch "$manifest.abs"
while IFS= read -r exe; do
  grep -qF "	$exe	" "$manifest.abs" || printf '%s\t%s\t1\n' "$(basename "$exe")" "$exe" >> "$manifest.abs"
done < <(find "$build/tests" -path '*/CMakeFiles' -prune -o -path '*/gpu/*' -type f -perm -u+x \
           ! -name test_cuda_host -print 2> /dev/null | sort)
while IFS=$'\t' read -r name exe ranks; do
  if [[ $exe == script:* ]]; then
    printf '%s\t%s\t%s\n' "$name" "$exe" "$ranks" >> "$manifest"
    continue
  fi
  [[ -f $out/tests/$(basename "$exe") ]] || install -s "$exe" "$out/tests/"
  printf '%s\t%s\t%s\n' "$name" "$(basename "$exe")" "$ranks" >> "$manifest"
done < "$manifest.abs"
rm -f "$manifest.abs"
# Run order: single-rank binaries first (the kernels' tests tell the most when something is
# wrong), then MPI ones, then the app scripts.
python3 - "$manifest" <<'PY'
import sys
rows = [l.split("\t") for l in open(sys.argv[1]).read().splitlines() if l]
rows.sort(key=lambda r: (r[1].startswith("script:"), int(r[2]), "kernels" not in r[0], r[0]))
open(sys.argv[1], "w").write("".join("\t".join(r) + "\n" for r in rows))
PY
ntests=$(find "$out/tests" -type f ! -name manifest.tsv | wc -l)
nscripts=$(grep -c $'\tscript:' "$manifest" || true)

# bench/gpu programs, if any are built, the CPU benches that take --backend cuda, and the
# stripe-read benchmark run beside the inference benchmark
if [[ -d $build/bench/gpu ]]; then
  find "$build/bench/gpu" -maxdepth 1 -type f -perm -u+x -exec install -s {} "$out/bench/" \;
fi
for b in train/locus_monitor_bench io/locus_row_read; do
  if [[ -x $build/bench/$b ]]; then install -s "$build/bench/$b" "$out/bench/"; fi
done

# Libraries: the closure of every packed binary, split into tier 1 (lib/) and the rest.
bins=$(find "$out/apps" "$out/tests" "$out/bench" -type f -perm -u+x)
extra=$(mktemp -d)
trap 'rm -rf "$extra"' EXIT
unresolved=()
if [[ -n $bins ]]; then
  while read -r soname path; do
    [[ $soname =~ $host_re ]] && continue
    if [[ $path == "not" ]]; then unresolved+=("$soname"); continue; fi
    if [[ $soname =~ $tier1_re ]]; then cp -L "$path" "$out/lib/$soname"; else cp -L "$path" "$extra/$soname"; fi
  done < <(for b in $bins; do ldd "$b"; done | awk '$2 == "=>" {print $1, $3}' | sort -u)
fi
if ((${#unresolved[@]})); then
  echo "make_gpu_bundle.sh: ldd cannot resolve here: ${unresolved[*]} (not packed)" >&2
fi
tar -C "$extra" -cf - . | xz -T2 -6 > "$out/lib-extra.tar.xz"

cp "$fm"/train-images-idx3-ubyte.gz "$fm"/train-labels-idx1-ubyte.gz "$out/fm/"
cp "$repo"/bench/gpu/*.py "$repo"/bench/gpu/*.sh "$out/scripts/"
{
  echo "built from: $(git -C "$repo" rev-parse --short HEAD 2> /dev/null)$(git -C "$repo" diff --quiet 2> /dev/null || echo ' + uncommitted changes'), $(date -u +%FT%TZ), build $build"
  grep -E '^(CMAKE_BUILD_TYPE|LOCUS_WITH_CUDA|LOCUS_WITH_NCCL|CMAKE_CUDA_ARCHITECTURES):' "$build/CMakeCache.txt" 2> /dev/null
  echo "apps: $(ls "$out/apps" | tr '\n' ' ')"
  echo "missing apps: ${missing[*]:-none}"
  echo "gpu tests ($ntests binaries, $nscripts app scripts): $(cut -f1,3 "$manifest" | tr '\t\n' ': ' )"
  echo "lib: $(ls "$out/lib" | tr '\n' ' ')"
  echo "lib-extra: $(ls "$extra" | tr '\n' ' ')"
  echo "cuda libraries the binaries expect from the host: $(for b in $bins; do ldd "$b"; done | awk '$1 ~ /^lib(cudart|cublas|nccl|cuda)/ {print $1}' | sort -u | tr '\n' ' ')libcublasLt.so.13 (opened at run time)"
} > "$out/MANIFEST"
cat "$out/MANIFEST"
# The binaries and their libraries travel as one xz archive (a sixth of their size); run_gpu.sh
# unpacks it in place first.
tar -C "$out" -cJf "$out/bin.tar.xz" apps tests bench lib
rm -rf "$out"/{apps,tests,bench,lib}
size_kb=$(du -sk "$out" | cut -f1)
echo "$out: $((size_kb / 1024)) MiB ($ntests GPU test binaries${missing:+; MISSING: ${missing[*]}})"
if ((size_kb > max_mb * 1024)); then
  echo "make_gpu_bundle.sh: the bundle is over MAX_MB=$max_mb MiB: with the repository it will" \
       "not fit the device tool's 64 MiB working tree" >&2
  exit 3
fi
