"""End-to-end tests of locus-train under mpiexec on configs/tiny.ini: ingest a tiny CSV, train,
check the model file against a numpy forward pass, the metrics lines, N ranks against 1 rank,
run-to-run reproducibility, and the exit codes and messages of bad configurations."""
import json
import os
import re

import h5py
import numpy as np

from apphelpers import check, expect_exit, main

# Failed runs on purpose: do not wait for Open MPI's kill timeout (see test_infer_app.py).
os.environ.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "0")

EXIT_CONFIG, EXIT_DATA, EXIT_IO = 2, 3, 5
CONFIG = os.path.join(os.environ.get("LOCUS_SOURCE_DIR",
                                     os.path.join(os.path.dirname(__file__), "..", "..")),
                      "configs", "tiny.ini")


def write_tiny_csv(path, rows, seed):
    """4 overlapping clusters in 12 dimensions (chance is 0.25; an MLP gets ~0.9)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, size=rows)
    k = np.arange(12)
    centres = 1.2 * np.sin(1.7 * np.arange(4)[:, None] + 0.9 * k[None, :])
    x = centres[y] + rng.normal(0, 1.0, size=(rows, 12))
    with open(path, "w") as f:
        f.write(",".join(f"f{i}" for i in range(12)) + ",label\n")
        for xi, yi in zip(x, y):
            f.write(",".join(f"{v:.6f}" for v in xi) + f",{yi}\n")


def prepare(r, tmp):
    """Ingests tiny-train.h5 and tiny-test.h5 in tmp (the test set reuses the train set's
    normalization only by construction: both are standardized by their own statistics)."""
    write_tiny_csv(os.path.join(tmp, "tiny-train.csv"), 2000, 1)
    write_tiny_csv(os.path.join(tmp, "tiny-test.csv"), 500, 2)
    p = r.run("locus-ingest", "--config", CONFIG, "--overwrite", cwd=tmp)
    expect_exit(p, 0)
    p = r.run("locus-ingest", "--config", CONFIG, "--overwrite", "--ingest.csv=tiny-test.csv",
              "--ingest.output=tiny-test.h5", cwd=tmp)
    expect_exit(p, 0)


def train(r, tmp, *args, ranks=None):
    return r.run("locus-train", "--config", CONFIG, *args, ranks=ranks, cwd=tmp)


def load_model(path):
    with h5py.File(path, "r") as f:
        tensors = {k: f[k][()] for k in f.keys()}
        attrs = {k: f.attrs[k] for k in f.attrs}
    return tensors, attrs


def numpy_accuracy(tensors, h5path):
    with h5py.File(h5path, "r") as f:
        n = int(f.attrs["committed_rows"])
        x = f["features"][:n].astype(np.float64)
        y = f["labels"][:n]
    layers = len([k for k in tensors if k.endswith(".weight")])
    for l in range(layers):
        x = x @ tensors[f"layers.{l}.weight"].T.astype(np.float64) + tensors[f"layers.{l}.bias"]
        if l + 1 < layers:
            x = np.maximum(x, 0)
    return float(np.mean(np.argmax(x, axis=1) == y))


def reported_accuracy(proc):
    m = re.search(r"test accuracy ([0-9.]+)", proc.stdout)
    check(m is not None, "no 'test accuracy' line", proc)
    return float(m.group(1))


def test_trains_writes_model_and_metrics(r, tmp):
    prepare(r, tmp)
    p = train(r, tmp)
    expect_exit(p, 0, "epoch   6/6", "test accuracy", "model written to tiny-model.h5")
    # The start-up lines say where the samples are: tiny.ini shuffles globally, so every rank
    # holds the whole set.
    with h5py.File(os.path.join(tmp, "tiny-train.h5"), "r") as f:
        rows = int(f.attrs["committed_rows"])
    expect_exit(p, 0, f"data: the whole set in memory on every rank ({rows} rows, ")
    acc = reported_accuracy(p)
    check(acc > 0.6, f"test accuracy {acc} is barely above chance (0.25)", p)
    tensors, attrs = load_model(os.path.join(tmp, "tiny-model.h5"))
    check(tensors["layers.0.weight"].shape == (32, 12), "layers.0.weight shape")
    check(tensors["layers.2.weight"].shape == (4, 16), "layers.2.weight shape")
    check(int(attrs["trained_steps"]) == 6 * 63, f"trained_steps {attrs['trained_steps']}")
    ours = numpy_accuracy(tensors, os.path.join(tmp, "tiny-test.h5"))
    check(abs(ours - acc) <= 1.5 / 500, f"numpy forward gives accuracy {ours}, locus {acc}", p)
    lines = [json.loads(l) for l in open(os.path.join(tmp, "tiny-metrics.jsonl"))]
    steps = [l for l in lines if l["type"] == "step"]
    epochs = [l for l in lines if l["type"] == "epoch"]
    check(len(epochs) == 6, f"{len(epochs)} epoch lines")
    check(sum(s["steps"] for s in steps) == 6 * 63, "step lines do not add up to the run")
    for key in ("loss", "samples_per_s", "allreduce_s", "hidden_fraction", "data_wait_s", "lr"):
        check(all(key in s for s in steps), f"step lines lack {key}")
    check(abs(epochs[-1]["eval_accuracy"] - acc) < 1e-4, "metrics and stdout disagree")
    check(epochs[-1]["train_loss"] < epochs[0]["train_loss"], "training loss did not fall")


def test_n_ranks_match_one_rank_and_repeat_exactly(r, tmp):
    prepare(r, tmp)
    expect_exit(train(r, tmp, "--train.output=a.h5", "--train.metrics=a.jsonl"), 0)
    expect_exit(train(r, tmp, "--train.output=b.h5", "--train.metrics=b.jsonl"), 0)
    a, _ = load_model(os.path.join(tmp, "a.h5"))
    b, _ = load_model(os.path.join(tmp, "b.h5"))
    for k in a:
        check(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)),
              f"{k} differs between two runs of one config")
    # The step and epoch lines repeat exactly; the detectors' event lines depend on timing (a
    # rank slowed by a busy machine is a straggler in one run and not the other).
    def trained(path):
        return [l for l in map(json.loads, open(path)) if l["type"] in ("step", "epoch")]
    la, lb = trained(os.path.join(tmp, "a.jsonl")), trained(os.path.join(tmp, "b.jsonl"))
    check(len(la) == len(lb) and len(la) > 0, f"{len(la)} vs {len(lb)} step and epoch lines")
    for x, y in zip(la, lb):
        for key in ("loss", "accuracy", "lr", "train_loss", "eval_loss", "eval_accuracy"):
            check(x.get(key) == y.get(key), f"metric {key} differs between runs: {x} vs {y}")
    if r.ranks > 1:
        expect_exit(train(r, tmp, "--train.output=one.h5", "--train.metrics=", ranks=1), 0)
        one, _ = load_model(os.path.join(tmp, "one.h5"))
        for k in a:  # global shuffle: same batches; only the fp summation order differs
            diff = np.max(np.abs(a[k] - one[k]))
            check(np.allclose(a[k], one[k], rtol=1e-4, atol=1e-5),
                  f"{k}: {r.ranks} ranks differ from 1 rank by {diff}")


def test_pipeline_stages_train_like_data_parallel(r, tmp):
    """pp=2 (x dp=ranks/2) with micro-batches, GPipe and 1F1B: the partition is printed, the run
    reaches the weights of the data-parallel run up to float rounding, and repeats exactly."""
    if r.ranks % 2:
        return  # 2 stages need an even rank count
    prepare(r, tmp)
    expect_exit(train(r, tmp, "--train.output=dp.h5", "--train.metrics="), 0)
    dp, _ = load_model(os.path.join(tmp, "dp.h5"))
    for sched in ("gpipe", "1f1b"):
        args = ["--train.pipeline_stages=2", "--train.micro_batches=3", f"--train.schedule={sched}",
                "--train.metrics="]
        p = train(r, tmp, *args, f"--train.output=pp-{sched}.h5")
        expect_exit(p, 0, "pipeline partition (balanced by FLOPs and parameter bytes, 2 stages",
                    "stage 1: layers", f"{sched} schedule", "test accuracy",
                    f"model written to pp-{sched}.h5")
        check(reported_accuracy(p) > 0.6, "pipeline training did not learn", p)
        pp, attrs = load_model(os.path.join(tmp, f"pp-{sched}.h5"))
        check(int(attrs["trained_steps"]) == 6 * 63, f"trained_steps {attrs['trained_steps']}")
        for k in dp:
            diff = np.max(np.abs(pp[k] - dp[k]))
            check(np.allclose(pp[k], dp[k], rtol=1e-4, atol=1e-5),
                  f"{sched}: {k} differs from the data-parallel run by {diff}")
    expect_exit(train(r, tmp, *args, "--train.output=again.h5"), 0)
    a, _ = load_model(os.path.join(tmp, "pp-1f1b.h5"))
    b, _ = load_model(os.path.join(tmp, "again.h5"))
    for k in a:
        check(np.array_equal(a[k].view(np.uint32), b[k].view(np.uint32)),
              f"{k} differs between two pipeline runs of one config")


def test_nodes_layout_and_hierarchical_reduction(r, tmp):
    """4 ranks as 2 "nodes" of 2 (LOCUS_TEST_RANKS_PER_NODE): the start-up lines name the
    reduction auto picks and the layout (2 stages inside each node, replicas across nodes);
    train.reduction = hierarchical writes bitwise the model of flat."""
    if r.ranks != 4:
        return
    prepare(r, tmp)
    nodes = {"LOCUS_TEST_RANKS_PER_NODE": "2"}
    p = r.run("locus-train", "--config", CONFIG, "--train.pipeline_stages=2", "--train.epochs=1",
              "--train.metrics=", "--train.output=pp.h5", env=nodes, cwd=tmp)
    expect_exit(p, 0, "layout: pipeline stages inside nodes, replicas across nodes (4 ranks on 2 "
                "nodes", "node 0: rank 0 = replica 0 stage 0, rank 1 = replica 0 stage 1",
                "node 1: rank 2 = replica 1 stage 0, rank 3 = replica 1 stage 1",
                "gradient reduction: flat (train.reduction = auto: 2 ranks on 2 nodes (1+1;")
    models = {}
    for red in ("flat", "hierarchical", "auto"):
        p = r.run("locus-train", "--config", CONFIG, f"--train.reduction={red}", "--train.epochs=1",
                  f"--train.output={red}.h5", f"--train.metrics={red}.jsonl", env=nodes, cwd=tmp)
        shown = "flat" if red == "flat" else "hierarchical"
        expect_exit(p, 0, f"gradient reduction: {shown} (train.reduction = {red}")
        models[red], _ = load_model(os.path.join(tmp, f"{red}.h5"))
        run_line = json.loads(open(os.path.join(tmp, f"{red}.jsonl")).readline())
        check(run_line["reduction"].startswith(shown), f"run line: {run_line['reduction']}")
    for red in ("hierarchical", "auto"):
        for k in models["flat"]:
            check(np.array_equal(models[red][k].view(np.uint32),
                                 models["flat"][k].view(np.uint32)),
                  f"{k}: train.reduction = {red} differs from flat")


def test_bad_config_values_exit_2(r, tmp):
    prepare(r, tmp)
    cases = [
        (["--train.batch=0"], "train.batch"),
        (["--model.activation=relux"], "did you mean 'relu'"),
        (["--optim.lr=-0.1"], "optim.lr"),
        (["--train.epohcs=3"], "did you mean 'train.epochs'"),
        (["--train.epoch=3"], "did you mean 'train.epochs'"),  # no silent prefix match
        (["--loader.shuffle=globl"], "allowed values are global, local"),
        (["--train.epochs=many"], "train.epochs"),
        (["--train.pipeline_stages=3"], "pipeline_stages = 3 does not divide the 2 ranks"),
        (["--train.pipeline_stages=2", "--train.stage_boundaries=3"],
         "train.stage_boundaries = 3 is invalid for a model of 3 layers"),
        (["--train.micro_batches=0"], "train.micro_batches"),
        (["--train.schedule=zb"], "allowed values are 1f1b, gpipe"),
        (["--train.reduction=tree"], "allowed values are auto, flat, hierarchical"),
        (["--train.device=0"], "train.device = 0 picks a GPU, but train.backend = cpu"),
        (["--model.widths=12,0,4"], "model.widths"),
        (["--optim.warmup_steps=5000"], "optim.warmup_steps = 5000"),
        (["--optim.momentum=0"], "optim.nesterov"),
        # Boost's message for a value holding its own placeholder looped forever (fuzz_config).
        (["--optim.nesterov=%value%"], "optim.nesterov' could not be parsed"),
    ]
    for args, needle in cases:
        p = train(r, tmp, *args)
        expect_exit(p, EXIT_CONFIG, needle)
        check((p.stderr + p.stdout).count("error:") == 1,
              f"{args}: the error must be printed once (by rank 0)", p)
    check(not os.path.exists(os.path.join(tmp, "tiny-model.h5")), "a failed run wrote a model")


def test_gpu_only_switches_on_the_cpu_are_named(r, tmp):
    """GPU-only switches set away from their defaults change nothing on the cpu backend: the
    run goes on and rank 0 names each once; at their defaults nothing is said."""
    prepare(r, tmp)
    p = train(r, tmp, "--train.max_steps=20", "--train.graphs=false",
              "--train.gemm_select=heuristic", "--train.reducer_timeout_s=30")
    for key in ("train.graphs = false", "train.gemm_select = heuristic",
                "train.reducer_timeout_s = 30"):
        expect_exit(p, 0, f"note: {key} applies to train.backend = cuda only")
        check((p.stdout + p.stderr).count(f"note: {key} ") == 1, f"{key}: named more than once", p)
    p = train(r, tmp, "--train.max_steps=20")
    expect_exit(p, 0)
    check("applies to train.backend = cuda only" not in p.stdout + p.stderr,
          "a note at the defaults", p)


def test_model_must_fit_the_dataset(r, tmp):
    prepare(r, tmp)
    p = train(r, tmp, "--model.widths=10,32,4")
    expect_exit(p, EXIT_CONFIG, "model.widths = 10,32,4 takes 10 input features",
                "tiny-train.h5 has 12 features", "set the first width to 12")
    p = train(r, tmp, "--model.widths=12,32,5")
    expect_exit(p, EXIT_CONFIG, "ends in 5 outputs", "has 4 classes", "set the last width to 4")


def test_missing_inputs_and_unwritable_outputs(r, tmp):
    prepare(r, tmp)
    p = train(r, tmp, "--data.train=missing.h5")
    expect_exit(p, EXIT_DATA, "missing.h5")
    p = train(r, tmp, "--train.metrics=/proc/no/such/metrics.jsonl")
    expect_exit(p, EXIT_IO, "/proc/no/such/metrics.jsonl")


def test_help_and_print_config(r, tmp):
    p = r.run("locus-train", "--help", cwd=tmp)
    expect_exit(p, 0, "--train.batch", "--optim.warmup_steps", "--loader.shuffle",
                "--eval.every", "default: 784,256,128,10")
    p = train(r, tmp, "--print-config", "--train.epochs=3")
    expect_exit(p, 0, "[train]", "epochs = 3", "widths = 12,32,16,4")
    cfg = os.path.join(tmp, "effective.ini")
    with open(cfg, "w") as f:
        f.write(p.stdout)
    q = r.run("locus-train", "--config", cfg, "--print-config", cwd=tmp)
    expect_exit(q, 0)
    check(q.stdout == p.stdout, "--print-config output does not reproduce itself", q)


if __name__ == "__main__":
    main([test_trains_writes_model_and_metrics, test_n_ranks_match_one_rank_and_repeat_exactly,
          test_pipeline_stages_train_like_data_parallel,
          test_nodes_layout_and_hierarchical_reduction],
         once=[test_bad_config_values_exit_2, test_gpu_only_switches_on_the_cpu_are_named,
               test_model_must_fit_the_dataset,
               test_missing_inputs_and_unwritable_outputs, test_help_and_print_config])
