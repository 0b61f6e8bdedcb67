#!/usr/bin/env bash
# Packs what the CPU benchmarks need to run on a host without this project's Debian packages
# (the lent GPU hosts run Ubuntu with its own Open MPI and OpenBLAS but only serial HDF5): the
# stripped apps and benchmark programs, the Debian libraries such a host lacks, the
# Fashion-MNIST files make_input.sh ingests, and bench/infer's model. On that host:
#   export LD_LIBRARY_PATH=$PWD/OUT/lib
#   FM_DIR=OUT/fm bench/infer/make_input.sh OUT /tmp/ib/fm1m.h5 16 4
#   TORCH=0 MODEL=OUT/model.h5 PYTHON=python3 bench/infer/run_infer_bench.sh OUT /tmp/ib/fm1m.h5
#   mpirun -n 1 OUT/bench/io/locus_h5_bandwidth --bytes 1GiB --dir /tmp/iob --reps 7
# The host's libmpi.so.40 (Open MPI 4.x) stands in for Debian's: same ABI.
#   bench/common/make_bundle.sh BUILD_DIR OUT_DIR
#     LIBS: the libraries to carry (default: parallel HDF5 and Boost.Program_options 1.74)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=$1 out=$2
libs=${LIBS:-libhdf5_openmpi.so.103 libboost_program_options.so.1.74.0}
fm=${FM_DIR:-/usr/share/datasets/fashion-mnist}
rm -rf "$out"
mkdir -p "$out/apps" "$out/bench/io" "$out/lib" "$out/fm"
install -s "$build/apps/locus-infer" "$build/apps/locus-ingest" "$out/apps/"
install -s "$build/bench/io/locus_h5_bandwidth" "$out/bench/io/"
for lib in $libs; do
  path=$(ldd "$build/apps/locus-infer" | awk -v l="$lib" '$1 == l {print $3}')
  [[ -n $path ]] || { echo "make_bundle.sh: locus-infer does not link $lib" >&2; exit 2; }
  cp -L "$path" "$out/lib/"
done
cp "$fm"/train-images-idx3-ubyte.gz "$fm"/train-labels-idx1-ubyte.gz "$out/fm/"
/usr/bin/python3 "$here/../infer/random_model.py" "$out/model.h5"
du -sh "$out"
