"""End-to-end tests of locus-train's monitors under mpiexec on configs/tiny.ini: a run that
diverges (lr 1e3) stops on every rank with exit 3 at one step, keeps a finite last good
checkpoint that verifies and writes no model file; a loss spike injected on rank 1 by a test
hook stops the run under train.anomaly = stop (checkpoint of the step before) and is dropped
on the rerun under skip; a rank slowed by a test hook is reported as a straggler (stderr, an
event, the ranks lines, the stragglers file) and slurm/stragglers.sh reads its node."""
import json
import os
import subprocess
import tempfile

import h5py
import numpy as np

from apphelpers import check, expect_exit, main
from test_train_app import CONFIG
from test_train_app import prepare as ingest_tiny

EXIT_DATA = 3
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
if os.path.isdir("/dev/shm"):
    tempfile.tempdir = "/dev/shm"


def train_per_rank(r, tmp, *args, env=None):
    """locus-train under mpiexec with each rank's exit code printed ("rank-exit R C")."""
    cmd = [r.mpiexec, "--oversubscribe", "--bind-to", "none", "-n", str(r.ranks), "sh", "-c",
           '"$0" "$@"; rc=$?; echo "rank-exit $OMPI_COMM_WORLD_RANK $rc"; exit $rc',
           os.path.join(r.bindir, "locus-train"), "--config", CONFIG, *args]
    full_env = dict(os.environ)
    # Every rank's own exit code is what is checked, so mpirun must not end the others when
    # the first one leaves non-zero (its default): under load the last rank out was still in
    # its teardown after MPI_Finalize, was killed and never printed its line (CI, stop 36).
    # A rank that leaves while its peers wait in a collective would hang them: the timeout
    # turns that into a failure, and a short one, since a run here takes seconds.
    full_env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                     "OPENBLAS_NUM_THREADS": "1",
                     "OMPI_MCA_orte_abort_on_non_zero_status": "0"})
    full_env.update(env or {})
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=tmp,
                          timeout=180)


def rank_exits(p):
    return sorted(tuple(int(v) for v in l.split()[1:3]) for l in p.stdout.splitlines()
                  if l.startswith("rank-exit "))


def lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f]


def events(path, name=None):
    """The event lines (`name`, or the anomaly detector's: straggler events depend on timing)."""
    return [l for l in lines(path) if l["type"] == "event" and
            (l["event"] == name if name else not l["event"].startswith("straggler"))]


def latest_checkpoint(tmp, d="ck"):
    with open(os.path.join(tmp, d, "latest")) as f:
        name = dict(l.split(" ", 1) for l in f.read().splitlines())["latest"]
    return os.path.join(tmp, d, name)


def checkpoint_params_finite(path):
    with h5py.File(path, "r") as f:
        return all(np.isfinite(f["model"][k][()]).all() for k in f["model"].keys())


def test_divergence_stops_every_rank_with_exit_3(r, tmp):
    ingest_tiny(r, tmp)
    p = train_per_rank(r, tmp, "--optim.lr=1000", "--optim.clip_max_norm=0",
                       "--optim.warmup_steps=0", "--checkpoint.dir=ck",
                       "--checkpoint.every_steps=2", "--train.log_every=1")
    # mpirun itself exits 0 once it no longer aborts on a non-zero rank (Open MPI 4.1): each
    # rank's own code is the check.
    check(rank_exits(p) == [(k, EXIT_DATA) for k in range(r.ranks)],
          f"every rank exits {EXIT_DATA}: {rank_exits(p)}", p)
    check(p.stderr.count("error: non-finite") == 1, "the stop is printed once (rank 0)", p)
    check("HINT" in p.stderr and "optim.lr" in p.stderr, "the message says what to do", p)
    check(not os.path.exists(os.path.join(tmp, "tiny-model.h5")), "no model file", p)
    bad = events(os.path.join(tmp, "tiny-metrics.jsonl"), "nonfinite")
    check(len(bad) == 1 and bad[0]["action"] == "stop", f"one nonfinite event: {bad}", p)
    stopped = bad[0]["step"] - 1  # the last good step
    check(f"training stopped after step {stopped}" in p.stderr, "the stop step is named", p)
    # The last good state is the step before the non-finite one: finite, verified, latest.
    ck = latest_checkpoint(tmp)
    with h5py.File(ck, "r") as f:
        check(int(f.attrs["step"]) == stopped, f"latest checkpoint {ck} is step {stopped}", p)
    check(checkpoint_params_finite(ck), f"{ck} holds only finite parameters", p)
    expect_exit(r.run("locus-ckpt", "verify", "ck", cwd=tmp), 0)
    # Every step line before it is finite; no line covers the stopped step.
    steps = [l for l in lines(os.path.join(tmp, "tiny-metrics.jsonl")) if l["type"] == "step"]
    check(steps and steps[-1]["step"] == stopped, f"last step line {steps[-1:]}", p)


def test_spike_stops_then_skip_resumes(r, tmp):
    ingest_tiny(r, tmp)
    args = ["--checkpoint.dir=ck", "--train.anomaly_window=10", "--train.epochs=1",
            "--checkpoint.every_steps=100"]
    hook = {"LOCUS_TEST_HOOK": "anomaly-step-30:loss-spike@1"}
    p = train_per_rank(r, tmp, *args, "--train.anomaly=stop", env=hook)
    check(rank_exits(p) == [(k, EXIT_DATA) for k in range(r.ranks)],
          f"every rank exits {EXIT_DATA}: {rank_exits(p)}", p)
    check(p.stderr.count("error: anomaly at step 30") == 1, "the anomaly is printed once", p)
    ev = events(os.path.join(tmp, "tiny-metrics.jsonl"))
    check([(e["event"], e["step"], e["action"]) for e in ev] == [("anomaly", 30, "stop")],
          f"events {ev}", p)
    check(ev[0]["loss_z"] > 8 and ev[0]["threshold"] == 8, f"values {ev[0]}", p)
    with h5py.File(latest_checkpoint(tmp), "r") as f:
        check(int(f.attrs["step"]) == 29, "checkpointed the step before the spike", p)
        check(len(f.attrs["anomaly_window"]) == 20, "the detector's window is in it", p)
    check(not os.path.exists(os.path.join(tmp, "tiny-model.h5")), "no model file", p)
    # Rerun from there, dropping such updates: the spike is judged again and skipped.
    p = train_per_rank(r, tmp, *args, "--train.anomaly=skip", "--resume=auto", env=hook)
    check(rank_exits(p) == [(k, 0) for k in range(r.ranks)], f"exits {rank_exits(p)}", p)
    check(p.stderr.count("warning: anomaly at step 30") == 1, "skipped, printed once", p)
    ev = events(os.path.join(tmp, "tiny-metrics.jsonl"))
    check([(e["event"], e["step"]) for e in ev] == [("anomaly_skip", 30)], f"events {ev}", p)
    with h5py.File(os.path.join(tmp, "tiny-model.h5"), "r") as f:
        check(int(f.attrs["trained_steps"]) == 63, "the run finished", p)


def test_slow_rank_is_a_straggler(r, tmp):
    ingest_tiny(r, tmp)
    slow = r.ranks - 1
    p = train_per_rank(r, tmp, "--checkpoint.dir=ck", "--train.max_steps=60",
                       "--train.log_every=5", "--train.straggler_intervals=2",
                       env={"LOCUS_TEST_HOOK": f"train-step:delay40@{slow}",
                            "SLURMD_NODENAME": "fake-node"})
    check(rank_exits(p) == [(k, 0) for k in range(r.ranks)], f"exits {rank_exits(p)}", p)
    check(p.stderr.count(f"straggler: rank {slow} ") == 1, "reported once on stderr", p)
    metrics = os.path.join(tmp, "tiny-metrics.jsonl")
    ev = events(metrics, "straggler")
    check(len(ev) == 1 and ev[0]["rank"] == slow and ev[0]["part"] == "compute" and
          ev[0]["node"] == "fake-node" and ev[0]["ratio"] > 1.25, f"straggler events {ev}", p)
    ranks = [l for l in lines(metrics) if l["type"] == "ranks"]
    check(len(ranks) == 12, f"one ranks line per interval: {len(ranks)}", p)
    for l in ranks:
        check(len(l["compute_s"]) == r.ranks and len(l["reduce_wait_s"]) == r.ranks,
              f"per-rank arrays: {l}", p)
    # The slow rank computes at least the 40 ms it sleeps; the others wait for it instead.
    last = ranks[-1]
    check(last["compute_s"][slow] >= 0.04, f"slow rank's compute {last['compute_s']}", p)
    check(all(last["reduce_wait_s"][k] > 0.02 for k in range(r.ranks) if k != slow),
          f"the others wait in the reduction: {last['reduce_wait_s']}", p)
    with open(os.path.join(tmp, "ck", "stragglers")) as f:
        text = f.read()
    rows = [l.split() for l in text.splitlines() if not l.startswith("#")]
    check(len(rows) == 1 and rows[0][0] == str(slow) and rows[0][2] == "fake-node" and
          rows[0][3] == "compute", f"stragglers file:\n{text}", p)
    # What slurm/train.sbatch reads from it on requeue.
    script = (f". {ROOT}/slurm/locus-job.sh; . {ROOT}/slurm/stragglers.sh; "
              "locus_checkpoint_dir --config x.ini --checkpoint.dir=ck; "
              "locus_straggler_nodes ck/stragglers")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=tmp)
    check(out.stdout.split() == ["ck", "fake-node"], f"stragglers.sh: {out.stdout!r} {out.stderr}")


if __name__ == "__main__":
    main([test_divergence_stops_every_rank_with_exit_3, test_spike_stops_then_skip_resumes,
          test_slow_rank_is_a_straggler])
