#!/usr/bin/env python3
"""Floors for one training step of the GPU benchmark workloads (bench/gpu): FLOPs, the fewest
bytes that must cross device memory, kernel launches, and the time each of these allows on an
H100 (METHOD.md's "two numbers first"; a step cannot run faster than the largest floor).

  counts.py [--bf16-tflops 790] [--fp32-tflops 67] [--tf32-tflops 495] [--mem-tbs 3.0]
            [--h2d-gbs 55] [--launch-us 2,4] [--graph-node-us 1] [--measured LIST]
            [--json | --markdown]

Counted per step of batch B through layers l = 0..L-1 (in_l -> out_l):
  FLOPs   forward 2*B*in*out per layer; backward 4*B*in*out (weight and input gradient),
          except layer 0, which needs no input gradient: 2*B*in*out. Element-wise work (bias,
          ReLU, loss, optimizer) is left out: it is bytes, not FLOPs.
  bytes   parameters read once and written once (the update); gradients written once and read
          once; optimizer state read once and written once (SGD momentum 1 buffer, Adam/AdamW 2);
          each layer's output written once and read once (backward), and so its gradient
          (layer 0's input gradient is never formed); the batch (features + int32 labels) read
          once. fp32 everywhere, except under bf16: activations and their gradients are bf16
          and a bf16 copy of the weights is written once and read once (fp32 master weights,
          gradients and state, as locus's train.precision=bf16 keeps them).
  launches the fewest kernels a straightforward eager step runs: per layer one GEMM (bias in its
          epilogue) and one activation (not the last); one fused softmax-cross-entropy forward+
          gradient; backward per layer one weight-gradient GEMM and one bias reduction, one
          input-gradient GEMM and one activation backward (not layer 0); the optimizer as one
          multi-tensor kernel. PyTorch's eager step runs more (torch_gpu_bench.py counts them).
Peaks (defaults): bf16 GEMM 790 TFLOP/s and D2D copy 3.0 TB/s (read + written) are MEASURED on
this workplace's H100 (KINDS.md, 2026-11-13: 798 TFLOP/s for 8192^3 bf16 on random data, ~3.0
TB/s D2D); fp32 67 TFLOP/s (no tensor cores) and tf32 495 TFLOP/s dense are the H100 SXM5
DATASHEET; pinned host->device 55 GB/s is an ASSUMPTION (PCIe 5.0 x16 is 64 GB/s raw):
torch_gpu_bench.py measures all of them on the host; pass its figures back in. The launch
costs (2-4 us per eager launch from the host, ~1 us per kernel inside a graph replay) are
assumptions, not measurements.
"""
import argparse
import json
import sys

DEEP = [784] + [2048] * 7 + [10]  # configs/deep-mlp.ini [model] widths: 8 layers

# name, widths, optimizer, batches, precision
WORKLOADS = [
    ("fashion-mnist", [784, 256, 128, 10], "sgd-nesterov", [128, 1024, 8192], "fp32"),
    ("fashion-mnist", [784, 256, 128, 10], "sgd-nesterov", [128, 1024, 8192], "bf16"),
    ("simplenet", [1024, 512, 10], "adam", [64, 4096], "fp32"),
    ("deep-mlp", DEEP, "adamw", [4096], "bf16"),
]
STATE_BUFFERS = {"sgd": 0, "sgd-nesterov": 1, "adam": 2, "adamw": 2}


def layers(widths):
    return list(zip(widths[:-1], widths[1:]))


def flops(widths, batch):
    total = 0
    for i, (a, b) in enumerate(layers(widths)):
        total += 2 * batch * a * b + (2 if i == 0 else 4) * batch * a * b
    return total


def params(widths):
    return sum(a * b + b for a, b in layers(widths))


def device_bytes(widths, batch, optimizer, precision):
    p = params(widths)
    act = 2 if precision == "bf16" else 4
    outs = [b for _, b in layers(widths)]
    b = {
        "parameters": 2 * 4 * p,                       # read + written by the update
        "gradients": 2 * 4 * p,                        # written + read
        "optimizer_state": 2 * 4 * p * STATE_BUFFERS[optimizer],
        "activations": 2 * act * batch * sum(outs),    # written + read
        "activation_grads": 2 * act * batch * sum(outs),  # layer outputs' gradients; none for the input
        "batch": batch * (widths[0] * 4 + 4),
    }
    if precision == "bf16":
        b["bf16_weights"] = 2 * 2 * p                  # the cast copy, written + read
    return b


def launches(widths):
    n = len(widths) - 1
    forward = n + (n - 1) + 1             # GEMMs, activations, fused loss
    backward = n + n + (n - 1) + (n - 1)  # dW GEMMs, bias reductions, dX GEMMs, activation backward
    return forward + backward + 1         # one multi-tensor optimizer kernel


def rows(a):
    peak = {"fp32": a.fp32_tflops, "tf32": a.tf32_tflops, "bf16": a.bf16_tflops}
    lo, hi = (float(x) for x in a.launch_us.split(","))
    out = []
    for name, widths, opt, batches, prec in WORKLOADS:
        for batch in batches:
            f = flops(widths, batch)
            bb = device_bytes(widths, batch, opt, prec)
            nbytes = sum(bb.values())
            k = launches(widths)
            t = {
                "compute_us": f / (peak[prec] * 1e12) * 1e6,
                "memory_us": nbytes / (a.mem_tbs * 1e12) * 1e6,
                "launch_eager_us": (k * lo, k * hi),
                "graph_us": k * a.graph_node_us,
                "h2d_batch_us": bb["batch"] / (a.h2d_gbs * 1e9) * 1e6,
            }
            device_floor = max(t["compute_us"], t["memory_us"])
            bound = max((("compute", t["compute_us"]), ("memory", t["memory_us"]),
                         ("launch", k * lo)), key=lambda kv: kv[1])[0]
            out.append({
                "workload": name, "widths": widths, "optimizer": opt, "batch": batch,
                "precision": prec, "params": params(widths), "flops": f, "bytes": nbytes,
                "bytes_by_kind": bb, "launches": k, "floors_us": t, "bound_eager": bound,
                "device_floor_us": device_floor,
                "samples_per_s_device_floor": batch / (device_floor * 1e-6),
                "samples_per_s_eager_launch_floor": batch / (max(device_floor, k * lo) * 1e-6),
                "samples_per_s_graph_floor": batch / (max(device_floor, t["graph_us"]) * 1e-6),
            })
    return out


def table(rs, a):
    head = (f"{'workload':<14}{'prec':<5}{'batch':>6}{'GFLOP':>8}{'MB':>8}{'kern':>5}"
            f"{'comp us':>9}{'mem us':>8}{'eager launch us':>17}{'graph us':>9}{'H2D us':>8}"
            f"  {'bound (eager)':<14}{'Msamples/s: device':>19}{'graph':>8}{'eager':>8}")
    lines = [head]
    for r in rs:
        t = r["floors_us"]
        lines.append(
            f"{r['workload']:<14}{r['precision']:<5}{r['batch']:>6}{r['flops'] / 1e9:>8.2f}"
            f"{r['bytes'] / 1e6:>8.1f}{r['launches']:>5}{t['compute_us']:>9.1f}{t['memory_us']:>8.1f}"
            f"{'%.0f-%.0f' % t['launch_eager_us']:>17}{t['graph_us']:>9.0f}{t['h2d_batch_us']:>8.1f}"
            f"  {r['bound_eager']:<14}{r['samples_per_s_device_floor'] / 1e6:>19.2f}"
            f"{r['samples_per_s_graph_floor'] / 1e6:>8.2f}{r['samples_per_s_eager_launch_floor'] / 1e6:>8.2f}")
    lines.append(
        f"peaks: bf16 {a.bf16_tflops:g} TFLOP/s ({a.bf16_src}), fp32 {a.fp32_tflops:g} ({a.fp32_src}), "
        f"tf32 {a.tf32_tflops:g} ({a.tf32_src}), device memory {a.mem_tbs:g} TB/s ({a.mem_src}), "
        f"pinned H2D {a.h2d_gbs:g} GB/s ({a.h2d_src}); launch {a.launch_us} us eager, "
        f"{a.graph_node_us:g} us per graph node (assumed)")
    lines.append("H2D us: the batch's host->device copy when streamed (hidden only if it overlaps "
                 "the step); Msamples/s at the floors: device = max(compute, memory), graph adds "
                 "the per-node floor, eager the low launch figure")
    return "\n".join(lines)


def markdown(rs):
    lines = ["| workload | precision | batch | GFLOP/step | MB/step | kernels | compute µs | memory µs "
             "| eager launch µs | H2D µs (streamed) | bound (eager) | floor samples/s (graph) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rs:
        t = r["floors_us"]
        lines.append(f"| {r['workload']} {'-'.join(map(str, r['widths'])) if r['workload'] != 'deep-mlp' else '784-2048x7-10'}"
                     f" | {r['precision']} | {r['batch']} | {r['flops'] / 1e9:.2f} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['launches']} | {t['compute_us']:.1f} | {t['memory_us']:.1f} | "
                     f"{'%.0f-%.0f' % t['launch_eager_us']} | {t['h2d_batch_us']:.1f} | {r['bound_eager']} | "
                     f"{r['samples_per_s_graph_floor'] / 1e6:.2f} M |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bf16-tflops", type=float, default=790.0)
    p.add_argument("--fp32-tflops", type=float, default=67.0)
    p.add_argument("--tf32-tflops", type=float, default=495.0)
    p.add_argument("--mem-tbs", type=float, default=3.0)
    p.add_argument("--h2d-gbs", type=float, default=55.0)
    p.add_argument("--launch-us", default="2,4", help="eager launch cost per kernel, low,high")
    p.add_argument("--graph-node-us", type=float, default=1.0)
    p.add_argument("--measured", default="",
                   help="peaks passed on the command line that were measured (comma list of "
                        "bf16,fp32,tf32,mem,h2d); the others are labelled by their defaults' source")
    p.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    p.add_argument("--markdown", action="store_true", help="a Markdown table (bench/RESULTS.md)")
    a = p.parse_args(argv)
    default_src = {"bf16": "measured, KINDS.md", "mem": "measured, KINDS.md",
                   "fp32": "datasheet", "tf32": "datasheet", "h2d": "assumed"}
    measured = set(filter(None, a.measured.split(",")))
    for k, v in default_src.items():
        setattr(a, k + "_src", "measured" if k in measured else v)
    return a


def main():
    a = parse_args()
    rs = rows(a)
    if a.json:
        for r in rs:
            print(json.dumps(r))
    elif a.markdown:
        print(markdown(rs))
    else:
        print(table(rs, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
