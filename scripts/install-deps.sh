#!/usr/bin/env bash
# Installs what locus needs from Debian 12 packages; does nothing when all is present.
# Run as root (or with sudo). Idempotent: a second run only checks.
set -euo pipefail

packages=(
  # build (ccache: scripts/build.sh uses it when present; .ci/run shares it across checkouts)
  g++ cmake make pkg-config git zlib1g-dev ccache
  # MPI and parallel HDF5
  openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools
  # maths, options, formatting, JSON
  libopenblas-dev libboost-program-options-dev libfmt-dev nlohmann-json3-dev
  # tests and benchmarks
  googletest libgtest-dev libgmock-dev libbenchmark-dev hyperfine
  python3-h5py python3-numpy python3-torch
  # the run report (locus-report: matplotlib plots) and its test (a headless browser)
  python3-matplotlib chromium
  # fuzzing (tests/fuzz): clang with libFuzzer and the sanitizer runtimes
  clang-14 libclang-rt-14-dev
  # the real data set
  dataset-fashion-mnist
  # the throw-away Slurm cluster used by the slurm-labelled tests
  slurm-wlm munge
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
