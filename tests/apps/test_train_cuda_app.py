"""locus-train with train.backend = cuda end to end under mpiexec on configs/tiny.ini (label gpu):
the GPU run against the CPU reference (weights and accuracy within tolerance), bitwise the same
with and without CUDA graphs, with the device cache and with the device gather (fp32 and bf16), SIGTERM to one rank mid-epoch then
--resume=auto bitwise equal to an uninterrupted GPU run, and a GPU checkpoint resumed on the CPU
and a CPU checkpoint on the GPU (each said on resume, each within tolerance). At 2 ranks on a
1-GPU host both ranks share the device and the gradients go through the host-staged reducer.

Where no GPU can run the backend (no device, or a build without CUDA), it prints why and exits 77,
which ctest reports as skipped (SKIP_RETURN_CODE)."""
import json
import os
import re
import sys
import tempfile

import numpy as np

from apphelpers import AppRunner, check, expect_exit, main
from test_resume_app import (EXIT_REQUEUE, expect_same_model, expect_same_steps, latest,
                             prepare, sigterm_mid_run, step_lines, tensors, train)

EXIT_SKIP = 77
CUDA = ["--train.backend=cuda"]


def relative(a_path, b_path):
    """Relative L2 distance of all tensors of two model files, together."""
    a, b = tensors(a_path), tensors(b_path)
    check(sorted(a) == sorted(b), "the model files hold other tensors")
    diff = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in a)
    ref = sum(float(np.sum(b[k].astype(np.float64) ** 2)) for k in b)
    return (diff / ref) ** 0.5


def last_eval(path):
    with open(path) as f:
        lines = [json.loads(l) for l in f if '"type":"epoch"' in l.replace(" ", "")]
    check(lines, f"{path} has no epoch line")
    return lines[-1]


def why_no_gpu(r, tmp):
    """The trainer's own verdict: None when the cuda backend runs here, else its message."""
    prepare(r, tmp)
    p = train(r, tmp, *CUDA, "--train.max_steps=1", "--optim.warmup_steps=0", "--train.output=probe.h5",
              "--train.metrics=probe.jsonl")
    if p.returncode == 0:
        return None
    text = p.stdout + p.stderr
    verdict = [l for l in text.splitlines() if "train.backend = cuda" in l]
    if p.returncode == 2 and verdict and "available: cpu" in verdict[0]:
        return verdict[0]
    raise AssertionError(f"the probe run failed otherwise (rc {p.returncode}):\n{text}")


def test_cuda_trains_like_the_cpu(r, tmp):
    prepare(r, tmp)
    cpu = train(r, tmp, "--train.output=cpu.h5", "--train.metrics=cpu.jsonl")
    expect_exit(cpu, 0)
    gpu = train(r, tmp, *CUDA, "--train.output=gpu.h5", "--train.metrics=gpu.jsonl")
    expect_exit(gpu, 0, "cuda fp32 on")
    # The summary's data wait, split into the loader's and the GPU stream's (cuda runs only).
    total = re.search(r"^trained .* data wait ([0-9.]+)%", gpu.stdout, re.M)
    split = re.search(r"^data wait: the loader \(host\) (-?[0-9.]+)%, the GPU's stream for its "
                      r"inputs (-?[0-9.]+)%$", gpu.stdout, re.M)
    check(total and split, "no summary line with the data wait split", gpu)
    host, device = float(split.group(1)), float(split.group(2))
    check(host >= 0 and device >= 0 and abs(host + device - float(total.group(1))) <= 0.02,
          f"data wait {total.group(1)}% split as {host}% + {device}%", gpu)
    check("data wait: the loader" not in cpu.stdout, "the CPU run printed a GPU's data wait", cpu)
    # 126 steps of SGD with momentum: the GEMMs sum in another order than OpenBLAS (the
    # elementwise kernels and the optimizer compute the CPU's bits), so the weights drift apart
    # by rounding only.
    rel = relative(os.path.join(tmp, "gpu.h5"), os.path.join(tmp, "cpu.h5"))
    check(rel <= 1e-3, f"GPU weights {rel:.2e} (relative) from the CPU's", gpu)
    a, b = last_eval(os.path.join(tmp, "gpu.jsonl")), last_eval(os.path.join(tmp, "cpu.jsonl"))
    check(abs(a["eval_accuracy"] - b["eval_accuracy"]) <= 0.01,
          f"test accuracy {a['eval_accuracy']} on the GPU, {b['eval_accuracy']} on the CPU", gpu)
    # The GPU's telemetry through NVML, every rank, every interval: plausible readings.
    with open(os.path.join(tmp, "gpu.jsonl")) as f:
        tele = [json.loads(l) for l in f if '"type":"telemetry"' in l.replace(" ", "")]
    check(tele, "no telemetry line in the GPU run's metrics", gpu)
    for t in tele:
        for key, low, high in (("gpu_mem_total_mib", 1024, 1 << 22), ("gpu_sm_clock_mhz", 1, 10000),
                               ("gpu_power_w", 1, 5000), ("gpu_temp_c", 1, 150)):
            values = t.get(key, [])
            check(len(values) == r.ranks and all(low <= v <= high for v in values),
                  f"telemetry step {t.get('step')}: {key} = {values} (NVML not read?)", gpu)


def test_graphs_and_device_cache_give_the_same_bits(r, tmp):
    """Graphs or not, batches streamed, cached on the GPU or gathered by it from host memory:
    the same bits, in fp32 and in bf16 (where the cache and the gather hold bf16 samples, as
    the start-up line `data:` says)."""
    prepare(r, tmp)
    bf16 = ["--train.precision=bf16"]
    cache, gather = ["--loader.device_cache_mb=16"], ["--loader.gather=device"]
    # name: (options, the run it must equal, what its `data:` line says)
    runs = {"graphs": ([], None, "; copied to the GPU as page-locked batches"),
            "eager": (["--train.graphs=false"], "graphs", None),
            "cached": (cache, "graphs", "; cached on the GPU ("),
            # page-locked in place, or a copy where the MPI library had locked the block
            "mapped": (gather, "graphs", "; gathered by the GPU over the host link"),
            "bf16": (bf16, None, "; copied to the GPU as page-locked batches"),
            "bf16-cached": (bf16 + cache, "bf16", "; cached on the GPU as bf16 ("),
            "bf16-mapped": (bf16 + gather, "bf16", "; gathered by the GPU over the host link "
                                                   "from a page-locked bf16 copy (")}
    for name, (extra, _, says) in runs.items():
        p = train(r, tmp, *CUDA, *extra, f"--train.output={name}.h5",
                  f"--train.metrics={name}.jsonl")
        expect_exit(p, 0, *(["  data: the whole set in memory on every rank ("] +
                            ([says] if says else [])))
    for name, (_, same_as, _) in runs.items():
        if same_as is None:
            continue
        want = step_lines(os.path.join(tmp, f"{same_as}.jsonl"))
        expect_same_model(os.path.join(tmp, f"{name}.h5"), os.path.join(tmp, f"{same_as}.h5"),
                          name)
        expect_same_steps(step_lines(os.path.join(tmp, f"{name}.jsonl")), want, name)


def test_sigterm_on_the_gpu_resumes_bitwise(r, tmp):
    prepare(r, tmp)
    expect_exit(train(r, tmp, *CUDA, "--train.output=u.h5", "--train.metrics=u.jsonl"), 0)
    want = step_lines(os.path.join(tmp, "u.jsonl"))
    p = sigterm_mid_run(r, tmp, *CUDA, "--checkpoint.dir=ck", "--train.output=p.h5",
                        "--train.metrics=p.jsonl")
    expect_exit(p, EXIT_REQUEUE, "SIGTERM received: checkpointing step")
    stop = step_lines(os.path.join(tmp, "p.jsonl"))[-1]["step"]
    check(0 < stop < 126 and stop % 63 != 0, f"stopped at step {stop}, not mid-epoch", p)
    check(latest(os.path.join(tmp, "ck"))["latest"] == f"ckpt-{stop:08d}.h5", "latest", p)
    q = train(r, tmp, *CUDA, "--checkpoint.dir=ck", "--resume=auto", "--train.output=p.h5",
              "--train.metrics=p.jsonl")
    expect_exit(q, 0, f"resumed from ck/ckpt-{stop:08d}.h5")
    expect_same_model(os.path.join(tmp, "p.h5"), os.path.join(tmp, "u.h5"), "GPU resumed")
    expect_same_steps(step_lines(os.path.join(tmp, "p.jsonl")), want, "GPU resumed metrics")


def test_checkpoints_cross_between_gpu_and_cpu(r, tmp):
    prepare(r, tmp)
    for first, second in ((CUDA, []), ([], CUDA)):
        tag = "gpu-to-cpu" if first else "cpu-to-gpu"
        # A whole run on one backend that also checkpoints at step 70 (mid epoch 2) ...
        p = train(r, tmp, *first, f"--checkpoint.dir=ck-{tag}", "--checkpoint.every_steps=70",
                  "--checkpoint.keep_last=8", f"--train.output={tag}-first.h5",
                  f"--train.metrics={tag}-first.jsonl")
        expect_exit(p, 0)
        # ... its step-70 checkpoint finished on the other backend, against a whole run there.
        q = train(r, tmp, *second, f"--checkpoint.dir=ck2-{tag}",
                  f"--resume=ck-{tag}/ckpt-00000070.h5", f"--train.output={tag}.h5",
                  f"--train.metrics={tag}.jsonl")
        expect_exit(q, 0, f"resumed from ck-{tag}/ckpt-00000070.h5",
                    "written by cuda" if first else "continuing on cuda")
        expect_exit(train(r, tmp, *second, f"--train.output={tag}-straight.h5",
                          f"--train.metrics={tag}-straight.jsonl"), 0)
        straight = os.path.join(tmp, f"{tag}-straight.h5")
        rel = relative(os.path.join(tmp, f"{tag}.h5"), straight)
        check(rel <= 1e-3, f"{tag}: {rel:.2e} (relative) from an uninterrupted run", q)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: test_train_cuda_app.py BINDIR RANKS")
    with tempfile.TemporaryDirectory(prefix="locus-cuda-probe-") as probe_dir:
        why = why_no_gpu(AppRunner(sys.argv[1], int(sys.argv[2])), probe_dir)
    if why is not None:
        print(f"skipped: train.backend = cuda cannot run here: {why}")
        sys.exit(EXIT_SKIP)
    main([test_cuda_trains_like_the_cpu, test_graphs_and_device_cache_give_the_same_bits,
          test_sigterm_on_the_gpu_resumes_bitwise, test_checkpoints_cross_between_gpu_and_cpu])
