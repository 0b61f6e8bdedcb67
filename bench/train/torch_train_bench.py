#!/usr/bin/python3
"""PyTorch reference for locus-train on the same locus HDF5 datasets (read with h5py into
in-memory tensors): the training loop's samples/s on 1 process, or with DistributedDataParallel
(gloo) on several processes, and the test accuracy of a full training run with locus's
hyperparameters (same schedule formula, He init, zero biases).

  torch_train_bench.py --train out/fashion-mnist-train.h5 [--test out/fashion-mnist-test.h5]
      [--procs 1] [--batch 128 (per process)] [--epochs 3] [--lr 0.05] [--momentum 0.9]
      [--nesterov 1] [--warmup 200] [--schedule cosine|constant] [--seed 1] [--threads 1]

Prints `samples_per_s X` (global samples over the training loop's wall time, evaluation
excluded) and, with --test, `test_accuracy X`. Thread counts are exported before torch is
imported (OpenBLAS and OpenMP read them once at load time).
"""
import argparse
import math
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", required=True)
    p.add_argument("--test", default="")
    p.add_argument("--widths", default="784,256,128,10")
    p.add_argument("--procs", type=int, default=1)
    p.add_argument("--batch", type=int, default=128, help="samples per process per step")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--max-steps", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--nesterov", type=int, default=1)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=29533)
    return p.parse_args()


def load(path):
    import h5py
    import numpy as np
    with h5py.File(path, "r") as f:
        n = int(f.attrs["committed_rows"]) if "committed_rows" in f.attrs else f["features"].shape[0]
        return np.ascontiguousarray(f["features"][:n]), f["labels"][:n].astype(np.int64)


def lr_at(a, step, total):
    """locus's schedule (lib/train/include/locus/train/optim/schedule.hpp)."""
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if a.schedule == "constant":
        return a.lr
    t, span = step - a.warmup, total - a.warmup
    return a.lr * (1 + math.cos(math.pi * min(t, span) / span)) / 2


def worker(rank, a):
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    import numpy as np
    import torch  # noqa: E402  (after the thread variables on purpose)
    torch.set_num_threads(a.threads)
    ddp = a.procs > 1
    if ddp:
        import torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
        dist.init_process_group("gloo", rank=rank, world_size=a.procs)
    torch.manual_seed(a.seed)
    widths = [int(w) for w in a.widths.split(",")]
    layers = []
    for i in range(len(widths) - 1):
        lin = torch.nn.Linear(widths[i], widths[i + 1])
        torch.nn.init.kaiming_normal_(lin.weight, nonlinearity="relu")  # locus init = he
        torch.nn.init.zeros_(lin.bias)
        layers.append(lin)
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    net = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum,
                          nesterov=bool(a.nesterov), weight_decay=a.weight_decay)
    loss_fn = torch.nn.CrossEntropyLoss()
    x_np, y_np = load(a.train)
    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    n = x.shape[0]
    global_batch = a.batch * a.procs
    steps_per_epoch = math.ceil(n / global_batch)
    total = steps_per_epoch * a.epochs
    if a.max_steps:
        total = min(total, a.max_steps)
    gen = torch.Generator().manual_seed(a.seed)
    step = 0
    t0 = time.perf_counter()
    samples = 0
    for _ in range(a.epochs):
        perm = torch.randperm(n, generator=gen)  # same on every rank: one global shuffle
        for k in range(steps_per_epoch):
            if step >= total:
                break
            batch = perm[k * global_batch:(k + 1) * global_batch]
            mine = batch[rank * len(batch) // a.procs:(rank + 1) * len(batch) // a.procs]
            for g in opt.param_groups:
                g["lr"] = lr_at(a, step, total)
            opt.zero_grad(set_to_none=True)
            loss_fn(net(x[mine]), y[mine]).backward()
            opt.step()
            samples += len(batch)
            step += 1
    seconds = time.perf_counter() - t0
    if rank == 0:
        print(f"torch {torch.__version__} procs={a.procs} threads={a.threads} batch/proc={a.batch} "
              f"steps={step} seconds={seconds:.2f}")
        print(f"samples_per_s {samples / seconds:.1f}")
        if a.test:
            xt, yt = load(a.test)
            with torch.no_grad():
                pred = model(torch.from_numpy(xt)).argmax(1).numpy()
            print(f"test_accuracy {np.mean(pred == yt):.4f}")
        sys.stdout.flush()
    if ddp:
        dist.destroy_process_group()


def main():
    a = parse_args()
    if a.procs == 1:
        worker(0, a)
        return 0
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, a)) for r in range(a.procs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode for p in procs)


if __name__ == "__main__":
    sys.exit(main())
