#!/usr/bin/python3
"""Writes a synthetic classification CSV for locus-ingest (configs/simplenet.ini): `classes`
Gaussian clusters in `features` dimensions whose centres are `separation` apart per
dimension on average, plus N(0, 1) noise -- learnable, but not linearly trivial at the default
separation. Header f0..f{D-1},label; values with 4 decimals.

  make_synthetic.py OUT.csv [--rows 20000] [--features 1024] [--classes 10] [--seed 0]
                            [--separation 0.08]
"""
import argparse
import sys

import numpy as np


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--separation", type=float, default=0.08)
    a = p.parse_args()
    # The centres come from a fixed stream, so train and test sets (different --seed) share them.
    centres = np.random.default_rng(12345).normal(0, a.separation, size=(a.classes, a.features))
    rng = np.random.default_rng(a.seed)
    with open(a.out, "w") as f:
        f.write(",".join(f"f{i}" for i in range(a.features)) + ",label\n")
        for start in range(0, a.rows, 2000):  # in blocks, to bound memory
            n = min(2000, a.rows - start)
            y = rng.integers(0, a.classes, size=n)
            x = centres[y] + rng.normal(0, 1, size=(n, a.features))
            block = np.column_stack([x, y])
            np.savetxt(f, block, delimiter=",", fmt=["%.4f"] * a.features + ["%d"])
    print(f"wrote {a.rows} rows x {a.features} features, {a.classes} classes to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
