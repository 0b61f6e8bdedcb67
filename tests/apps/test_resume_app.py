"""End-to-end checkpoint/restart of locus-train under mpiexec on configs/tiny.ini: SIGTERM sent
to one rank checkpoints every rank at one step and exits 75, and --resume=auto then ends
bitwise where an uninterrupted run ends (model and per-step metrics); SIGKILL inside a
checkpoint write leaves the previous checkpoint to resume from; a flipped bit is skipped by
--resume=auto and reported by locus-ckpt verify; a write beyond the file size limit and an
unwritable directory fail clearly (exit 5) and keep the previous checkpoint; an incompatible
checkpoint is refused (exit 2)."""
import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time

import h5py
import numpy as np

from apphelpers import check, expect_exit, main, rank_pids
from test_train_app import CONFIG
from test_train_app import prepare as ingest_tiny

EXIT_CONFIG, EXIT_DATA, EXIT_IO, EXIT_REQUEUE = 2, 3, 5, 75
# Checkpoints fsync their file and directory: free on tmpfs, up to a second on a busy disk.
if os.path.isdir("/dev/shm"):
    tempfile.tempdir = "/dev/shm"

# Two epochs of tiny.ini (63 steps each) with a metrics line per step.
BASE = ["--config", CONFIG, "--train.epochs=2", "--train.log_every=1"]


def train(r, tmp, *args, env=None, ranks=None, preexec_fn=None):
    if preexec_fn is None:
        return r.run("locus-train", *BASE, *args, cwd=tmp, env=env, ranks=ranks)
    cmd, full_env = launch_command(r, "locus-train", *BASE, *args, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, cwd=tmp,
                          timeout=600, preexec_fn=preexec_fn)


def launch_command(r, app, *args, env=None):
    cmd = r.command(app, *args)
    full_env = dict(os.environ)
    full_env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                     "OPENBLAS_NUM_THREADS": "1"})
    full_env.update(env or {})
    return cmd, full_env


def step_lines(path):
    with open(path) as f:
        return [json.loads(l) for l in f if '"type":"step"' in l.replace(" ", "")]


def tensors(path, group=""):
    with h5py.File(path, "r") as f:
        g = f[group] if group else f
        return {k: g[k][()] for k in g.keys() if isinstance(g[k], h5py.Dataset)}


def expect_same_model(a, b, what):
    ta, tb = tensors(a), tensors(b)
    check(sorted(ta) == sorted(tb), f"{what}: tensors differ in name")
    for k in ta:
        check(np.array_equal(ta[k].view(np.uint32), tb[k].view(np.uint32)),
              f"{what}: {k} differs (max {np.max(np.abs(ta[k] - tb[k]))})")


def expect_same_steps(got, want, what):
    check(len(got) == len(want), f"{what}: {len(got)} step lines, expected {len(want)}")
    for x, y in zip(got, want):
        for key in ("step", "samples", "loss", "accuracy", "lr"):
            check(x[key] == y[key], f"{what}: step {y['step']} {key} {x[key]} != {y[key]}")


# The datasets and the uninterrupted reference run are made once per suite and copied.
_CACHE = tempfile.TemporaryDirectory(prefix="locus-resume-cache-")


def prepare(r, tmp):
    cache = _CACHE.name
    if not os.path.exists(os.path.join(cache, "tiny-test.h5")):
        ingest_tiny(r, cache)
    for name in ("tiny-train.h5", "tiny-test.h5"):
        shutil.copy(os.path.join(cache, name), tmp)


def uninterrupted(r, tmp):
    cache = _CACHE.name
    if not os.path.exists(os.path.join(cache, "u.jsonl")):
        expect_exit(train(r, cache, "--train.output=u.h5", "--train.metrics=u.jsonl"), 0)
    for name in ("u.h5", "u.jsonl"):
        shutil.copy(os.path.join(cache, name), tmp)
    return step_lines(os.path.join(tmp, "u.jsonl"))


def wait_for(cond, proc, seconds, what):
    deadline = time.monotonic() + seconds
    while not cond():
        check(proc.poll() is None, f"the run ended (rc {proc.returncode}) before {what}")
        check(time.monotonic() < deadline, f"timed out waiting for {what}")
        time.sleep(0.05)


def latest(ck):
    with open(os.path.join(ck, "latest")) as f:
        return dict(l.split(None, 1) for l in f.read().splitlines() if l and l[0] != "#")


def sigterm_mid_run(r, tmp, *args):
    """Runs locus-train (BASE + args; args name --train.metrics) sleeping a second at each step
    boundary, sends SIGTERM to its last rank once two step lines are written, and returns the
    finished run (CompletedProcess)."""
    metrics = os.path.join(tmp, next(a.split("=", 1)[1] for a in args
                                     if a.startswith("--train.metrics=")))
    cmd, env = launch_command(r, "locus-train", *BASE, *args,
                              env={"LOCUS_TEST_HOOK": "ckpt-step-boundary:sleep1"})
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.exists(metrics) and len(step_lines(metrics)) >= 2, proc, 120,
                 "two steps")
        pids = rank_pids(proc.pid)
        check(len(pids) == r.ranks, f"found rank pids {pids}")
        os.kill(pids[r.ranks - 1], signal.SIGTERM)  # the last rank only
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_sigterm_to_one_rank_checkpoints_all_and_resumes_bitwise(r, tmp):
    prepare(r, tmp)
    want = uninterrupted(r, tmp)
    ck = os.path.join(tmp, "ck")
    p = sigterm_mid_run(r, tmp, "--checkpoint.dir=ck", "--train.output=p.h5",
                        "--train.metrics=p1.jsonl")
    out = p.stdout
    expect_exit(p, EXIT_REQUEUE, "SIGTERM received: checkpointing step", "stopped by SIGTERM")
    check(out.count("SIGTERM received") == 1, "the signal must be handled once", p)
    check(not os.path.exists(os.path.join(tmp, "p.h5")), "a preempted run wrote its model", p)
    done = step_lines(os.path.join(tmp, "p1.jsonl"))
    stop = done[-1]["step"]
    check(latest(ck)["latest"] == f"ckpt-{stop:08d}.h5", f"latest {latest(ck)}, stopped at {stop}")
    with h5py.File(os.path.join(ck, f"ckpt-{stop:08d}.h5"), "r") as f:
        check(int(f.attrs["step"]) == stop and int(f.attrs["world_size"]) == r.ranks,
              "checkpoint attributes")
        check(int(f.attrs["samples_in_epoch"]) == stop % 63 * 32, "data position")
    check(0 < stop < 126, f"stopped at step {stop}")
    # A resume killed while it rewrites the metrics file (kept lines up to the checkpoint) must
    # leave the file as it was: it is replaced by a rename, never truncated in place (a kill
    # between a truncation and the rewrite lost the lines for good; tests/chaos).
    metrics = os.path.join(tmp, "p1.jsonl")
    with open(metrics, "rb") as f:
        before = f.read()
    k = train(r, tmp, "--checkpoint.dir=ck", "--resume=auto", "--train.output=p.h5",
              "--train.metrics=p1.jsonl", env={"LOCUS_TEST_HOOK": "metrics-before-rename:kill@0"})
    check(k.returncode != 0 and "test hook 'metrics-before-rename'" in k.stderr,
          "the resume must be killed at the hook", k)
    with open(metrics, "rb") as f:
        check(f.read() == before, "a resume killed while rewriting the metrics file changed it")
    # The resumed run writes the same metrics file: it keeps the lines up to the checkpoint
    # and appends, so the file reads as the uninterrupted run's.
    q = train(r, tmp, "--checkpoint.dir=ck", "--resume=auto", "--train.output=p.h5",
              "--train.metrics=p1.jsonl")
    expect_exit(q, 0, f"resumed from ck/ckpt-{stop:08d}.h5: step {stop} of 126")
    expect_same_model(os.path.join(tmp, "p.h5"), os.path.join(tmp, "u.h5"), "preempted+resumed")
    expect_same_steps(step_lines(os.path.join(tmp, "p1.jsonl")), want, "metrics")


def test_sigkill_inside_a_write_resumes_from_the_previous(r, tmp):
    prepare(r, tmp)
    uninterrupted(r, tmp)
    ck = os.path.join(tmp, "ck")
    # Every write pauses 2 s after the parameters: kill the job inside the second one.
    cmd, env = launch_command(r, "locus-train", *BASE, "--checkpoint.dir=ck",
                              "--checkpoint.every_steps=20", "--train.metrics=",
                              env={"LOCUS_TEST_HOOK": "ckpt-mid-write:sleep2"})
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        temp40 = os.path.join(ck, ".ckpt-00000040.h5.locus-tmp")
        wait_for(lambda: os.path.exists(temp40), proc, 120, "the write of step 40")
        for pid in rank_pids(proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    check(proc.returncode != 0, "the killed job exited 0")
    check(latest(ck)["latest"] == "ckpt-00000020.h5", f"latest is {latest(ck)}")
    check(not os.path.exists(os.path.join(ck, "ckpt-00000040.h5")), "a torn write was renamed")
    q = train(r, tmp, "--checkpoint.dir=ck", "--resume=auto", "--train.output=k.h5")
    expect_exit(q, 0, "resumed from ck/ckpt-00000020.h5")
    expect_same_model(os.path.join(tmp, "k.h5"), os.path.join(tmp, "u.h5"), "killed+resumed")
    check(not os.path.exists(temp40), "the torn temporary file was not cleaned up")


def flip_bit(path, dataset):
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        offset = ds.id.get_chunk_info(0).byte_offset if ds.chunks else ds.id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + 5)
        b = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([b[0] ^ 0x04]))


def test_flipped_bit_is_skipped_and_reported(r, tmp):
    prepare(r, tmp)
    uninterrupted(r, tmp)
    expect_exit(train(r, tmp, "--checkpoint.dir=ck", "--checkpoint.every_steps=50",
                      "--checkpoint.keep_last=0", "--train.metrics="), 0)
    ck = os.path.join(tmp, "ck")
    check(latest(ck)["latest"] == "ckpt-00000126.h5", f"latest {latest(ck)}")
    flip_bit(os.path.join(ck, "ckpt-00000126.h5"), "optimizer/momentum_buffer/layers.1.weight")
    v = r.run("locus-ckpt", "verify", "ck", cwd=tmp)
    expect_exit(v, EXIT_DATA, "ckpt-00000126.h5", "optimizer/momentum_buffer/layers.1.weight",
                "does not match its digest")
    q = train(r, tmp, "--checkpoint.dir=ck", "--resume=auto", "--train.output=f.h5",
              "--train.metrics=")
    expect_exit(q, 0, "skipped ckpt-00000126.h5", "does not match its digest",
                "resumed from ck/ckpt-00000100.h5")
    expect_same_model(os.path.join(tmp, "f.h5"), os.path.join(tmp, "u.h5"), "resumed past damage")


def limit_file_size(nbytes):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.RLIM_INFINITY))
    return apply


def checkpoint_dir_files(ck):
    """The files of a checkpoint directory, less `stragglers`: the straggler detector writes it
    whenever the machine's load makes a rank look slow (docs/FORMATS.md)."""
    return sorted(f for f in os.listdir(ck) if f != "stragglers")


def test_write_failures_keep_the_previous_checkpoint(r, tmp):
    prepare(r, tmp)
    # 1.07M parameters: a checkpoint (with the momentum) is 8.7 MB, above a 6 MB file size
    # limit that MPI's own start-up files still fit in.
    wide = ["--model.widths=12,1024,1024,4", "--checkpoint.dir=ck", "--checkpoint.every_steps=20",
            "--train.metrics="]
    expect_exit(train(r, tmp, *wide, "--train.max_steps=30"), 0)
    ck = os.path.join(tmp, "ck")
    check(latest(ck)["latest"] == "ckpt-00000030.h5", f"latest {latest(ck)}")
    before = open(os.path.join(ck, "ckpt-00000030.h5"), "rb").read()
    p = train(r, tmp, *wide, "--resume=auto", "--train.max_steps=60",
              preexec_fn=limit_file_size(6 << 20))
    expect_exit(p, EXIT_IO, "cannot write checkpoint", "ckpt-00000040.h5", "File too large",
                "the previous checkpoint is untouched")
    check(latest(ck)["latest"] == "ckpt-00000030.h5", f"latest {latest(ck)}")
    check(open(os.path.join(ck, "ckpt-00000030.h5"), "rb").read() == before,
          "the previous checkpoint changed")
    # A refused write ends the job without HDF5's collective close (which can deadlock when
    # its own flush fails too; tests/chaos): the temporary file stays until the next save of
    # that step (below) or retention removes it.
    left = checkpoint_dir_files(ck)
    check(left in ([".ckpt-00000040.h5.locus-tmp", ".lock", "ckpt-00000020.h5", "ckpt-00000030.h5",
                    "latest"], [".lock", "ckpt-00000020.h5", "ckpt-00000030.h5", "latest"]),
          f"left behind: {left}")
    expect_exit(r.run("locus-ckpt", "verify", "ck", cwd=tmp), 0)
    # A save that outlasts checkpoint.save_timeout_s is given up; the run itself goes on.
    p = train(r, tmp, *wide, "--resume=auto", "--train.max_steps=40",
              "--checkpoint.save_timeout_s=0.5", "--train.output=t.h5",
              env={"LOCUS_TEST_HOOK": "ckpt-mid-write:sleep1"})
    expect_exit(p, 0, "checkpoint step 40 (end) abandoned", "the previous checkpoint stays the latest",
                "model written to t.h5")
    check(latest(ck)["latest"] == "ckpt-00000030.h5", f"latest {latest(ck)}")
    check(checkpoint_dir_files(ck) == [".lock", "ckpt-00000020.h5", "ckpt-00000030.h5", "latest"],
          f"left behind: {checkpoint_dir_files(ck)}")
    blocker = os.path.join(tmp, "file")
    open(blocker, "w").close()
    p = train(r, tmp, "--checkpoint.dir=file/ck", "--train.metrics=")
    expect_exit(p, EXIT_IO, "cannot create checkpoint.dir 'file/ck'")


def test_incompatible_checkpoint_is_refused(r, tmp):
    prepare(r, tmp)
    expect_exit(train(r, tmp, "--checkpoint.dir=ck", "--train.max_steps=20",
                      "--train.metrics="), 0)
    p = train(r, tmp, "--checkpoint.dir=ck", "--resume=auto", "--train.batch=64",
              "--train.metrics=")
    expect_exit(p, EXIT_CONFIG, "train.batch is 32 in the checkpoint and 64 here",
                "--resume=none")
    p = train(r, tmp, "--checkpoint.dir=ck", "--checkpoint.resume=auto",
              "--model.widths=12,16,4", "--train.metrics=")
    expect_exit(p, EXIT_CONFIG, "the checkpoint holds 12,32,16,4 relu")
    p = train(r, tmp, "--checkpoint.signals=USR1,HUPP")
    expect_exit(p, EXIT_CONFIG, "checkpoint.signals", "HUPP")


if __name__ == "__main__":
    main([test_sigterm_to_one_rank_checkpoints_all_and_resumes_bitwise,
          test_sigkill_inside_a_write_resumes_from_the_previous,
          test_flipped_bit_is_skipped_and_reported,
          test_write_failures_keep_the_previous_checkpoint],
         once=[test_incompatible_checkpoint_is_refused])
