"""locus-infer with infer.backend = cuda end to end under mpiexec (label gpu): 10000 rows of 784
features (a plain HDF5 input written here, so the GPU host needs no dataset) scored on the GPU against the CPU run (probabilities within 1e-5, argmax and top-k equal
except at near-ties, the same report metrics), the same bytes at N ranks as at 1 rank with and
without speculation and with one-batch reads, a slowed rank overtaken with unchanged bytes, and
incremental runs after appends (one killed before its watermark moves) equal to a full GPU run.
At 2 ranks on a 1-GPU host both ranks share the device.

Where the engine cannot run (no device, or a build without CUDA) it prints why and exits 77,
which ctest reports as skipped (SKIP_RETURN_CODE)."""
import os
import sys
import tempfile

import h5py
import numpy as np

from apphelpers import AppRunner, check, expect_exit, main
from test_infer_app import (EXIT_CONFIG, csv_rows, infer, ingest_csv, read_scores, report, same,
                            write_csv, write_model)

EXIT_SKIP = 77
CUDA = ["--infer.backend=cuda"]


def why_no_gpu(r, tmp):
    """locus-infer's own verdict: None when the cuda engine runs here, else its message."""
    rng = np.random.default_rng(1)
    x, y = csv_rows(rng, 64)
    csv, data = os.path.join(tmp, "p.csv"), os.path.join(tmp, "p.h5")
    write_csv(csv, x, y)
    ingest_csv(r, csv, data)
    model = write_model(os.path.join(tmp, "pm.h5"), [12, 8, 4])
    p = infer(r, model, data, os.path.join(tmp, "ps.h5"), *CUDA, ranks=1)
    if p.returncode == 0:
        return None
    text = p.stdout + p.stderr
    verdict = [line for line in text.splitlines() if "infer.backend = cuda" in line]
    if p.returncode == EXIT_CONFIG and verdict:
        return verdict[0]
    raise AssertionError(f"the probe run failed otherwise (rc {p.returncode}):\n{text}")


def image_like_input(tmp, rows=10000, cols=784, classes=10, seed=0):
    """A plain HDF5 input (float32 /features in [0, 1], int32 /labels), as locus-infer reads any."""
    rng = np.random.default_rng(seed)
    x = rng.random((rows, cols), dtype=np.float32)
    y = rng.integers(0, classes, size=rows).astype(np.int32)
    path = os.path.join(tmp, "input.h5")
    with h5py.File(path, "w") as f:
        f["features"] = x
        f["labels"] = y
    return path, x, y


def test_gpu_scores_like_the_cpu(r, tmp):
    test, _, y = image_like_input(tmp)
    model = write_model(os.path.join(tmp, "m.h5"), [784, 256, 128, 10], seed=1)
    cpu, gpu = os.path.join(tmp, "cpu.h5"), os.path.join(tmp, "gpu.h5")
    expect_exit(infer(r, model, test, cpu), 0)
    expect_exit(infer(r, model, test, gpu, *CUDA, "--infer.record_writer=true"), 0,
                "compute: cuda fp32 on device", "scored 10000 rows")
    c, _ = read_scores(cpu)
    g, attrs = read_scores(gpu)
    diff = np.abs(g["scores"].astype(np.float64) - c["scores"]).max()
    check(diff <= 1e-5, f"GPU probabilities {diff:.2e} from the CPU's")
    # Argmax and top-3 as on the CPU, except where the CPU's two probabilities are a near-tie.
    p = c["scores"]
    rows = np.arange(len(p))
    for name, a, b in (("predicted", g["predicted"], c["predicted"]),
                       *((f"top-{t + 1}", g["topk_classes"][:, t], c["topk_classes"][:, t])
                         for t in range(3))):
        bad = a != b
        gap = np.abs(p[rows[bad], a[bad]] - p[rows[bad], b[bad]])
        check(np.all(gap <= 1e-5), f"{name} differs beyond a near-tie in {int(bad.sum())} rows")
    check(np.all(g["writer"] >= 0), "unwritten rows")
    mc, mg = report(cpu)["metrics"], report(gpu)["metrics"]
    flips = int(np.sum(g["predicted"] != c["predicted"]))
    check(abs(mg["correct"] - mc["correct"]) <= flips, f"correct {mg['correct']} vs {mc['correct']}")
    check(abs(mg["log_loss"] - mc["log_loss"]) <= 1e-6, f"log-loss {mg['log_loss']} vs {mc['log_loss']}")
    check(mg["accuracy"] == float(np.mean(g["predicted"] == y)), "report accuracy vs /predicted")
    check(attrs["committed_rows"] == 10000, "committed_rows")


def test_gpu_bytes_identical_across_world_sizes_and_speculation(r, tmp):
    test, _, _ = image_like_input(tmp)
    model = write_model(os.path.join(tmp, "m.h5"), [784, 64, 10], seed=2)
    ref_out = os.path.join(tmp, "one.h5")
    expect_exit(infer(r, model, test, ref_out, *CUDA, "--infer.unit_rows=668", ranks=1), 0)
    ref, _ = read_scores(ref_out)
    for spec, reads in (("true", "0"), ("false", "0"), ("true", "1")):
        out = os.path.join(tmp, f"n-{spec}-{reads}.h5")
        p = infer(r, model, test, out, *CUDA, "--infer.unit_rows=668", f"--infer.speculate={spec}",
                  f"--infer.read_rows={reads}", "--infer.record_writer=true")
        expect_exit(p, 0)
        s, _ = read_scores(out)
        same(s, ref, f"GPU: {r.ranks} ranks, speculate={spec}, read_rows={reads} vs 1 rank")
        check(np.all(s["writer"] >= 0), "unwritten rows")
        rep = report(out)
        check(rep["units"] == 15 and rep["units_written_once"] == 15, f"units {rep['units']}")


def test_gpu_slow_rank_triggers_speculation(r, tmp):
    if r.ranks < 2:
        return
    test, _, _ = image_like_input(tmp)
    model = write_model(os.path.join(tmp, "m.h5"), [784, 64, 10], seed=3)
    ref_out = os.path.join(tmp, "ref.h5")
    expect_exit(infer(r, model, test, ref_out, *CUDA, "--infer.unit_rows=334", ranks=1), 0)
    out = os.path.join(tmp, "slow.h5")
    for _ in range(4):
        p = infer(r, model, test, out, *CUDA, "--infer.unit_rows=334", "--infer.slow_ranks=1",
                  "--infer.slow_ms=400", "--infer.record_writer=true", "--overwrite")
        expect_exit(p, 0)
        rep = report(out)
        if rep["per_rank"][1]["units_claimed"] > 0:
            break
    check(rep["per_rank"][1]["units_claimed"] > 0, "the slow rank never got a unit", p)
    check(rep["speculative_runs"] > 0 and rep["speculative_wins"] > 0,
          f"a slowed rank must cause speculative re-runs that win: {rep['per_rank']}", p)
    s, _ = read_scores(out)
    ref, _ = read_scores(ref_out)
    same(s, ref, "GPU output with a slowed rank")
    check(np.all(s["writer"] >= 0), "unwritten rows")


def test_gpu_incremental_equals_full_and_survives_a_crash(r, tmp):
    rng = np.random.default_rng(4)
    x, y = csv_rows(rng, 2300)
    a, b, c = (os.path.join(tmp, f"{n}.csv") for n in "abc")
    write_csv(a, x[:1000], y[:1000])
    write_csv(b, x[1000:1700], y[1000:1700])
    write_csv(c, x[1700:], y[1700:])
    data, model = os.path.join(tmp, "d.h5"), write_model(os.path.join(tmp, "m.h5"), [12, 16, 4])
    out, full = os.path.join(tmp, "inc.h5"), os.path.join(tmp, "full.h5")
    args = (*CUDA, "--infer.unit_rows=150", "--infer.batch_rows=64", "--infer.record_writer=true")
    ingest_csv(r, a, data)
    expect_exit(infer(r, model, data, out, *args), 0, "scored 1000 rows")
    ingest_csv(r, b, data, "--append")
    expect_exit(infer(r, model, data, out, "--incremental", *args), 0,
                "incrementally scored 700 rows [1000, 1700)")
    ingest_csv(r, c, data, "--append")
    p = infer(r, model, data, out, "--incremental", *args,
              env={"LOCUS_TEST_HOOK": "infer-before-watermark:kill@0"})
    check(p.returncode != 0, "the killed run must fail", p)
    expect_exit(infer(r, model, data, out, "--incremental", *args), 0, "[1700, 2300)")
    expect_exit(infer(r, model, data, full, *args), 0, "scored 2300 rows")
    s, attrs = read_scores(out)
    ref, _ = read_scores(full)
    check(attrs["committed_rows"] == 2300, "final watermark")
    same(s, ref, "GPU incremental (with a crash) vs full GPU run")
    check(np.all(s["writer"] >= 0), "unwritten rows after the incremental runs")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: test_infer_cuda_app.py BINDIR RANKS")
    with tempfile.TemporaryDirectory(prefix="locus-cuda-probe-") as probe_dir:
        why = why_no_gpu(AppRunner(sys.argv[1], int(sys.argv[2])), probe_dir)
    if why is not None:
        print(f"skipped: infer.backend = cuda cannot run here: {why}")
        sys.exit(EXIT_SKIP)
    main([test_gpu_scores_like_the_cpu, test_gpu_bytes_identical_across_world_sizes_and_speculation,
          test_gpu_slow_rank_triggers_speculation,
          test_gpu_incremental_equals_full_and_survives_a_crash])
