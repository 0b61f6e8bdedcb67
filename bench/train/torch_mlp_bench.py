#!/usr/bin/python3
"""PyTorch twin of locus_mlp_bench: samples/s of MLP training steps on synthetic in-memory data.

Reports the median samples/s by the wall clock and by process CPU time (which leaves out
the time other jobs hold the core on a shared machine; equal to busy time with 1 thread).
Thread counts are pinned through the environment *before* torch is imported (OpenBLAS and
OpenMP read them once at load time) and again with torch.set_num_threads afterwards.
"""
import argparse
import os
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--widths", default="784,256,128,10")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    p.add_argument("--steps", type=int, default=200, help="timed steps per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def main():
    args = parse_args()
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch  # noqa: E402  (imported after the thread variables on purpose)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    widths = [int(w) for w in args.widths.split(",")]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    loss_fn = torch.nn.CrossEntropyLoss()
    if args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

    pool = 8  # distinct batches cycled, as an in-memory loader would hand them out
    xs = [torch.randn(args.batch, widths[0]) for _ in range(pool)]
    ys = [torch.randint(0, widths[-1], (args.batch,)) for _ in range(pool)]

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(xs[i % pool]), ys[i % pool])
        loss.backward()
        opt.step()

    for i in range(max(10, args.steps // 10)):  # warm-up
        step(i)
    rates, cpu_rates = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        for i in range(args.steps):
            step(i)
        cpu_rates.append(args.steps * args.batch / (time.process_time() - c0))
        rates.append(args.steps * args.batch / (time.perf_counter() - t0))
    print(f"torch {torch.__version__} widths={args.widths} batch={args.batch} "
          f"optimizer={args.optimizer} threads={args.threads}")
    print(f"samples_per_s {statistics.median(rates):.1f}")
    print(f"cpu_samples_per_s {statistics.median(cpu_rates):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
