"""PyTorch baseline for bench/infer: no_grad forward passes of a locus model file (loaded into
an nn.Sequential of Linear/ReLU) over in-memory float32 rows, batch by batch, 1 thread.
Prints rows/s by wall clock and by process CPU time.
  OPENBLAS_NUM_THREADS=1 /usr/bin/python3 torch_infer_bench.py MODEL.h5 DATA.h5 ROWS BATCH"""
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
import h5py  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402


def load(path):
    with h5py.File(path, "r") as f:
        widths = [int(w) for w in f.attrs["widths"]]
        layers = []
        for i in range(len(widths) - 1):
            lin = torch.nn.Linear(widths[i], widths[i + 1])
            lin.weight.data = torch.from_numpy(f[f"layers.{i}.weight"][:])
            lin.bias.data = torch.from_numpy(f[f"layers.{i}.bias"][:])
            layers += [lin, torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).eval()


def main():
    model_path, data_path, rows, batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    net = load(model_path)
    with h5py.File(data_path, "r") as f:
        x = torch.from_numpy(f["features"][: min(rows, 60000)])  # in memory, reused
    n = x.shape[0] // batch * batch
    with torch.no_grad():
        for i in range(0, 20 * batch, batch):  # warm-up
            net(x[i:i + batch])
        done = 0
        w0, c0 = time.perf_counter(), time.process_time()
        while done < rows:
            i = done % n
            net(x[i:i + batch])
            done += batch
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    print(f"torch_rows {done}")
    print(f"torch_wall_rows_per_s {done / wall:.0f}")
    print(f"torch_cpu_rows_per_s {done / cpu:.0f}")


if __name__ == "__main__":
    main()
