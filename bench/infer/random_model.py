#!/usr/bin/python3
"""Writes the model bench/infer scores with: a Fashion-MNIST-shaped MLP 784-256-128-10, relu,
He-scaled random weights from a fixed seed (the arithmetic is a trained model's), in the locus
model file layout (docs/FORMATS.md).

    random_model.py OUT.h5
"""
import sys

import h5py
import numpy as np


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rng = np.random.default_rng(0)
    w = [784, 256, 128, 10]
    with h5py.File(sys.argv[1], "w") as f:
        for i in range(3):
            f[f"layers.{i}.weight"] = (rng.standard_normal((w[i + 1], w[i]))
                                       * np.sqrt(2 / w[i])).astype(np.float32)
            f[f"layers.{i}.bias"] = np.zeros(w[i + 1], np.float32)
        f.attrs.update(locus_format="locus-model", schema_version=1,
                       widths=np.array(w, np.int64), activation="relu")


if __name__ == "__main__":
    main()
