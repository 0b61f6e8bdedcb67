#!/usr/bin/env python3
"""The SimpleNet (1024-512-10) training set of the GPU benchmarks, as an HDF5 file written by
another tool (docs/FORMATS.md, "Inputs from other tools"): /features float32 [N, D] drawn from
N(0, 1), /labels int32 [N] = argmax(x @ W) of a fixed random linear teacher W [D, C] (no
noise: learnable, and the classes come out roughly balanced). Deterministic for a given
--seed. Read by locus-train (--data.train) and by torch_gpu_bench.py (--simplenet-data), so
both train on the same rows. Written in blocks (memory bounded) under a temporary name and
renamed, so a killed run leaves no partial file.

  make_simplenet_data.py OUT.h5 [--rows 65536] [--features 1024] [--classes 10] [--seed 1]
"""
import argparse
import os
import sys
import time

import h5py
import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    if a.rows < 1 or a.features < 1 or a.classes < 2:
        print(f"make_simplenet_data: --rows {a.rows} --features {a.features} --classes {a.classes}: "
              "need rows >= 1, features >= 1, classes >= 2", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    rng = np.random.default_rng(a.seed)
    teacher = rng.standard_normal((a.features, a.classes), dtype=np.float32)
    counts = np.zeros(a.classes, dtype=np.int64)
    tmp = os.path.join(os.path.dirname(os.path.abspath(a.out)), "." + os.path.basename(a.out) + ".tmp")
    block = 8192
    with h5py.File(tmp, "w") as f:
        x_ds = f.create_dataset("features", (a.rows, a.features), dtype="f4")
        y_ds = f.create_dataset("labels", (a.rows,), dtype="i4")
        for start in range(0, a.rows, block):
            n = min(block, a.rows - start)
            x = rng.standard_normal((n, a.features), dtype=np.float32)
            y = np.argmax(x @ teacher, axis=1).astype(np.int32)
            x_ds[start:start + n] = x
            y_ds[start:start + n] = y
            counts += np.bincount(y, minlength=a.classes)
        f.attrs["generator"] = (f"bench/gpu/make_simplenet_data.py --rows {a.rows} --features {a.features} "
                                f"--classes {a.classes} --seed {a.seed}")
    os.replace(tmp, a.out)
    print(f"make_simplenet_data: {a.out}: {a.rows} x {a.features} float32, labels of {a.classes} classes "
          f"(a linear teacher, seed {a.seed}; per class {counts.min()}..{counts.max()} rows), "
          f"{os.path.getsize(a.out) / 2**20:.0f} MiB in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
