"""End-to-end tests of locus-infer under mpiexec: scores against numpy and PyTorch, identical
outputs across world sizes and speculation, exactly-once writes, stragglers, incremental runs
after locus-ingest --append (also after a crash before the watermark), plain HDF5 inputs,
checkpoints, accuracy equal to the trainer's evaluation, bad inputs."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

# Many runs here fail on purpose; Open MPI's mpiexec then waits odls_base_sigkill_timeout (1 s)
# per step of tearing the job down, about 2 s per failed run. The ranks of an agreed error have
# all exited by then, so nothing is lost by not waiting (an explicit setting wins).
os.environ.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "0")

import h5py
import numpy as np

from apphelpers import (FASHION, check, expect_exit, hold_lock_file, lock_is_free, lock_path, main,
                        no_outputs, progress_lines, prometheus_values, suspended, whole_units)

EXIT_CONFIG, EXIT_DATA = 2, 3
DATASETS = ("scores", "predicted", "topk_classes", "topk_scores")


def write_model(path, widths, seed=0, activation="relu", loss="cross_entropy", group="/", fmt=None):
    """A random model in the documented layout, written with h5py."""
    rng = np.random.default_rng(seed)
    with h5py.File(path, "a" if group != "/" else "w") as f:
        g = f.require_group(group)
        for i in range(len(widths) - 1):
            g[f"layers.{i}.weight"] = (rng.standard_normal((widths[i + 1], widths[i])) *
                                       np.sqrt(2.0 / widths[i])).astype(np.float32)
            g[f"layers.{i}.bias"] = (rng.standard_normal(widths[i + 1]) * 0.1).astype(np.float32)
        g.attrs["locus_format"] = "locus-model"
        g.attrs["schema_version"] = 1
        g.attrs["widths"] = np.array(widths, dtype=np.int64)
        g.attrs["activation"] = activation
        g.attrs["loss"] = loss
        if fmt:
            f.attrs["locus_format"] = fmt
    return path


def forward64(model_path, x, group="/"):
    """Serial numpy reference in float64: the logits."""
    with h5py.File(model_path, "r") as f:
        g = f[group]
        widths = list(g.attrs["widths"])
        h = x.astype(np.float64)
        for i in range(len(widths) - 1):
            h = h @ g[f"layers.{i}.weight"][:].astype(np.float64).T + g[f"layers.{i}.bias"][:]
            if i < len(widths) - 2:
                h = np.maximum(h, 0.0)
    return h


def softmax(z):
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def read_scores(path):
    with h5py.File(path, "r") as f:
        n = int(f.attrs["committed_rows"])
        return {k: f[k][:n] for k in (*DATASETS, "writer") if k in f}, dict(f.attrs)


def report(path):
    with open(path + ".report.json") as f:
        return json.load(f)


def infer(r, model, inp, out, *extra, ranks=None, env=None):
    return r.run("locus-infer", f"--infer.model={model}", f"--infer.input={inp}",
                 f"--infer.output={out}", *extra, ranks=ranks, env=env)


def ingest_fashion_test(r, tmp):
    out = os.path.join(tmp, "test.h5")
    p = r.run("locus-ingest", f"--ingest.images={FASHION}/t10k-images-idx3-ubyte.gz",
              f"--ingest.labels={FASHION}/t10k-labels-idx1-ubyte.gz", f"--ingest.output={out}")
    expect_exit(p, 0)
    with h5py.File(out, "r") as f:
        return out, f["features"][:], f["labels"][:]


def same(a, b, what):
    for k in DATASETS:
        if k in a or k in b:
            check(k in a and k in b, f"{what}: dataset {k} missing on one side")
            check(a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes(),
                  f"{what}: /{k} differs")


def test_fashion_mnist_matches_numpy(r, tmp):
    test, x, y = ingest_fashion_test(r, tmp)
    model = write_model(os.path.join(tmp, "m.h5"), [784, 256, 128, 10], seed=1)
    out = os.path.join(tmp, "s.h5")
    p = infer(r, model, test, out, "--infer.record_writer=true")
    expect_exit(p, 0, "scored 10000 rows", "accuracy")
    s, attrs = read_scores(out)
    z = forward64(model, x)
    ref = softmax(z)
    check(np.abs(s["scores"] - ref).max() < 1e-5, f"probabilities differ from numpy by "
          f"{np.abs(s['scores'] - ref).max()}")
    # Every argmax disagreement must be a near-tie of the float64 logits.
    top2 = np.sort(z, axis=1)[:, -2:]
    differ = s["predicted"] != z.argmax(axis=1)
    check(np.all(top2[differ, 1] - top2[differ, 0] < 1e-4), "argmax differs beyond a near-tie")
    order = np.argsort(-z, axis=1, kind="stable")[:, :3]
    check(np.mean(np.all(s["topk_classes"] == order, axis=1)) > 0.999, "top-3 classes differ")
    check(np.array_equal(s["topk_classes"][:, 0], s["predicted"]), "top-1 must be the argmax")
    rep = report(out)
    m = rep["metrics"]
    acc_locus = float(np.mean(s["predicted"] == y))
    acc_numpy = float(np.mean(z.argmax(axis=1) == y))
    check(m["accuracy"] == acc_locus, f"report accuracy {m['accuracy']} != {acc_locus}")
    check(abs(acc_locus - acc_numpy) <= differ.sum() / len(y), f"accuracy {acc_locus} vs numpy {acc_numpy}")
    logloss = float(np.mean(np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1) - z[np.arange(len(y)), y]))
    check(abs(m["log_loss"] - logloss) < 1e-5, f"log-loss {m['log_loss']} vs numpy {logloss}")
    conf = np.zeros((10, 10), np.int64)
    np.add.at(conf, (y, s["predicted"]), 1)
    check(np.array_equal(np.array(m["confusion"]), conf), "confusion matrix differs")
    # Exactly once: every row has a writer, and the ranks' written rows add up to N.
    check(np.all((s["writer"] >= 0) & (s["writer"] < r.ranks)), "a row was never written")
    check(sum(x["rows_written"] for x in rep["per_rank"]) == 10000, "rows written != 10000")
    check(rep["units_written_once"] == rep["units"], "a unit was not written exactly once")
    for k, cnt in zip(*np.unique(s["writer"], return_counts=True)):
        check(rep["per_rank"][k]["rows_written"] == cnt, f"rank {k} wrote {cnt} rows, report says otherwise")
    check(attrs["committed_rows"] == 10000 and attrs["kind"] == "probabilities", "attributes")
    # The report's times nest: start-up before the input (seconds_init), then scoring.
    check(0 < rep["seconds_init"] and rep["seconds_init"] + rep["seconds"] <= rep["seconds_total"],
          f"times do not nest: init {rep['seconds_init']}, scoring {rep['seconds']}, "
          f"total {rep['seconds_total']}")


def test_identical_across_world_sizes_and_speculation(r, tmp):
    test, _, _ = ingest_fashion_test(r, tmp)
    model = write_model(os.path.join(tmp, "m.h5"), [784, 64, 10], seed=2)
    ref_out = os.path.join(tmp, "one.h5")
    expect_exit(infer(r, model, test, ref_out, "--infer.unit_rows=668", ranks=1), 0)
    ref, _ = read_scores(ref_out)
    # read_rows=1: each rank reads one batch (256 rows) at a time ahead of its compute thread,
    # three reads per 668-row unit, the last one short.
    for spec, reads in (("true", "0"), ("false", "0"), ("true", "1")):
        out = os.path.join(tmp, f"n-{spec}-{reads}.h5")
        p = infer(r, model, test, out, "--infer.unit_rows=668", f"--infer.speculate={spec}",
                  f"--infer.read_rows={reads}", "--infer.record_writer=true")
        expect_exit(p, 0)
        s, _ = read_scores(out)
        same(s, ref, f"{r.ranks} ranks, speculate={spec}, read_rows={reads} vs 1 rank")
        check(np.all(s["writer"] >= 0), "unwritten rows")
        rep = report(out)
        check(rep["units"] == 15 and rep["units_written_once"] == 15, f"units {rep['units']}")
        if spec == "false":
            check(rep["speculative_runs"] == 0, "speculation off must not re-run units")


def test_slow_rank_triggers_speculation(r, tmp):
    if r.ranks < 2:
        return
    test, _, _ = ingest_fashion_test(r, tmp)
    model = write_model(os.path.join(tmp, "m.h5"), [784, 64, 10], seed=3)
    ref_out = os.path.join(tmp, "ref.h5")
    expect_exit(infer(r, model, test, ref_out, "--infer.unit_rows=334", ranks=1), 0)
    out = os.path.join(tmp, "slow.h5")
    # Rank 1 sleeps 10 s before each unit it claims, cut short once another rank finishes that
    # unit: the fast ranks always have time to overtake it, and a passing run takes no longer.
    # On a loaded machine the fast ranks may take every unit before the slow rank is scheduled;
    # such a run proves nothing, so try again (a few times at most).
    for _ in range(4):
        p = infer(r, model, test, out, "--infer.unit_rows=334", "--infer.slow_ranks=1",
                  "--infer.slow_ms=10000", "--infer.record_writer=true", "--overwrite")
        expect_exit(p, 0)
        rep = report(out)
        if rep["per_rank"][1]["units_claimed"] > 0:
            break
    check(rep["per_rank"][1]["units_claimed"] > 0, "the slow rank never got a unit", p)
    check(rep["speculative_runs"] > 0 and rep["speculative_wins"] > 0,
          f"a slowed rank must cause speculative re-runs that win: {rep['per_rank']}", p)
    check(rep["per_rank"][1]["abandoned_runs"] > 0, "the slow rank must drop re-run units")
    fast = sum(x["rows_written"] for i, x in enumerate(rep["per_rank"]) if i != 1)
    check(fast > rep["per_rank"][1]["rows_written"], "faster ranks must take more rows")
    s, _ = read_scores(out)
    ref, _ = read_scores(ref_out)
    same(s, ref, "output with a slowed rank")
    check(np.all(s["writer"] >= 0), "unwritten rows")


def csv_rows(rng, n, d=12, classes=4):
    x = np.round(rng.normal(size=(n, d)), 5)
    y = rng.integers(0, classes, size=n)
    return x, y


def write_csv(path, x, y):
    with open(path, "w") as f:
        f.write(",".join([f"f{i}" for i in range(x.shape[1])] + ["y"]) + "\n")
        for xi, yi in zip(x, y):
            f.write(",".join(repr(float(v)) for v in xi) + f",{int(yi)}\n")


def ingest_csv(r, csv, out, *extra):
    p = r.run("locus-ingest", "--ingest.source=csv", f"--ingest.csv={csv}", "--ingest.csv_label=y",
              "--ingest.normalize=none", "--ingest.num_classes=0", "--gates.features=0",
              "--gates.min_rows=0", "--ingest.chunk_rows=50", f"--ingest.output={out}", *extra)
    expect_exit(p, 0)


def test_incremental_equals_full_and_survives_a_crash(r, tmp):
    rng = np.random.default_rng(4)
    x, y = csv_rows(rng, 2300)
    a, b, c = (os.path.join(tmp, f"{n}.csv") for n in "abc")
    write_csv(a, x[:1000], y[:1000])
    write_csv(b, x[1000:1700], y[1000:1700])
    write_csv(c, x[1700:], y[1700:])
    data, model = os.path.join(tmp, "d.h5"), write_model(os.path.join(tmp, "m.h5"), [12, 16, 4])
    out, full = os.path.join(tmp, "inc.h5"), os.path.join(tmp, "full.h5")
    args = ("--infer.unit_rows=150", "--infer.batch_rows=64", "--infer.record_writer=true")
    ingest_csv(r, a, data)
    expect_exit(infer(r, model, data, out, *args), 0, "scored 1000 rows")
    ingest_csv(r, b, data, "--append")
    p = infer(r, model, data, out, "--incremental", *args)
    expect_exit(p, 0, "incrementally scored 700 rows [1000, 1700)")
    check(report(out)["metrics"]["rows"] == 700, "incremental metrics cover the new rows")
    # Its commit line: the new rows made durable in the file it extends, nothing published.
    check(re.search(rf"^committing: 700 rows scored in [\d.]+ s; making {re.escape(out)} durable$",
                    p.stdout, re.M) is not None, "expected the incremental run's commit line", p)
    # Killed after the new rows are durable but before the watermark moves.
    ingest_csv(r, c, data, "--append")
    p = infer(r, model, data, out, "--incremental", *args,
              env={"LOCUS_TEST_HOOK": "infer-before-watermark:kill@0"})
    check(p.returncode != 0, "the killed run must fail", p)
    with h5py.File(out, "r") as f:
        check(int(f.attrs["committed_rows"]) == 1700, "the watermark moved before the crash point")
    expect_exit(infer(r, model, data, out, "--incremental", *args), 0, "[1700, 2300)")
    expect_exit(infer(r, model, data, full, *args), 0, "scored 2300 rows")
    s, attrs = read_scores(out)
    ref, _ = read_scores(full)
    check(attrs["committed_rows"] == 2300, "final watermark")
    same(s, ref, "incremental (with a crash) vs full run")
    check(np.all(s["writer"] >= 0), "unwritten rows after the incremental runs")
    # Nothing new: a no-op that still succeeds.
    expect_exit(infer(r, model, data, out, "--incremental", *args), 0, "0 rows")
    # A different model may not extend these predictions.
    other = write_model(os.path.join(tmp, "m2.h5"), [12, 16, 4], seed=9)
    expect_exit(infer(r, other, data, out, "--incremental", *args), EXIT_DATA, "fingerprint")


def pytorch_snippet():
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "FORMATS.md")
    text = open(doc).read()
    section = text[text.index("### From PyTorch (h5py)"):]
    code = section[section.index("```python") + len("```python"):]
    return code[:code.index("```")]


def test_pytorch_model_matches_torch_forward(r, tmp):
    test, x, _ = ingest_fashion_test(r, tmp)
    ns = {}
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        exec(pytorch_snippet(), ns)  # the documented snippet, verbatim
    finally:
        os.chdir(cwd)
    torch, net = ns["torch"], ns["net"]
    with torch.no_grad():
        logits = net(torch.from_numpy(x)).numpy()
        probs = torch.softmax(torch.from_numpy(logits), dim=1).numpy()
    model = os.path.join(tmp, "torch-model.h5")
    out, raw = os.path.join(tmp, "p.h5"), os.path.join(tmp, "raw.h5")
    expect_exit(infer(r, model, test, out), 0)
    expect_exit(infer(r, model, test, raw, "--infer.outputs=raw", "--infer.top_k=0"), 0)
    s, _ = read_scores(out)
    sr, _ = read_scores(raw)
    check(np.abs(sr["scores"] - logits).max() < 1e-5, f"raw outputs differ from PyTorch by {np.abs(sr['scores'] - logits).max()}")
    check(np.abs(s["scores"] - probs).max() < 1e-5, "probabilities differ from PyTorch")
    check(np.abs(sr["scores"] - forward64(model, x)).max() < 1e-4, "raw outputs differ from numpy")
    check("predicted" not in sr, "raw outputs have no argmax")


def test_default_pipeline_matches_the_trainers_evaluation(r, tmp):
    """ingest -> locus-train -> locus-infer with the built-in config (paths under out/)."""
    if not os.path.exists(os.path.join(r.bindir, "locus-train")):
        print("  (locus-train not built: skipped)")
        return
    os.mkdir(os.path.join(tmp, "out"))
    expect_exit(r.run("locus-ingest", cwd=tmp), 0)
    p = r.run("locus-ingest", f"--ingest.images={FASHION}/t10k-images-idx3-ubyte.gz",
              f"--ingest.labels={FASHION}/t10k-labels-idx1-ubyte.gz",
              "--ingest.output=out/fashion-mnist-test.h5", cwd=tmp)
    expect_exit(p, 0)
    expect_exit(r.run("locus-train", "--train.epochs=1", cwd=tmp), 0, "test accuracy")
    expect_exit(r.run("locus-infer", cwd=tmp), 0, "accuracy")
    with open(os.path.join(tmp, "out", "fashion-mnist-metrics.jsonl")) as f:
        epoch = [json.loads(line) for line in f if '"epoch"' in line and '"eval_accuracy"' in line][-1]
    m = report(os.path.join(tmp, "out", "fashion-mnist-scores.h5"))["metrics"]
    check(m["rows"] == epoch["eval_rows"] == 10000, "both evaluate the whole test set")
    check(m["accuracy"] == epoch["eval_accuracy"],
          f"locus-infer accuracy {m['accuracy']} != trainer's {epoch['eval_accuracy']}")
    check(abs(m["log_loss"] - epoch["eval_loss"]) < 1e-6,
          f"locus-infer log-loss {m['log_loss']} != trainer's {epoch['eval_loss']}")


def test_checkpoint_plain_input_and_regression_models(r, tmp):
    rng = np.random.default_rng(5)
    x, y = csv_rows(rng, 500)
    csv, data = os.path.join(tmp, "a.csv"), os.path.join(tmp, "d.h5")
    write_csv(csv, x, y)
    ingest_csv(r, csv, data)
    model = write_model(os.path.join(tmp, "m.h5"), [12, 8, 4], seed=6)
    ckpt = write_model(os.path.join(tmp, "ckpt.h5"), [12, 8, 4], seed=6, group="/model",
                       fmt="locus-checkpoint")
    a, b = os.path.join(tmp, "a.h5"), os.path.join(tmp, "b.h5")
    expect_exit(infer(r, model, data, a, "--infer.unit_rows=100"), 0)
    expect_exit(infer(r, ckpt, data, b, "--infer.unit_rows=100"), 0)
    same(read_scores(a)[0], read_scores(b)[0], "checkpoint vs model file")
    # Any HDF5 file: a plain (contiguous, not chunked) float32 dataset, int64 labels elsewhere.
    plain, pout = os.path.join(tmp, "plain.h5"), os.path.join(tmp, "p.h5")
    with h5py.File(plain, "w") as f:
        f["data/x"] = x.astype(np.float32)
        f["meta/y"] = y.astype(np.int64)
    expect_exit(infer(r, model, plain, pout, "--infer.unit_rows=100", "--infer.features=/data/x",
                      "--infer.labels=/meta/y"), 0, "scored 500 rows")
    same(read_scores(pout)[0], read_scores(a)[0], "plain HDF5 input vs the ingested dataset")
    check(report(pout)["metrics"] == report(a)["metrics"], "metrics from the plain input differ")
    reg = write_model(os.path.join(tmp, "reg.h5"), [12, 8, 2], seed=7, loss="mse")
    c = os.path.join(tmp, "c.h5")
    p = infer(r, reg, data, c, "--infer.top_k=0")
    expect_exit(p, 0, "raw")
    s, attrs = read_scores(c)
    check(attrs["kind"] == "raw" and "predicted" not in s, "a regression model writes raw outputs")
    check(np.abs(s["scores"] - forward64(reg, x.astype(np.float32))).max() < 1e-5, "raw outputs")
    check(report(c)["metrics"] is None, "no classification metrics for regression")


def test_bad_inputs_give_clear_errors_and_no_output(r, tmp):
    rng = np.random.default_rng(8)
    x, y = csv_rows(rng, 200)
    csv, data = os.path.join(tmp, "a.csv"), os.path.join(tmp, "d.h5")
    write_csv(csv, x, y)
    ingest_csv(r, csv, data)
    out = os.path.join(tmp, "out.h5")
    wide = write_model(os.path.join(tmp, "wide.h5"), [13, 8, 4])
    expect_exit(infer(r, wide, data, out), EXIT_DATA, "feature-width mismatch", "13", "12")
    good = write_model(os.path.join(tmp, "m.h5"), [12, 8, 4])
    expect_exit(infer(r, good, data, out, "--infer.features=/pixels"), EXIT_DATA, "/pixels")
    expect_exit(infer(r, good, os.path.join(tmp, "none.h5"), out), EXIT_DATA, "none.h5")
    trunc = os.path.join(tmp, "trunc.h5")
    blob = open(good, "rb").read()
    open(trunc, "wb").write(blob[: len(blob) // 2])
    expect_exit(infer(r, trunc, data, out), EXIT_DATA, "trunc.h5")
    missing = write_model(os.path.join(tmp, "missing.h5"), [12, 8, 4])
    with h5py.File(missing, "a") as f:
        del f["layers.1.bias"]
    expect_exit(infer(r, missing, data, out), EXIT_DATA, "missing.h5", "layers.1.bias")
    shape = write_model(os.path.join(tmp, "shape.h5"), [12, 8, 4])
    with h5py.File(shape, "a") as f:
        del f["layers.0.weight"]
        f["layers.0.weight"] = np.zeros((8, 11), np.float32)
    expect_exit(infer(r, shape, data, out), EXIT_DATA, "layers.0.weight", "[8, 11]", "[8, 12]")
    act = write_model(os.path.join(tmp, "act.h5"), [12, 8, 4], activation="swish")
    expect_exit(infer(r, act, data, out), EXIT_DATA, "act.h5", "swish")
    newer = write_model(os.path.join(tmp, "newer.h5"), [12, 8, 4])
    with h5py.File(newer, "a") as f:
        f.attrs["schema_version"] = 2
    expect_exit(infer(r, newer, data, out), EXIT_DATA, "schema_version 2")
    check(no_outputs(out), "a failed run must publish nothing")
    # Killed after scoring, before the rename: nothing under the output's name.
    p = infer(r, good, data, out, env={"LOCUS_TEST_HOOK": "infer-before-publish:kill@0"})
    check(p.returncode != 0 and not os.path.exists(out), "a crash before publication", p)
    expect_exit(infer(r, good, data, out), 0)
    check(os.path.exists(out) and not os.path.exists(os.path.join(tmp, ".out.h5.locus-tmp")),
          "the rerun publishes and removes the crashed run's temporary file")
    before = open(out, "rb").read()
    expect_exit(infer(r, good, data, out), EXIT_CONFIG, "--overwrite", "--incremental")
    check(open(out, "rb").read() == before, "a refused run must leave the existing output alone")
    expect_exit(infer(r, good, data, out, "--overwrite"), 0)
    expect_exit(infer(r, good, data, out, "--overwrite", "--incremental"), EXIT_CONFIG, "exclude")
    expect_exit(infer(r, good, data, data, "--overwrite"), EXIT_CONFIG, "same file")
    expect_exit(infer(r, good, data, out, "--incremental", "--infer.top_k=2"), EXIT_CONFIG, "top_k")
    expect_exit(infer(r, good, data, out, "--overwrite", "--infer.top_k=5"), EXIT_CONFIG, "top_k")
    p = r.run("locus-infer", "--infer.topk=3")
    expect_exit(p, EXIT_CONFIG, "infer.topk", "did you mean 'infer.top_k'")
    p = r.run("locus-infer", "--help")
    expect_exit(p, 0, "--infer.slow_ranks", "--incremental")
    p = r.run("locus-infer", "--print-config")
    expect_exit(p, 0, "[infer]", "output = out/fashion-mnist-scores.h5")


def test_cuda_backend_where_it_cannot_run(r, tmp):
    """infer.backend = cuda in a build without CUDA, or on a host without a usable GPU (CI):
    exit 2 on every rank, naming the key and what is available, and no output. Where a GPU
    runs it, tests/apps/test_infer_cuda_app.py checks the results instead."""
    rng = np.random.default_rng(5)
    x, y = csv_rows(rng, 120)
    csv, data = os.path.join(tmp, "d.csv"), os.path.join(tmp, "d.h5")
    write_csv(csv, x, y)
    ingest_csv(r, csv, data)
    model = write_model(os.path.join(tmp, "m.h5"), [12, 8, 4])
    out = os.path.join(tmp, "s.h5")
    # The host BLAS's threads do nothing on cuda: named once (rank 0), GPU or not.
    p = infer(r, model, data, out, "--infer.backend=cuda", "--infer.blas_threads=2")
    unused = "note: infer.blas_threads = 2 sets the host BLAS's threads, which infer.backend = " \
             "cuda does not use: it scores on the GPU"
    check(p.stdout.count(unused) == 1, "infer.blas_threads on cuda is named once", p)
    if p.returncode == 0:
        return  # a GPU host
    expect_exit(p, EXIT_CONFIG, "infer.backend = cuda", "set infer.backend = cpu")
    text = p.stdout + p.stderr
    check("has no usable GPU" in text or "has no CUDA backend" in text,
          "the message must say whether the build or the host lacks CUDA", p)
    check(no_outputs(out), "nothing may be published", p)
    p = infer(r, model, data, out, "--infer.precision=bf16", "--infer.blas_threads=2")
    expect_exit(p, EXIT_CONFIG, "infer.precision = bf16", "set infer.precision = fp32")
    check("infer.blas_threads" not in p.stdout + p.stderr, "the cpu backend uses it: no note", p)
    check(no_outputs(out), "nothing may be published", p)
    p = infer(r, model, data, out, "--infer.device=0")
    expect_exit(p, EXIT_CONFIG, "infer.device = 0 picks a GPU, but infer.backend = cpu",
                "set infer.backend = cuda, or infer.device = -1")
    check(no_outputs(out), "nothing may be published", p)


def holder_record(proc, lock):
    """Waits until the running job `proc` holds the output lock `lock`: its record names a live
    process (a holder writes it after taking the lock; the file keeps the last holder's record,
    whose process has ended). Not probed with flock(1), which would refuse the job if it tried
    the lock at that moment. Returns the record and the holder's pid."""
    record = ""
    for _ in range(3000):
        if proc.poll() is not None:
            break
        if os.path.exists(lock):
            with open(lock) as f:
                record = f.read()
            pid = re.search(r"^pid (\d+)$", record, re.M)
            if pid and os.path.exists(f"/proc/{pid.group(1)}"):
                return record, pid.group(1)
        time.sleep(0.01)
    out, err = proc.communicate() if proc.poll() is not None else ("", "")
    check(False, f"the job never held {lock}: {record!r}; exit {proc.returncode}: {out}{err}")
    return None


def test_a_second_job_writing_the_output_is_refused(r, tmp):
    """Before the output lock, a second job writing a running one's output removed the first
    one's temporary file and wrote its own under that name; the first then published the
    second's partial file and exited 0. Now the second is refused (exit 2, agreed by every rank) and
    changes nothing; the first publishes its own rows; the lock goes with its holder. A
    requeued Slurm job waits for its predecessor instead."""
    test, _, _ = ingest_fashion_test(r, tmp)
    model = write_model(os.path.join(tmp, "m.h5"), [784, 64, 10], seed=4)
    ref_out = os.path.join(tmp, "ref.h5")
    expect_exit(infer(r, model, test, ref_out, "--infer.unit_rows=1000"), 0)
    out = os.path.join(tmp, "s.h5")
    lock = lock_path(out)
    # The first job: every rank sleeps 1 s before each of the 10 units (5 s at 2 ranks); once it
    # holds the lock it is suspended while the second runs, so it is mid-run however slow this
    # machine is.
    slow = ",".join(str(i) for i in range(r.ranks))
    first = r.start("locus-infer", f"--infer.model={model}", f"--infer.input={test}",
                    f"--infer.output={out}", "--infer.unit_rows=1000", f"--infer.slow_ranks={slow}",
                    "--infer.slow_ms=1000")
    try:
        record, pid = holder_record(first, lock)
        temp = os.path.join(tmp, ".s.h5.locus-tmp")
        deadline = time.monotonic() + 120
        while not os.path.exists(temp):  # the first job's file, which the second must not touch
            check(first.poll() is None and time.monotonic() < deadline,
                  f"the first job never created {temp}")
            time.sleep(0.01)
        with suspended(first, r.ranks):
            second = infer(r, model, test, out, "--overwrite")
        expect_exit(second, 2, f"output '{out}' (infer.output) is being written by another job",
                    f"pid {pid}", f"Wait until process {pid} on", lock)
        check(os.path.exists(temp), "the refused job removed the first one's temporary file")
        with open(lock) as f:
            check(f.read() == record, "the refused job changed the first one's lock file")
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    check(first.returncode == 0, f"the first job failed: {stdout}{stderr}")
    s, _ = read_scores(out)
    ref, _ = read_scores(ref_out)
    same(s, ref, "the first job's output")
    check(lock_is_free(lock), "the lock must go with the job that held it")

    # A holder that wrote no record (flock(1)) is named as such; once it is killed, its lock is
    # free and the next job takes it.
    holder = hold_lock_file(lock)
    try:
        p = infer(r, model, test, out, "--overwrite")
        expect_exit(p, 2, f"output '{out}' (infer.output) is being written by another job "
                    "(holder not recorded)")
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    same(read_scores(out)[0], ref, "the output after a refused job")
    expect_exit(infer(r, model, test, out, "--overwrite", "--infer.unit_rows=1000"), 0)
    check(lock_is_free(lock), "the lock must go with the job that took it over")

    # A requeued Slurm job (the same SLURM_JOB_ID, a higher SLURM_RESTART_COUNT) waits for its
    # predecessor, saying so, and scores once the predecessor is done. The predecessor stays
    # suspended until the requeued job says it waits.
    first = r.start("locus-infer", f"--infer.model={model}", f"--infer.input={test}",
                    f"--infer.output={out}", "--infer.unit_rows=1000", f"--infer.slow_ranks={slow}",
                    "--infer.slow_ms=1000", "--overwrite",
                    env={"SLURM_JOB_ID": "5001", "SLURM_RESTART_COUNT": "0"})
    requeued = None
    try:
        holder_record(first, lock)
        with suspended(first, r.ranks):
            requeued = r.start("locus-infer", f"--infer.model={model}", f"--infer.input={test}",
                               f"--infer.output={out}", "--overwrite", "--infer.unit_rows=1000",
                               env={"SLURM_JOB_ID": "5001", "SLURM_RESTART_COUNT": "1"})
            said = []  # its stderr, line by line, read by a thread (a readline could block)
            reader = threading.Thread(target=lambda: said.extend(iter(requeued.stderr.readline, "")),
                                      daemon=True)
            reader.start()
            deadline = time.monotonic() + 120
            while not any("held by an earlier instance" in line for line in list(said)):
                check(requeued.poll() is None and time.monotonic() < deadline,
                      f"the requeued job did not say it waits: {''.join(said)}")
                time.sleep(0.05)
        first.communicate(timeout=300)
        requeued_out = requeued.stdout.read()
        requeued.wait(timeout=300)
        reader.join()
        p = subprocess.CompletedProcess(requeued.args, requeued.returncode, requeued_out,
                                        "".join(said))
    finally:
        for job in (first, requeued):
            if job is not None and job.poll() is None:
                job.kill()
                job.wait()
    check(first.returncode == 0, "the predecessor failed")
    expect_exit(p, 0, f"output '{out}' (infer.output) is held by an earlier instance of this "
                "Slurm job", "Slurm job 5001", "infer.watchdog_s = 1800 ends it")
    same(read_scores(out)[0], ref, "the requeued job's output")


PROGRESS = re.compile(r"^scoring: (?P<won>\d+) of (\d+) units, (\d+) of (\d+) rows \((\d+)%\) in "
                      r"(?P<secs>[\d.]+) s, \d+ rows/s(?:, \d+ re-runs?)?"
                      r"(?:; about [\d.]+ (?:s|min|h) left|; no unit finished yet)?$")


def test_progress_lines_while_scoring(r, tmp):
    """infer.progress_s: rank 0 alone prints, once an interval, how many units and rows are
    scored; the counts only grow and rows are always whole units' rows. 0 turns it off."""
    test, _, _ = ingest_fashion_test(r, tmp)
    model = write_model(os.path.join(tmp, "m.h5"), [784, 32, 10], seed=4)
    out = os.path.join(tmp, "s.h5")
    # 20 units of 500 rows; every rank sleeps 150 ms x ranks before each: about 3 s at any
    # rank count, about ten intervals of 0.3 s.
    slow = ",".join(str(i) for i in range(r.ranks))
    p = infer(r, model, test, out, "--infer.unit_rows=500", f"--infer.slow_ranks={slow}",
              f"--infer.slow_ms={150 * r.ranks}", "--infer.progress_s=0.3")
    expect_exit(p, 0, "scored 10000 rows")
    for m in progress_lines(p, "scoring:", PROGRESS, 0.3):
        won, units, rows, total, pct = (int(m[i]) for i in range(1, 6))
        check(units == 20 and total == 10000, f"totals: {m[0]!r}", p)
        check(whole_units(rows, won, 500, r.ranks), f"rows are whole units' rows: {m[0]!r}", p)
        check(pct == round(100 * rows / total), f"share: {m[0]!r}", p)
    # infer.progress_s = 0: none, as a short run's default (30 s).
    p = infer(r, model, test, out, "--infer.unit_rows=500", "--infer.progress_s=0", "--overwrite")
    expect_exit(p, 0)
    check("scoring:" not in p.stdout and "committing:" not in p.stdout,
          "infer.progress_s = 0 printed a progress line", p)


def test_prometheus_file_follows_the_scoring(r, tmp):
    """infer.prometheus: rank 0 writes the file at the start (running, no figures yet), with
    every progress report (units and rows done, whole units' rows, only growing) and a last
    time when the job ends (not running, everything done). The job holds the file's lock: a second job naming it is refused
    while the first runs. An unwritable directory is exit 5 before anything is scored."""
    test, _, _ = ingest_fashion_test(r, tmp)
    model = write_model(os.path.join(tmp, "m.h5"), [784, 32, 10], seed=5)
    out, prom = os.path.join(tmp, "s.h5"), os.path.join(tmp, "job.prom")
    slow = ",".join(str(i) for i in range(r.ranks))
    job = r.start("locus-infer", f"--infer.model={model}", f"--infer.input={test}",
                  f"--infer.output={out}", "--infer.unit_rows=500", f"--infer.slow_ranks={slow}",
                  f"--infer.slow_ms={150 * r.ranks}", "--infer.progress_s=0.2",
                  f"--infer.prometheus={prom}")
    seen, refused = [], None
    deadline = time.monotonic() + 300
    try:
        while job.poll() is None:
            check(time.monotonic() < deadline, "the job did not end within 300 s")
            if os.path.exists(prom):  # replaced whole (rename): never half written
                with open(prom) as f:
                    seen.append(prometheus_values(f.read(), "job"))
            if refused is None and seen and 0 < seen[-1].get("locus_infer_rows_done", 0) < 10000:
                # Mid-run (and kept so while the second job runs): the file is the first's.
                with suspended(job, r.ranks):
                    refused = infer(r, model, test, os.path.join(tmp, "other.h5"),
                                    f"--infer.prometheus={prom}")
            time.sleep(0.05)
        stdout, stderr = job.communicate(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    check(job.returncode == 0, f"the job failed: {stdout}{stderr}")
    check(refused is not None, f"never saw the file mid-run: {seen}")
    expect_exit(refused, 2, f"output '{prom}' (infer.prometheus) is being written by another job")
    check(not os.path.exists(os.path.join(tmp, "other.h5")), "the refused job scored")
    with open(prom) as f:
        final = prometheus_values(f.read(), "job")
    # The first version, before the first report, has only the job's state and phase; the
    # others all. The phase (a state set) is score until the last unit is done, then commit.
    score, commit = 'locus_infer_phase{phase="score"}', 'locus_infer_phase{phase="commit"}'
    for v in seen:
        check((v[score], v[commit]) in ((1, 0), (0, 1)), f"one phase at a time: {v}")
        check(v[score] == 1 or (v["locus_infer_units_done"] == 20 and
                                v["locus_infer_rows_done"] == 10000),
              f"the commit phase without every unit done: {v}")
        if "locus_infer_units" not in v:
            check(set(v) == {"locus_infer_running", "locus_infer_last_update_timestamp_seconds",
                             score, commit} and v["locus_infer_running"] == 1,
                  f"the first version: {v}")
            continue
        check(v["locus_infer_units"] == 20 and v["locus_infer_rows"] == 10000, f"totals: {v}")
        check(whole_units(v["locus_infer_rows_done"], v["locus_infer_units_done"], 500, r.ranks),
              f"rows are whole units' rows: {v}")
    running = [v for v in seen if v["locus_infer_running"] == 1 and "locus_infer_units" in v]
    versions = {v["locus_infer_last_update_timestamp_seconds"] for v in running}
    check(len(versions) >= 2, f"expected the file rewritten while the job ran: {seen}")
    done = [v["locus_infer_rows_done"] for v in running]
    check(done == sorted(done), f"rows done went back: {done}")
    check(final["locus_infer_running"] == 0 and final["locus_infer_units_done"] == 20 and
          final["locus_infer_rows_done"] == 10000 and "locus_infer_seconds_left" not in final
          and final[commit] == 1, f"the last version: {final}")
    # After the last progress line, one line as the rows are committed and the file published.
    lines = stdout.splitlines()
    committing = [i for i, l in enumerate(lines) if l.startswith("committing:")]
    check(len(committing) == 1 and re.fullmatch(
        rf"committing: 10000 rows scored in [\d.]+ s; making {re.escape(out)} durable and "
        "publishing it", lines[committing[0]]) is not None and
        all(i < committing[0] for i, l in enumerate(lines) if l.startswith("scoring:")),
        f"expected one committing line after the progress lines: {stdout}")
    check(final["locus_infer_reruns_total"] == report(out)["speculative_runs"],
          f"re-runs: {final} vs the report's {report(out)['speculative_runs']}")
    # A directory that is not there: exit 5 on every rank, naming the file and the key.
    never = os.path.join(tmp, "never.h5")
    p = infer(r, model, test, never, f"--infer.prometheus={tmp}/no/such/dir/job.prom")
    expect_exit(p, 5, f"cannot write the Prometheus file '{tmp}/no/such/dir/job.prom'",
                "set infer.prometheus to a writable path")
    check(not os.path.exists(never), "a job refused for its Prometheus file scored", p)
    # The file is written before anything else: naming a file the job reads or writes is a
    # configuration error, and that file is left as it was.
    with open(model, "rb") as f:
        model_bytes = f.read()
    for key, path in (("infer.model", model), ("infer.output", out)):
        p = infer(r, model, test, out, "--overwrite", f"--infer.prometheus={path}")
        expect_exit(p, 2, f"infer.prometheus = '{path}' and {key} = '{path}' name one file")
    with open(model, "rb") as f:
        check(f.read() == model_bytes, "a refused job overwrote the model")
    check(read_scores(out)[1]["committed_rows"] == 10000, "a refused job changed the output")


# Rank-independent checks (the model format against PyTorch, argument and input errors) run at
# 2 ranks only, to keep CI short: test_model_file and test_infer cover model reading and agreed
# errors at 1, 2 and 4 ranks.
AT_2_RANKS_ONLY = ("test_pytorch_model_matches_torch_forward",
                   "test_a_second_job_writing_the_output_is_refused",
                   "test_bad_inputs_give_clear_errors_and_no_output",
                   "test_cuda_backend_where_it_cannot_run")

if __name__ == "__main__":
    ALL = [test_fashion_mnist_matches_numpy, test_identical_across_world_sizes_and_speculation,
           test_slow_rank_triggers_speculation, test_incremental_equals_full_and_survives_a_crash,
           test_pytorch_model_matches_torch_forward,
           test_default_pipeline_matches_the_trainers_evaluation,
           test_checkpoint_plain_input_and_regression_models,
           test_bad_inputs_give_clear_errors_and_no_output,
           test_a_second_job_writing_the_output_is_refused,
           test_cuda_backend_where_it_cannot_run, test_progress_lines_while_scoring,
           test_prometheus_file_follows_the_scoring]
    RANKS = int(sys.argv[2])
    main([t for t in ALL if RANKS == 2 or t.__name__ not in AT_2_RANKS_ONLY])
