"""End-to-end ownership of a checkpoint directory by one locus-train job (configs/tiny.ini under
mpiexec): a second job on a locked directory exits 2 at once, saying which job holds it and what
to do, without touching the directory, while the first goes on; after the first exits (exit 75
after SIGTERM) or is SIGKILLed, a new job takes the directory and resumes its checkpoints; a
requeued Slurm job (the same SLURM_JOB_ID, a higher SLURM_RESTART_COUNT) waits for its
predecessor instead of failing;
locus-ckpt's read-only commands ignore the lock. A job writing the running one's model,
metrics or Prometheus file is refused alike (the output lock, io::OutputLock)."""
import json
import os
import signal
import subprocess
import time

from apphelpers import check, expect_exit, main, suspended
from test_resume_app import BASE, EXIT_CONFIG, EXIT_REQUEUE, launch_command, latest, prepare
from test_resume_app import rank_pids, train, wait_for

# The holder sleeps a second at every step boundary, so it is still training while the
# second job starts; a checkpoint every 2 steps, all of them kept.
HOLDER = ["--checkpoint.dir=ck", "--checkpoint.every_steps=2", "--checkpoint.keep_last=0",
          "--train.metrics=", "--train.output=holder.h5"]


def start_holder(r, tmp, job, holder=HOLDER):
    cmd, env = launch_command(r, "locus-train", *BASE, *holder,
                              env={"LOCUS_TEST_HOOK": "ckpt-step-boundary:sleep1",
                                   "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": "0"})
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ck = os.path.join(tmp, "ck")
    wait_for(lambda: os.path.exists(os.path.join(ck, "ckpt-00000002.h5")), proc, 120,
             "the holder's first checkpoint")
    return proc


def stop(proc):
    if proc.poll() is None:
        for pid in rank_pids(proc.pid).values():
            os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)


def contents(ck):
    """File name -> bytes of every file in the directory. The holder goes on writing: a
    temporary file renamed between the listing and its read is left out."""
    out = {}
    for name in sorted(os.listdir(ck)):
        try:
            with open(os.path.join(ck, name), "rb") as f:
                out[name] = f.read()
        except FileNotFoundError:
            continue
    return out


def test_second_job_is_refused_and_the_first_goes_on(r, tmp):
    prepare(r, tmp)
    holder = start_holder(r, tmp, "1001")
    ck = os.path.join(tmp, "ck")
    try:
        before = contents(ck)
        run_before = latest(ck)["run"]
        # --resume=none would rewrite `latest` at once and retire the holder's checkpoints.
        p = train(r, tmp, "--checkpoint.dir=ck", "--resume=none", "--train.output=second.h5",
                  "--train.metrics=second.jsonl", env={"SLURM_JOB_ID": "1002"})
        expect_exit(p, EXIT_CONFIG, "checkpoint.dir 'ck' is in use by another training job",
                    "Slurm job 1001", "pid ", "run " + run_before,
                    "Set checkpoint.dir to another directory, or wait until Slurm job 1001 ends")
        check((p.stdout + p.stderr).count("error:") == 1, "the error must be printed once", p)
        check("epoch" not in p.stdout, "the refused job trained", p)
        for name in ("second.h5", "second.jsonl"):
            check(not os.path.exists(os.path.join(tmp, name)), f"the refused job wrote {name}", p)
        check(holder.poll() is None, "the holder stopped")
        after = contents(ck)
        for name, data in before.items():
            if name.startswith("ckpt-"):
                check(after.get(name) == data, f"{name} of the holder changed or disappeared")
        check(latest(ck)["run"] == run_before, f"the pointer changed run: {latest(ck)}")
        check(after[".lock"] == before[".lock"], "the refused job rewrote the holder record")
        # Read-only tools ignore the lock.
        expect_exit(r.run("locus-ckpt", "list", "ck", cwd=tmp), 0, "ckpt-00000002.h5")
        expect_exit(r.run("locus-ckpt", "verify", "ck/ckpt-00000002.h5", cwd=tmp), 0)
        # The holder is preempted: it checkpoints and exits 75, releasing the directory.
        os.kill(rank_pids(holder.pid)[0], signal.SIGTERM)
        out, err = holder.communicate(timeout=120)
        check(holder.returncode == EXIT_REQUEUE, f"holder exit {holder.returncode}\n{out}\n{err}")
    finally:
        stop(holder)
    step = int(latest(ck)["latest"][5:13])
    q = train(r, tmp, "--checkpoint.dir=ck", "--resume=auto", "--train.metrics=",
              "--train.output=next.h5", env={"SLURM_JOB_ID": "1003"})
    expect_exit(q, 0, f"resumed from ck/ckpt-{step:08d}.h5")
    check(os.path.exists(os.path.join(tmp, "next.h5")), "the next job wrote no model", q)


def test_killed_holder_leaves_no_stale_lock(r, tmp):
    prepare(r, tmp)
    holder = start_holder(r, tmp, "2001")
    stop(holder)  # SIGKILL to every rank: no clean-up runs
    ck = os.path.join(tmp, "ck")
    check(os.path.exists(os.path.join(ck, ".lock")), "no lock file")
    step = int(latest(ck)["latest"][5:13])
    q = train(r, tmp, "--checkpoint.dir=ck", "--resume=auto", "--train.metrics=",
              "--train.output=next.h5", env={"SLURM_JOB_ID": "2002"})
    expect_exit(q, 0, f"resumed from ck/ckpt-{step:08d}.h5")


def test_requeued_job_waits_for_its_predecessor(r, tmp):
    prepare(r, tmp)
    holder = start_holder(r, tmp, "3001")
    cmd, env = launch_command(r, "locus-train", *BASE, "--checkpoint.dir=ck", "--resume=auto",
                              "--train.metrics=requeued.jsonl", "--train.output=requeued.h5",
                              env={"SLURM_JOB_ID": "3001", "SLURM_RESTART_COUNT": "1"})
    requeued = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        waiting = []

        def announced():
            line = requeued.stdout.readline()
            waiting.append(line)
            return "held by an earlier instance of this Slurm job" in line

        wait_for(announced, requeued, 120, "the requeued job to wait")
        check(holder.poll() is None, "the holder stopped")
        time.sleep(1.0)  # so the wait lasts at least 1 s, which the metrics' run line must say
        stop(holder)  # the predecessor goes away: the requeued job takes over
        out, err = requeued.communicate(timeout=300)
    finally:
        stop(holder)
        if requeued.poll() is None:
            requeued.kill()
    p = subprocess.CompletedProcess(cmd, requeued.returncode, "".join(waiting) + out, err)
    expect_exit(p, 0, "resumed from ck/ckpt-")
    with open(os.path.join(tmp, "requeued.jsonl")) as f:
        run = json.loads(f.readline())
    check(run["type"] == "run" and run["lock_wait_s"] >= 1.0,
          f"the run line does not say the run waited 1 s or more for its locks: {run}")


def test_a_job_writing_the_running_ones_outputs_is_refused(r, tmp):
    prepare(r, tmp)
    holder_args = [a for a in HOLDER if not a.startswith("--train.metrics")]
    holder = start_holder(r, tmp, "4001", holder_args + ["--train.metrics=holder.jsonl",
                                                         "--train.prometheus=holder.prom"])
    prom = os.path.join(tmp, "holder.prom")
    try:
        # The holder stands still while the others try (it rewrites its Prometheus file every
        # log interval): its files must be exactly as it left them.
        with suspended(holder, r.ranks):
            with open(prom, "rb") as f:
                before = f.read()
            for key, args in (("train.output", ["--train.output=holder.h5", "--train.metrics="]),
                              ("train.metrics", ["--train.output=b.h5",
                                                 "--train.metrics=holder.jsonl"]),
                              ("train.prometheus", ["--train.output=b.h5", "--train.metrics=",
                                                    "--train.prometheus=holder.prom"])):
                p = train(r, tmp, "--checkpoint.dir=ck2", *args, env={"SLURM_JOB_ID": "4002"})
                path = {"train.output": "holder.h5", "train.metrics": "holder.jsonl",
                        "train.prometheus": "holder.prom"}[key]
                expect_exit(p, EXIT_CONFIG, f"output '{path}' ({key}) is being written by "
                            "another job", "Slurm job 4001", "Wait until Slurm job 4001 ends")
                check("epoch" not in p.stdout, "the refused job trained", p)
                for name in ("ck2", "b.h5"):
                    check(not os.path.exists(os.path.join(tmp, name)),
                          f"the refused job wrote {name}", p)
            with open(prom, "rb") as f:
                check(f.read() == before, "a refused job rewrote the holder's Prometheus file")
        check(holder.poll() is None, "the holder stopped")
    finally:
        stop(holder)  # SIGKILL: the model was never written; the locks go with the ranks
    q = train(r, tmp, "--checkpoint.dir=ck2", "--train.output=holder.h5",
              "--train.metrics=holder.jsonl", "--train.prometheus=holder.prom",
              env={"SLURM_JOB_ID": "4003"})
    expect_exit(q, 0)
    check(os.path.exists(os.path.join(tmp, "holder.h5")), "the next job wrote no model", q)
    # One file for two keys is refused before anything is written.
    for a, b in ((("train.output", "same.h5"), ("train.metrics", "./same.h5")),
                 (("train.metrics", "m.jsonl"), ("train.prometheus", "m.jsonl"))):
        p = train(r, tmp, "--checkpoint.dir=ck3", "--train.output=", "--train.metrics=",
                  f"--{a[0]}={a[1]}", f"--{b[0]}={b[1]}")
        expect_exit(p, EXIT_CONFIG, f"{a[0]} = '{a[1]}' and {b[0]} = '{b[1]}' name one file")
        check(not os.path.exists(os.path.join(tmp, "ck3")), "the refused job created ck3", p)

if __name__ == "__main__":
    main([test_second_job_is_refused_and_the_first_goes_on,
          test_killed_holder_leaves_no_stale_lock,
          test_requeued_job_waits_for_its_predecessor,
          test_a_job_writing_the_running_ones_outputs_is_refused])
