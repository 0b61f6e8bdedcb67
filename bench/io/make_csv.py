#!/usr/bin/python3
"""Writes the generated CSV input of the ingest benchmark: a header line, FEATURES float
columns f0.. (Gaussian, 6 significant digits) and an integer label y in [0, 10), about MB
megabytes. Deterministic for a given seed, so every run ingests the same bytes.

    make_csv.py OUT.csv [--mb 300] [--features 32] [--seed 1] [--keys N]

--keys N adds a last column `k` of integer keys in [0, N) (the join key of ingest.join).
"""
import argparse
import os

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--mb", type=float, default=300.0, help="target size in MB (1e6 bytes)")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keys", type=int, default=0, help="add a key column k in [0, N)")
    a = p.parse_args()
    rng = np.random.default_rng(a.seed)
    target = int(a.mb * 1e6)
    tmp = a.out + ".tmp"
    block = 20000
    with open(tmp, "w") as f:
        f.write(",".join([f"f{i}" for i in range(a.features)] + ["y"] + (["k"] if a.keys else []))
                + "\n")
        while f.tell() < target:
            x = rng.normal(0.0, 1.0, size=(block, a.features))
            y = rng.integers(0, 10, size=(block, 1))
            cols, fmt = [x, y], ["%.6g"] * a.features + ["%d"]
            if a.keys:
                cols.append(rng.integers(0, a.keys, size=(block, 1)))
                fmt.append("%d")
            np.savetxt(f, np.hstack(cols), fmt=fmt, delimiter=",")
    os.replace(tmp, a.out)  # a half-written file never takes the final name
    print(f"{a.out}: {os.path.getsize(a.out) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
