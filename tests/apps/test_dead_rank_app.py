"""A dead or stuck rank never hangs the job (docs/RELIABILITY.md, "Dead ranks and the watchdog").

Dead: one rank is SIGKILLed (LOCUS_TEST_HOOK=<point>:kill@r) while its peers sit in the gradient
all-reduce, the checkpoint commit's barrier, the infer work queue's one-sided operations, or a
collective HDF5 write (ingest, checkpoint). Under plain mpirun with Open MPI's defaults the
whole job must end within BOUND_S with a non-zero exit, and publish nothing.

Stuck: one rank sleeps (LOCUS_TEST_HOOK=<point>:sleep<N>@r) far longer than <app>.watchdog_s:
the watchdog ends the job with exit 70 and a line naming the rank and the operation. And the
watchdog is not fooled by a suspension: every process of the job SIGSTOPped for several
watchdog periods, then SIGCONTed, completes normally."""
import glob
import os
import subprocess
import time

import h5py
import numpy as np

from apphelpers import check, expect_exit, main, suspended

EXIT_INTERNAL = 70
# A healthy run of these tiny jobs takes 2-5 s on the 2-core CI machine; a hung one would run
# into the 600 s limit of AppRunner. The bound leaves room for a loaded machine.
BOUND_S = 30
CONFIG = os.path.join(os.environ.get("LOCUS_SOURCE_DIR",
                                     os.path.join(os.path.dirname(__file__), "..", "..")),
                      "configs", "tiny.ini")


def write_tiny_csv(path, rows, seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, size=rows)
    x = rng.normal(0, 1.0, size=(rows, 12)) + y[:, None] * 0.5
    with open(path, "w") as f:
        f.write(",".join(f"f{i}" for i in range(12)) + ",label\n")
        for xi, yi in zip(x, y):
            f.write(",".join(f"{v:.5f}" for v in xi) + f",{yi}\n")


def prepare(r, tmp, train_set=True):
    write_tiny_csv(os.path.join(tmp, "tiny-train.csv"), 2000, 1)
    if train_set:
        expect_exit(r.run("locus-ingest", "--config", CONFIG, "--overwrite", cwd=tmp), 0)


def write_model(path):
    rng = np.random.default_rng(0)
    widths = [12, 32, 16, 4]
    with h5py.File(path, "w") as f:
        for i in range(len(widths) - 1):
            f[f"layers.{i}.weight"] = rng.standard_normal((widths[i + 1], widths[i])).astype(np.float32)
            f[f"layers.{i}.bias"] = np.zeros(widths[i + 1], np.float32)
        f.attrs["locus_format"] = "locus-model"
        f.attrs["schema_version"] = 1
        f.attrs["widths"] = np.array(widths, dtype=np.int64)
        f.attrs["activation"] = "relu"
        f.attrs["loss"] = "cross_entropy"


def unpublished(path):
    """Nothing under the final name (a killed job's temporary file is removed by the next run)."""
    return not os.path.exists(path)


def timed(r, app, *args, hook, tmp):
    t0 = time.monotonic()
    p = r.run(app, "--config", CONFIG, *args, env={"LOCUS_TEST_HOOK": hook}, cwd=tmp)
    return p, time.monotonic() - t0


def expect_job_ended(p, seconds, hook):
    check(p.returncode != 0, f"{hook}: the job exited 0 although a rank was killed", p)
    check(seconds < BOUND_S, f"{hook}: the job took {seconds:.1f} s to end (bound {BOUND_S} s)", p)
    check(f"test hook '{hook.split(':')[0]}': kill" in p.stderr, f"{hook}: the hook did not fire", p)
    # Open MPI's default: mpirun notices the rank's death and tears the whole job down.
    check("exited on signal 9" in p.stdout + p.stderr, f"{hook}: not ended by mpirun's abort", p)


# --- dead ranks -------------------------------------------------------------------------------

def test_killed_in_gradient_allreduce(r, tmp):
    prepare(r, tmp)
    hook = "train-before-allreduce:kill@1"  # rank 0 waits in the all-reduce of step 1
    p, s = timed(r, "locus-train", "--data.test=", "--train.metrics=", hook=hook, tmp=tmp)
    expect_job_ended(p, s, hook)
    check(unpublished(os.path.join(tmp, "tiny-model.h5")), "a model file was published", p)


def test_killed_before_checkpoint_commit(r, tmp):
    prepare(r, tmp)
    hook = "ckpt-before-rename:kill@1"  # rank 0 waits in the commit's agreement (a barrier)
    p, s = timed(r, "locus-train", "--data.test=", "--checkpoint.dir=ck", "--checkpoint.every_steps=5",
                 "--train.metrics=", hook=hook, tmp=tmp)
    expect_job_ended(p, s, hook)
    check(not glob.glob(os.path.join(tmp, "ck", "ckpt-*.h5")), "a checkpoint was published", p)


def test_killed_in_checkpoint_write(r, tmp):
    prepare(r, tmp)
    hook = "ckpt-mid-write:kill@1"  # rank 0 writes the file the ranks opened collectively
    p, s = timed(r, "locus-train", "--data.test=", "--checkpoint.dir=ck", "--checkpoint.every_steps=5",
                 "--train.metrics=", hook=hook, tmp=tmp)
    expect_job_ended(p, s, hook)
    check(not glob.glob(os.path.join(tmp, "ck", "ckpt-*.h5")), "a checkpoint was published", p)


def test_killed_in_work_queue(r, tmp):
    prepare(r, tmp)
    write_model(os.path.join(tmp, "m.h5"))
    # Rank 0 holds the work queue's window: the others' fetch-and-ops target a dead rank.
    hook = "infer-claim:kill@0"
    p, s = timed(r, "locus-infer", "--infer.model=m.h5", "--infer.input=tiny-train.h5",
                 "--infer.output=scores.h5", "--infer.unit_rows=64", hook=hook, tmp=tmp)
    expect_job_ended(p, s, hook)
    check(unpublished(os.path.join(tmp, "scores.h5")), "a prediction file was published", p)


def test_killed_in_collective_write(r, tmp):
    prepare(r, tmp, train_set=False)
    hook = "ingest-before-write:kill@1"  # rank 0 sits in the collective create/write
    p, s = timed(r, "locus-ingest", "--overwrite", hook=hook, tmp=tmp)
    expect_job_ended(p, s, hook)
    check(unpublished(os.path.join(tmp, "tiny-train.h5")), "a dataset was published", p)


# --- the watchdog -----------------------------------------------------------------------------

def expect_watchdog(p, seconds, key, what):
    expect_exit(p, EXIT_INTERNAL, "watchdog: no progress for", f"in {what}", f"({key} = 2)",
                "HINT")
    check(f"/{r_ranks(p)} " in p.stderr, "the watchdog line does not name the rank", p)
    check(seconds < BOUND_S, f"the watchdog took {seconds:.1f} s to end the job", p)


def r_ranks(p):
    """The world size from a '[rank r/n host] watchdog' line."""
    line = next(l for l in p.stderr.splitlines() if "watchdog:" in l)
    return line.split("/")[1].split()[0]


def test_watchdog_names_a_stuck_allreduce(r, tmp):
    prepare(r, tmp)
    p, s = timed(r, "locus-train", "--data.test=", "--train.watchdog_s=2", "--train.metrics=",
                 hook="train-before-allreduce:sleep60@1", tmp=tmp)
    expect_watchdog(p, s, "train.watchdog_s", "gradient all-reduce of step")
    check(unpublished(os.path.join(tmp, "tiny-model.h5")), "a model file was published", p)


def test_watchdog_names_a_stuck_work_queue(r, tmp):
    prepare(r, tmp)
    write_model(os.path.join(tmp, "m.h5"))
    p, s = timed(r, "locus-infer", "--infer.watchdog_s=2", "--infer.model=m.h5",
                 "--infer.input=tiny-train.h5", "--infer.output=scores.h5",
                 hook="infer-claim:sleep60@1", tmp=tmp)
    # Rank 1 is stuck before its fetch; rank 0 scores what is left, then waits for rank 1 at
    # the end of the work queue: whichever watchdog fires first names where it is.
    expect_exit(p, EXIT_INTERNAL)
    check("work queue fetch" in p.stderr or "work queue end" in p.stderr,
          "the watchdog does not name the work queue", p)
    expect_watchdog(p, s, "infer.watchdog_s", "work queue")
    check(unpublished(os.path.join(tmp, "scores.h5")), "a prediction file was published", p)


def test_watchdog_names_a_stuck_collective_write(r, tmp):
    prepare(r, tmp, train_set=False)
    p, s = timed(r, "locus-ingest", "--overwrite", "--ingest.watchdog_s=2",
                 hook="ingest-before-write:sleep60@1", tmp=tmp)
    expect_watchdog(p, s, "ingest.watchdog_s", "collective write of dataset tiny-train.h5")
    check(unpublished(os.path.join(tmp, "tiny-train.h5")), "a dataset was published", p)


def test_watchdog_sleeps_through_a_suspension(r, tmp):
    """Every process of the job stopped for 3 watchdog periods (as Slurm suspends a job), then
    continued: the run completes as if nothing happened."""
    prepare(r, tmp)
    # 756 steps take 0.02 s of compute: without the 5 ms per step the whole run could end between
    # the first metrics line and the SIGSTOP (it did on a loaded CI machine). With it, ~4 s.
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OPENBLAS_NUM_THREADS="1", LOCUS_TEST_HOOK="train-step:delay5")
    cmd = r.command("locus-train", "--config", CONFIG, "--train.watchdog_s=2", "--train.epochs=12",
                    "--data.test=")
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = os.path.join(tmp, "tiny-metrics.jsonl")
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
            check(proc.poll() is None and time.monotonic() < deadline,
                  "the run ended or stalled before its first metrics line")
            time.sleep(0.02)
        with suspended(proc, r.ranks):
            with open(metrics) as f:
                lines_at_stop = f.read().count("\n")
            time.sleep(6)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    p = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    expect_exit(p, 0, "epoch  12/12", "model written to tiny-model.h5")
    check("watchdog" not in err, "the watchdog fired across the suspension", p)
    with open(metrics) as f:
        lines_at_end = f.read().count("\n")
    check(lines_at_stop < lines_at_end,
          f"the job was not stopped mid-run ({lines_at_stop} of {lines_at_end} metrics lines)", p)


if __name__ == "__main__":
    main([test_killed_in_gradient_allreduce, test_killed_before_checkpoint_commit,
          test_killed_in_checkpoint_write, test_killed_in_work_queue,
          test_killed_in_collective_write, test_watchdog_names_a_stuck_allreduce,
          test_watchdog_names_a_stuck_work_queue, test_watchdog_names_a_stuck_collective_write,
          test_watchdog_sleeps_through_a_suspension])
