#!/usr/bin/python3
"""The chaos suite of locus (issue 16): faults at random moments, then reruns and invariants.

Each injection runs one app on 2 ranks under plain mpirun, in a fresh directory, and at a
seeded random moment delivers one fault:

  kill-rank    SIGKILL of one rank
  kill-mpirun  SIGKILL of mpirun (its ranks are orphaned; this runner is their subreaper)
  term         SIGTERM to every rank (as Slurm signals every task at preemption)
  usr1         SIGUSR1 to every rank (Slurm's --signal warning)
  stop         SIGSTOP of mpirun and every rank for a few seconds, then SIGCONT (Slurm's
               suspension): the job must then complete by itself, exit 0, no timeout

Right after the fault (before any rerun) it checks that no output exists under its final name
unless complete: the version from before the command (same bytes) or a complete new one (equal
to an uninterrupted reference run's); the metrics file's lines are a prefix of the reference's;
every checkpoint left verifies (locus-ckpt verify) and `latest` names one that exists. Then it
reruns the same command (training with --resume=auto) until it exits 0 (bounded), and checks
that the outputs equal the reference run's bit for bit (HDF5 objects, every dataset's bytes and
every attribute, the `config` attribute without its `resume =` line; metrics lines without their
documented timing fields; JSON reports without their times and per-rank scheduling figures),
that every checkpoint verifies and that no temporary file remains. A stopped job must complete
by itself.

Write faults (--write-faults, and in --ci): the LD_PRELOAD shim of write_fault.c makes the
writes of one output or of the checkpoints fail with ENOSPC or EIO; the app must exit 5 naming
the path on every rank, publish nothing and leave earlier outputs and checkpoints intact.

Every injection is printed with a command that replays it alone. Exit status: 0 when every
invariant held, 1 otherwise (the violations and their replay commands are listed last).

  tests/chaos/chaos.py --injections 210 --seed 1            # a campaign
  tests/chaos/chaos.py --ci                                  # CI's bounded run (ctest -L chaos)
  tests/chaos/chaos.py --replay train/dp2-async/kill-rank/1.234/r1   # one injection again
  tests/chaos/chaos.py --only-write-faults [--write-fault-case N]     # the write faults
Runs happen under a temporary directory (/dev/shm when there: fsync is free), removed unless a
violation was found (--keep keeps every run's directory); a run that hangs gets its stacks
dumped with gdb (chaos-hang-stacks.txt) before it is killed.
"""
import argparse
import ctypes
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import h5py  # noqa: E402
import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

KINDS = ["kill-rank", "kill-mpirun", "term", "usr1", "stop"]
VARIANTS = {
    "ingest": ["full", "append"],
    "train": ["dp2-sync", "dp2-async", "pp2-sync", "pp2-async"],
    "infer": ["full", "incremental"],
}
RANKS = 2
RERUNS = 4            # reruns after a fault before the job counts as lost
RUN_TIMEOUT_S = int(os.environ.get("LOCUS_CHAOS_RUN_TIMEOUT", "180"))  # one app run (a hang beyond it is a violation)
# Write-fault cases that expose a defect not fixed yet (docs/RELIABILITY.md, "Open defects"):
# run by every campaign (--write-faults) and by --write-fault-case, left out of --ci.
KNOWN_OPEN: dict[str, str] = {}
LAUNCHER_GRACE_S = 15  # mpirun still running this long after its last rank ended: killed, noted
ORPHAN_WAIT_S = 20    # after SIGKILL of mpirun: how long its orphaned ranks may take to go

# Attributes left out of the bitwise comparison of HDF5 outputs. None: datasets, model files
# and prediction files carry no timestamp or run identity (checkpoints do: `created`, `run_id`;
# they are verified with locus-ckpt, not compared), so every dataset's bytes and every
# attribute must match, with one exception below.
EXCLUDED_ATTRS = {}
# The `config` attribute (the effective INI of the command that wrote a file) is compared
# without its `resume = ...` line: a training rerun passes --resume=auto, the first run not.
RESUME_LINE = re.compile(r"^resume = .*$", re.M)
# Metrics: the documented timing fields (docs/FORMATS.md, "Training metrics").
METRIC_TIMING = {"seconds", "samples_per_s", "allreduce_s", "allreduce_blocked_s",
                 "hidden_fraction", "data_wait_s", "data_wait_fraction", "eval_seconds"}
# JSON reports (docs/FORMATS.md): measured times, and what depends on which rank won which
# unit of the dynamic work queue (per-rank figures, speculative runs and wins).
REPORT_VOLATILE = {"seconds", "seconds_durable", "seconds_init", "seconds_total",
                   "rows_per_second", "per_rank", "speculative_runs", "speculative_wins"}
# An --incremental report covers the rows scored by its own run: after a fault, the rerun
# starts at the watermark the faulted run left, so these describe a smaller run than the
# reference's (the prediction file itself is compared in full).
REPORT_RUN_SCOPED = {"row_begin", "rows_scored", "units", "units_written_once", "metrics"}
# Temporary names: lib/io publish and checkpoints ("<dir>/.<name>.locus-tmp", also the
# checkpoint `latest` pointer's and a resumed run's metrics file), the JSON reports
# ("<report>.tmp"; "<report>.<pid>.tmp" for --validate-only) and the writable-directory probe
# (".locus-probe.<host>.<pid>"). The output locks (".<name>.locus-lock") stay, as the
# checkpoint directory's ".lock" does.
TEMP_NAME = re.compile(r"(\.locus-tmp$|\.tmp$|^\.locus-probe\.)")


def log(msg=""):
    print(msg, flush=True)


# ---------------------------------------------------------------- processes

def become_subreaper():
    """Orphans of our mpirun (after it is SIGKILLed) become our children, so we can reap
    them and never need to look for processes by name."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_CHILD_SUBREAPER = 36
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except OSError:
        return False


def children_of(pid):
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                pass
    except OSError:
        pass
    return out


def exe_of(pid):
    try:
        return os.path.realpath(f"/proc/{pid}/exe")
    except OSError:
        return ""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def reap(pid):
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


RUNNING = set()  # the runs in progress, ended if the runner is interrupted


def on_interrupt(signum, _frame):
    for run in list(RUNNING):
        run.find_ranks()
        run.kill_all()
    sys.exit(128 + signum)


class Run:
    """One app run under mpirun, with the ranks found as mpirun's children."""

    def __init__(self, cfg, app, args, cwd, env_extra=None, mpi_env=None):
        self.app_path = os.path.realpath(os.path.join(cfg.bindir, f"locus-{app}"))
        cmd = [cfg.mpiexec, "--oversubscribe", "--bind-to", "none", "-n", str(RANKS)]
        for k, v in (mpi_env or {}).items():
            cmd += ["-x", f"{k}={v}"]
        cmd += [self.app_path, *args]
        self.cmd = cmd
        env = dict(os.environ)
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                    "OPENBLAS_NUM_THREADS": "1"})
        env.update(env_extra or {})
        self.out_path = os.path.join(cwd, f".chaos-run-{time.monotonic_ns()}.log")
        self.out = open(self.out_path, "w+")
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.ranks = []
        self.orphans_killed = 0
        self.launcher_hangs = 0
        RUNNING.add(self)

    def find_ranks(self, wait_s=0.0):
        deadline = time.monotonic() + wait_s
        while True:
            found = [c for c in children_of(self.proc.pid) if exe_of(c) == self.app_path]
            for c in found:
                if c not in self.ranks:
                    self.ranks.append(c)
            if len(self.ranks) >= RANKS or time.monotonic() >= deadline or self.proc.poll() is not None:
                return self.ranks
            time.sleep(0.01)

    def elapsed(self):
        return time.monotonic() - self.t0

    def wait(self, timeout=RUN_TIMEOUT_S):
        """Waits for mpirun; returns (returncode, hung). A hang is a run still going after
        `timeout` s with a rank alive. mpirun left alone LAUNCHER_GRACE_S after its last rank
        ended (Open MPI 4.1's mpirun can deadlock in its own PMIx finalize after a rank dies of a
        signal: docs/RELIABILITY.md) is killed and counted in self.launcher_hangs, not as a hang
        of the app."""
        deadline = time.monotonic() + timeout
        ranks_gone_at = None
        hung = False
        while True:
            try:
                rc = self.proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if len(self.ranks) < RANKS:
                self.find_ranks()
            if self.ranks and not any(alive(r) and exe_of(r) == self.app_path for r in self.ranks):
                ranks_gone_at = ranks_gone_at or now
                if now - ranks_gone_at >= LAUNCHER_GRACE_S:
                    self.dump_stacks()
                    self.kill_all()
                    rc = self.proc.wait()
                    self.launcher_hangs += 1
                    break
            else:
                ranks_gone_at = None
            if now >= deadline:
                hung = True
                self.dump_stacks()
                self.kill_all()
                rc = self.proc.wait()
                break
        self.wait_orphans(0.5)
        return rc, hung

    def wait_orphans(self, wait_s):
        """Ranks that outlived mpirun (our children now): gives them wait_s, then SIGKILL."""
        deadline = time.monotonic() + wait_s
        while True:
            for r in self.ranks:
                reap(r)
            left = [r for r in self.ranks if alive(r) and exe_of(r) == self.app_path]
            if not left or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        for r in left:
            try:
                os.kill(r, signal.SIGCONT)
                os.kill(r, signal.SIGKILL)
                self.orphans_killed += 1
            except ProcessLookupError:
                pass
        for r in left:
            for _ in range(100):
                reap(r)
                if not alive(r):
                    break
                time.sleep(0.02)
        return left

    def dump_stacks(self):
        """A hang: the stacks of mpirun and the ranks (gdb, when installed) beside the run."""
        if not shutil.which("gdb"):
            return
        self.find_ranks()
        with open(self.out_path + ".stacks", "w") as f:
            for pid in [self.proc.pid, *self.ranks]:
                if alive(pid):
                    f.write(f"==== pid {pid} ({exe_of(pid)})\n")
                    f.flush()
                    subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 15"],
                                   stdout=f, stderr=subprocess.STDOUT, timeout=60)
        self.stacks = self.out_path + ".stacks"

    def kill_all(self):
        for pid in [self.proc.pid, *self.ranks]:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def output(self):
        self.out.flush()
        self.out.seek(0)
        text = self.out.read()
        return text

    def close(self):
        RUNNING.discard(self)
        self.out.close()
        if os.path.exists(self.out_path + ".stacks"):
            os.replace(self.out_path + ".stacks", os.path.join(os.path.dirname(self.out_path),
                                                              "chaos-hang-stacks.txt"))
        try:
            os.unlink(self.out_path)
        except OSError:
            pass


def run_to_end(cfg, app, args, cwd, env_extra=None, mpi_env=None):
    r = Run(cfg, app, args, cwd, env_extra, mpi_env)
    rc, hung = r.wait()
    text = r.output()
    secs = r.elapsed()
    r.close()
    return rc, hung, text, secs


# ---------------------------------------------------------------- comparisons

def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _attr_equal(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype == object or b.dtype == object:  # strings: compare the values
            return a.shape == b.shape and a.tolist() == b.tolist()
        return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (float, np.floating)) and isinstance(b, (float, np.floating)):
        return np.asarray(a).tobytes() == np.asarray(b).tobytes()
    return type(a) == type(b) and a == b


def h5_diff(path_a, path_b, rows=None, attrs=True):
    """Differences between two HDF5 files: object names, dataset dtypes, shapes and bytes, and
    attributes except EXCLUDED_ATTRS. rows: compare only the first `rows` rows of datasets."""
    diffs = []
    try:
        fa, fb = h5py.File(path_a, "r"), h5py.File(path_b, "r")
    except OSError as e:
        return [f"cannot open: {e}"]
    with fa, fb:
        names_a, names_b = [], []
        fa.visit(names_a.append)
        fb.visit(names_b.append)
        if sorted(names_a) != sorted(names_b):
            diffs.append(f"objects differ: {sorted(set(names_a) ^ set(names_b))}")
        for name in ["/"] + sorted(set(names_a) & set(names_b)):
            oa, ob = fa[name], fb[name]
            if isinstance(oa, h5py.Dataset) != isinstance(ob, h5py.Dataset):
                diffs.append(f"{name}: dataset in one file only")
                continue
            if isinstance(oa, h5py.Dataset):
                if oa.dtype != ob.dtype:
                    diffs.append(f"{name}: dtype {oa.dtype} vs {ob.dtype}")
                    continue
                if rows is None:
                    if oa.shape != ob.shape:
                        diffs.append(f"{name}: shape {oa.shape} vs {ob.shape}")
                        continue
                    xa, xb = oa[()], ob[()]
                else:
                    xa = oa[:rows] if oa.ndim else oa[()]
                    xb = ob[:rows] if ob.ndim else ob[()]
                if np.asarray(xa).tobytes() != np.asarray(xb).tobytes():
                    diffs.append(f"{name}: data differ" + (f" in the first {rows} rows" if rows is not None else ""))
            if not attrs:
                continue
            ka = {k for k in oa.attrs if k not in EXCLUDED_ATTRS}
            kb = {k for k in ob.attrs if k not in EXCLUDED_ATTRS}
            if ka != kb:
                diffs.append(f"{name}: attributes {sorted(ka ^ kb)} in one file only")
            for k in sorted(ka & kb):
                va, vb = oa.attrs[k], ob.attrs[k]
                if k == "config" and isinstance(va, str) and isinstance(vb, str):
                    va, vb = RESUME_LINE.sub("", va), RESUME_LINE.sub("", vb)
                if not _attr_equal(va, vb):
                    diffs.append(f"{name}: attribute {k} differs: {str(va)[:150]!r} vs {str(vb)[:150]!r}")
    return diffs


def metric_lines(path):
    """(complete lines without their timing fields, partial last line or None)."""
    with open(path, "rb") as f:
        data = f.read().decode(errors="replace")
    partial = None
    if data and not data.endswith("\n"):
        data, _, partial = data.rpartition("\n")
    out = []
    for line in data.split("\n"):
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            out.append({"<unparsable>": line})
            continue
        stable = metric_stable(obj)
        if stable is not None:
            out.append(stable)
    return out, partial


def metric_stable(obj):
    """A metrics line without what depends on timing or on the run's identity
    (docs/FORMATS.md, "Training metrics"), or None for a line that exists only because of
    timing or of a resume: straggler events, and the `run` line a resumed run adds."""
    kind = obj.get("type")
    if kind == "run":
        if obj.get("step", 0) > 0:
            return None  # a resumed run's own `run` line (the reference has none)
        # lock_wait_s is measured: a rerun may wait some milliseconds for its output's lock
        # while its killed predecessor's ranks exit (docs/FORMATS.md, "Run lines").
        out = {k: v for k, v in obj.items() if k not in ("time", "run_id", "lock_wait_s")}
        if isinstance(out.get("config"), str):
            out["config"] = RESUME_LINE.sub("", out["config"])
        return out
    if kind in ("ranks", "telemetry"):
        # Every member but the step is measured (time, per-rank seconds, RSS, CPU, faults).
        return {"type": kind, "step": obj.get("step")}
    if kind == "event" and obj.get("event") in ("straggler", "straggler_recovered"):
        return None  # verdicts on timing: the load decides whether they appear
    return {k: v for k, v in obj.items() if k not in METRIC_TIMING and k != "time"}


def json_stable(obj, drop):
    if isinstance(obj, dict):
        return {k: json_stable(v, drop) for k, v in obj.items() if k not in drop}
    if isinstance(obj, list):
        return [json_stable(v, drop) for v in obj]
    return obj


def json_diff(path_a, path_b, run_scoped=False):
    try:
        with open(path_a) as f:
            a = json.load(f)
        with open(path_b) as f:
            b = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return [f"unreadable JSON: {e}"]
    drop = REPORT_VOLATILE | (REPORT_RUN_SCOPED if run_scoped else set())
    a, b = json_stable(a, drop), json_stable(b, drop)
    if a == b:
        return []
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) if isinstance(a, dict) else []
    return [f"JSON content differs in {keys}: {[a.get(k) for k in keys]} vs {[b.get(k) for k in keys]}"]


def temp_files(root):
    out = []
    for d, _, files in os.walk(root):
        out += [os.path.join(d, f) for f in files if TEMP_NAME.search(f)]
    return out


# ---------------------------------------------------------------- data and variants

def write_csv(path, x, y):
    cols = [f"f{i}" for i in range(x.shape[1])]
    with open(path, "w") as f:
        f.write(",".join(cols + ["label"]) + "\n")
        for row, label in zip(x, y):
            f.write(",".join(f"{v:.6g}" for v in row) + f",{label}\n")


CONFIG = """# chaos suite: a small 4-class pipeline (written by tests/chaos/chaos.py)
[ingest]
source = csv
csv_label = label
normalize = standardize
num_classes = 4
chunk_rows = 256
# A write that fails on one rank only can leave HDF5's collective close stuck (docs/
# RELIABILITY.md): the watchdog must end it with exit 5 well within RUN_TIMEOUT_S.
watchdog_s = 30

[gates]
features = 16
require_labels = true
min_rows = 100

[data]
train = train.h5
test = test.h5

[model]
widths = 16,64,64,4
activation = relu
seed = 3

[optim]
optimizer = adam
lr = 0.003
schedule = cosine
warmup_steps = 20

[train]
epochs = 4
batch = 32
threads = 1
log_every = 10
output = model.h5
metrics = metrics.jsonl

[loader]
shuffle = global
seed = 2
memory_budget_mb = 64

[eval]
batch = 200

[checkpoint]
dir = ckpt
every_steps = 25
every_seconds = 0
keep_last = 3

[infer]
model = model.h5
input = input.h5
output = scores.h5
top_k = 2
batch_rows = 128
unit_rows = 512
"""


class Campaign:
    def __init__(self, cfg):
        self.cfg = cfg
        self.base = os.path.join(cfg.workdir, "base")
        self.refs = {}  # variant -> (reference dir, seconds)
        self.counter = 0

    # --- shared inputs -------------------------------------------------
    def prepare(self):
        os.makedirs(self.base, exist_ok=True)
        rng = np.random.default_rng(16)
        centers = rng.normal(0, 2, size=(4, 16))

        def sample(n):
            y = rng.integers(0, 4, size=n)
            x = centers[y] + rng.normal(0, 1.5, size=(n, 16))
            return x.astype(np.float32), y

        xa, ya = sample(3000)
        xb, yb = sample(1000)
        xt, yt = sample(1000)
        write_csv(os.path.join(self.base, "a.csv"), xa, ya)
        write_csv(os.path.join(self.base, "b.csv"), xb, yb)
        write_csv(os.path.join(self.base, "ab.csv"), np.vstack([xa, xb]), np.concatenate([ya, yb]))
        write_csv(os.path.join(self.base, "test.csv"), xt, yt)
        with open(os.path.join(self.base, "chaos.ini"), "w") as f:
            f.write(CONFIG)
        b = self.base
        self.must("ingest", ["--ingest.csv=a.csv", "--ingest.output=a.h5"], b)
        self.must("ingest", ["--ingest.csv=test.csv", "--ingest.output=test.h5"], b)
        shutil.copy(os.path.join(b, "a.h5"), os.path.join(b, "ab.h5"))
        self.must("ingest", ["--ingest.csv=b.csv", "--ingest.output=ab.h5", "--append"], b)
        self.must("train", ["--data.train=a.h5", "--data.test=test.h5", "--checkpoint.dir=",
                            "--train.metrics="], b)
        # The prediction files the infer variants start from: the earlier version a full run
        # replaces, and the output an incremental run extends (scored before b was appended).
        self.must("infer", ["--infer.input=a.h5", "--infer.output=scores-a.h5"], b)

    def must(self, app, args, cwd):
        rc, hung, text, _ = run_to_end(self.cfg, app, self.config_args() + args, cwd)
        if rc != 0:
            raise SystemExit(f"chaos: preparing the inputs failed: locus-{app} {' '.join(args)} "
                             f"exited {rc}{' (hung)' if hung else ''}:\n{text[-3000:]}")

    def config_args(self):
        return ["--config", os.path.join(self.base, "chaos.ini")]

    # --- variants -------------------------------------------------------
    def setup(self, variant, work):
        """Fills `work` with the variant's starting state; returns the variant's description:
        app, args (first run), rerun args, outputs {name: kind}, checkpoint dir or None."""
        app, kind = variant.split("/")
        b = self.base
        cp = lambda src, dst: shutil.copy(os.path.join(b, src), os.path.join(work, dst))  # noqa: E731
        if app == "ingest":
            cp("a.h5", "data.h5")  # the earlier version: replaced (full) or extended (append)
            args = ["--ingest.output=data.h5"]
            if kind == "full":
                args += [f"--ingest.csv={b}/ab.csv", "--overwrite"]
            else:
                args += [f"--ingest.csv={b}/b.csv", "--append"]
            return dict(app="ingest", args=args, rerun=args,
                        outputs={"data.h5": "h5", "data.h5.gates.json": "json"}, ckpt=None)
        if app == "train":
            cp("a.h5", "train.h5")
            cp("test.h5", "test.h5")
            dp_pp, mode = kind.split("-")
            args = [f"--checkpoint.async={'true' if mode == 'async' else 'false'}"]
            if dp_pp == "pp2":
                args += ["--train.pipeline_stages=2", "--train.micro_batches=2"]
            return dict(app="train", args=args, rerun=args + ["--resume=auto"],
                        outputs={"model.h5": "h5", "metrics.jsonl": "metrics"}, ckpt="ckpt")
        if kind == "full":
            cp("model.h5", "model.h5")
            cp("test.h5", "input.h5")
            cp("scores-a.h5", "scores.h5")  # the earlier version, replaced
            args = ["--overwrite"]
        else:
            cp("model.h5", "model.h5")
            cp("a.h5", "input.h5")
            # The scores of a.h5's rows, then the input grows by b's rows: the incremental run
            # scores only those. Made here from a full run on a.h5's rows.
            shutil.copy(os.path.join(b, "scores-a.h5"), os.path.join(work, "scores.h5"))
            cp("ab.h5", "input.h5")
            args = ["--incremental"]
        return dict(app="infer", args=args, rerun=args,
                    outputs={"scores.h5": "h5" if kind == "full" else "h5-incremental",
                             "scores.h5.report.json": "json" if kind == "full" else "json-run"},
                    ckpt=None)

    def new_dir(self, label):
        self.counter += 1
        d = os.path.join(self.cfg.workdir, f"{self.counter:04d}-{label.replace('/', '-')}")
        os.makedirs(d)
        return d

    def reference(self, variant):
        if variant in self.refs:
            return self.refs[variant]
        work = self.new_dir("ref-" + variant)
        v = self.setup(variant, work)
        rc, hung, text, secs = run_to_end(self.cfg, v["app"], self.config_args() + v["args"], work)
        if rc != 0:
            raise SystemExit(f"chaos: the reference run of {variant} failed (exit {rc}):\n{text[-3000:]}")
        self.refs[variant] = (work, secs)
        return self.refs[variant]

    # --- checks ---------------------------------------------------------
    def verify_checkpoints(self, work, v, problems, when):
        if not v["ckpt"]:
            return
        d = os.path.join(work, v["ckpt"])
        files = sorted(f for f in os.listdir(d) if re.fullmatch(r"ckpt-\d+\.h5", f)) if os.path.isdir(d) else []
        if files:
            ckpt = os.path.join(self.cfg.bindir, "locus-ckpt")
            p = subprocess.run([ckpt, "verify", *[os.path.join(d, f) for f in files]],
                               capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                                        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
            if p.returncode != 0:
                problems.append(f"{when}: a checkpoint does not verify (locus-ckpt verify exit "
                                f"{p.returncode}): {(p.stdout + p.stderr)[-1500:]}")
        latest = os.path.join(d, "latest")
        if os.path.exists(latest):
            with open(latest) as f:
                m = re.search(r"^latest (\S+)", f.read(), re.M)
            if m and m.group(1) != "-" and m.group(1) not in files:
                problems.append(f"{when}: ckpt/latest names {m.group(1)}, which does not exist")

    def check_interim(self, work, ref, v, before, problems, when):
        """No output under its final name unless complete: the version from before the
        command, or equal to the reference's."""
        for name, kind in v["outputs"].items():
            path = os.path.join(work, name)
            if not os.path.exists(path):
                if before.get(name) is not None:
                    problems.append(f"{when}: {name} existed before the run and is gone")
                continue
            if before.get(name) is not None and sha256(path) == before[name]:
                continue
            refp = os.path.join(ref, name)
            if kind == "h5":
                d = h5_diff(path, refp)
                if d:
                    problems.append(f"{when}: {name} is neither its earlier version nor complete: {d[:3]}")
            elif kind in ("json", "json-run"):
                d = json_diff(path, refp, kind == "json-run")
                if d:
                    problems.append(f"{when}: {name}: {d}")
            elif kind == "metrics":
                got, partial = metric_lines(path)
                want, _ = metric_lines(refp)
                if got != want[:len(got)]:
                    first = next(i for i in range(len(got)) if i >= len(want) or got[i] != want[i])
                    problems.append(f"{when}: {name} line {first + 1} is not the reference's: "
                                    f"{got[first]} vs {want[first] if first < len(want) else 'none'}")
                if partial:
                    log(f"    note: {name} ends in a partial line after the fault: {partial[:80]!r}")
            elif kind == "h5-incremental":
                self.check_incremental_prefix(path, refp, problems, when, name)
        self.verify_checkpoints(work, v, problems, when)

    def check_incremental_prefix(self, path, refp, problems, when, name):
        try:
            with h5py.File(path, "r") as f:
                committed = int(f.attrs["committed_rows"])
        except (OSError, KeyError) as e:
            problems.append(f"{when}: {name} (updated in place) is unreadable: {e}")
            return
        with h5py.File(os.path.join(self.base, "scores-a.h5"), "r") as f:
            floor = int(f.attrs["committed_rows"])
        if committed < floor:
            problems.append(f"{when}: {name}: committed_rows went back from {floor} to {committed}")
        d = h5_diff(path, refp, rows=committed, attrs=False)
        if d:
            problems.append(f"{when}: {name}: rows below the watermark ({committed}) differ: {d[:3]}")

    def check_final(self, work, ref, v, problems):
        # The config attribute is the effective INI of the command that wrote the file: the
        # rerun's says resume = auto (compared without that line, see h5_diff).
        for name, kind in v["outputs"].items():
            path, refp = os.path.join(work, name), os.path.join(ref, name)
            if not os.path.exists(path):
                problems.append(f"final: {name} missing")
                continue
            if kind in ("h5", "h5-incremental"):
                d = h5_diff(path, refp)
            elif kind in ("json", "json-run"):
                d = json_diff(path, refp, kind == "json-run")
            else:
                got, partial = metric_lines(path)
                want, _ = metric_lines(refp)
                d = [] if got == want and partial is None else [
                    f"{len(got)} lines vs the reference's {len(want)}; first difference at line "
                    f"{next((i + 1 for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)) + 1)}"
                    + (", and a partial line" if partial else "")]
            if d:
                problems.append(f"final: {name} differs from the uninterrupted run's: {d[:4]}")
        self.verify_checkpoints(work, v, problems, "final")
        left = temp_files(work)
        if left:
            problems.append(f"final: temporary files remain: {[os.path.relpath(p, work) for p in left]}")

    def snapshot(self, work, v):
        out = {}
        for name in v["outputs"]:
            p = os.path.join(work, name)
            out[name] = sha256(p) if os.path.exists(p) else None
        return out

    # --- one injection --------------------------------------------------
    def inject(self, spec):
        """spec: dict(variant, kind, at (s), rank, stop_s). Returns a result dict."""
        cfg = self.cfg
        variant, kind = spec["variant"], spec["kind"]
        ref, _ = self.reference(variant)
        work = self.new_dir(variant + "-" + kind)
        v = self.setup(variant, work)
        before = self.snapshot(work, v)
        problems, notes = [], []
        run = Run(cfg, v["app"], self.config_args() + v["args"], work)
        landed = self.deliver(run, spec, notes)
        rc, hung = run.wait()
        if kind == "kill-mpirun" and run.ranks:
            left = run.wait_orphans(ORPHAN_WAIT_S)
            if left:
                notes.append(f"{len(left)} orphaned rank(s) still running {ORPHAN_WAIT_S} s after mpirun died: killed")
        text = run.output()
        run.close()
        with open(os.path.join(work, "chaos-fault-run.log"), "w") as f:
            f.write(f"$ {' '.join(run.cmd)}\n{text}")
        if hung:
            problems.append(f"the faulted run did not end within {RUN_TIMEOUT_S} s (hang)")
        if run.launcher_hangs:
            notes.append(f"mpirun was still running {LAUNCHER_GRACE_S} s after its ranks ended "
                         "(Open MPI's own PMIx finalize; stacks in chaos-hang-stacks.txt): killed")
        if kind == "stop" and landed and rc != 0:
            problems.append(f"the suspended run did not complete after SIGCONT: exit {rc}:\n{text[-1500:]}")
        attempts = [rc]
        if rc != 0:
            self.check_interim(work, ref, v, before, problems, f"after the fault (exit {rc})")
        for _ in range(RERUNS):
            if attempts[-1] == 0:
                break
            before = self.snapshot(work, v)
            rc2, hung2, text2, _ = run_to_end(cfg, v["app"], self.config_args() + v["rerun"], work)
            attempts.append(rc2)
            with open(os.path.join(work, f"chaos-rerun-{len(attempts) - 1}.log"), "w") as f:
                f.write(text2)
            if hung2:
                problems.append(f"a rerun did not end within {RUN_TIMEOUT_S} s (hang)")
            if rc2 != 0:
                notes.append(f"rerun exited {rc2}: {text2.strip().splitlines()[-1:]} ")
                self.check_interim(work, ref, v, before, problems, f"after a failed rerun (exit {rc2})")
        if attempts[-1] != 0:
            problems.append(f"the job never completed: exits {attempts}")
        else:
            self.check_final(work, ref, v, problems)
        if not problems and not cfg.keep:
            shutil.rmtree(work, ignore_errors=True)
        return dict(spec=spec, landed=landed, exits=attempts, problems=problems, notes=notes,
                    work=work)

    def deliver(self, run, spec, notes):
        """Sleeps until spec['at'] and delivers the fault; False when the job had ended."""
        at = spec["at"]
        while run.elapsed() < at:
            if run.proc.poll() is not None:
                return False
            run.find_ranks()
            time.sleep(min(0.005, max(0.0, at - run.elapsed())))
        if run.proc.poll() is not None:
            return False
        kind = spec["kind"]
        ranks = run.find_ranks(wait_s=0.0 if kind == "kill-mpirun" else 15.0)
        ranks = [r for r in ranks if alive(r)]
        if kind != "kill-mpirun" and not ranks:
            return False
        try:
            if kind == "kill-rank":
                os.kill(ranks[spec["rank"] % len(ranks)], signal.SIGKILL)
            elif kind == "kill-mpirun":
                os.kill(run.proc.pid, signal.SIGKILL)
            elif kind in ("term", "usr1"):
                sig = signal.SIGTERM if kind == "term" else signal.SIGUSR1
                for r in ranks:
                    os.kill(r, sig)
            elif kind == "stop":
                group = [run.proc.pid, *ranks]
                for p in group:
                    os.kill(p, signal.SIGSTOP)
                time.sleep(spec["stop_s"])
                for p in group:
                    os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            notes.append("a target had exited as the fault was delivered")
        return True

    # --- write faults ---------------------------------------------------
    def write_fault_cases(self):
        """(name, variant, shim env)."""
        cases = [
            ("ingest full: ENOSPC in the dataset after 64 KiB", "ingest/full",
             {"LOCUS_FAULT_PATH": "{work}/.data.h5.locus-tmp", "LOCUS_FAULT_AFTER_BYTES": "65536"}),
            ("ingest append: EIO copying the dataset (copy_file_range)", "ingest/append",
             {"LOCUS_FAULT_PATH": "{work}/.data.h5.locus-tmp", "LOCUS_FAULT_AT_CALL": "1",
              "LOCUS_FAULT_ERRNO": "EIO", "LOCUS_FAULT_CALLS": "copy_file_range"}),
            ("ingest append: ENOSPC writing the new rows, rank 1 only", "ingest/append",
             {"LOCUS_FAULT_PATH": "{work}/.data.h5.locus-tmp", "LOCUS_FAULT_AT_CALL": "1", "LOCUS_FAULT_RANK": "1",
              "LOCUS_FAULT_CALLS": "write,pwrite,pwrite64,pwritev,pwritev64,writev"}),
            ("train: ENOSPC in the model file", "train/dp2-sync",
             {"LOCUS_FAULT_PATH": "{work}/.model.h5.locus-tmp", "LOCUS_FAULT_AT_CALL": "1"}),
            ("train: EIO in the 3rd checkpoint's tensors (step 75) after two good ones",
             "train/dp2-sync",
             {"LOCUS_FAULT_PATH": "{work}/ckpt/.ckpt-00000075.h5", "LOCUS_FAULT_AT_CALL": "1",
              "LOCUS_FAULT_ERRNO": "EIO", "LOCUS_FAULT_CALLS": "pwrite,pwrite64"}),
            ("train: fsync of a checkpoint fails (async saves)", "train/dp2-async",
             {"LOCUS_FAULT_PATH": "{work}/ckpt/.ckpt-", "LOCUS_FAULT_CALLS": "fsync,fdatasync",
              "LOCUS_FAULT_AT_CALL": "2"}),
            ("train pp2: ENOSPC in a checkpoint's tensors on rank 1 only", "train/pp2-sync",
             {"LOCUS_FAULT_PATH": "{work}/ckpt/.ckpt-00000050.h5", "LOCUS_FAULT_AT_CALL": "1",
              "LOCUS_FAULT_RANK": "1", "LOCUS_FAULT_CALLS": "pwrite,pwrite64"}),
            ("infer full: ENOSPC in the prediction file", "infer/full",
             {"LOCUS_FAULT_PATH": "{work}/.scores.h5.locus-tmp", "LOCUS_FAULT_AT_CALL": "2"}),
            ("infer incremental: EIO in the prediction file (in place)", "infer/incremental",
             {"LOCUS_FAULT_PATH": "{work}/scores.h5", "LOCUS_FAULT_AT_CALL": "3", "LOCUS_FAULT_ERRNO": "EIO"}),
            # Every call from the 2nd on fails (write, pwritev, fsync: a disk that stays
            # full). Before the fix this hung: after the agreed failure the collective
            # H5Fclose flushed metadata into the same file, failed, and the ranks left HDF5
            # through different collectives.
            ("train: EIO from the 2nd write call of a checkpoint on, every call kind",
             "train/dp2-sync",
             {"LOCUS_FAULT_PATH": "{work}/ckpt/.ckpt-00000075.h5", "LOCUS_FAULT_AT_CALL": "2",
              "LOCUS_FAULT_ERRNO": "EIO"}),
        ]
        return cases

    def write_fault(self, name, variant, env):
        cfg = self.cfg
        ref, _ = self.reference(variant)
        work = self.new_dir("wf-" + variant)
        v = self.setup(variant, work)
        # Paths are anchored at the run's directory: a bare name would also match Open MPI's
        # session files named after the output (sharedfp/sm's "<name>_cid-N-PID.sm" under
        # /tmp/ompi.*), whose failed write kills rank 0 by SIGBUS inside Open MPI while it holds
        # a node-wide named semaphore (see docs/RELIABILITY.md, "Chaos suite").
        env = {k: val.replace("{work}", work) for k, val in env.items()}
        env["LD_PRELOAD"] = cfg.shim
        env["LOCUS_FAULT_TRACE"] = os.path.join(work, "fault-trace.txt")
        before = self.snapshot(work, v)
        problems, notes = [], []
        rc, hung, text, _ = run_to_end(cfg, v["app"], self.config_args() + v["args"], work,
                                       mpi_env=env)
        trace = []
        if os.path.exists(env["LOCUS_FAULT_TRACE"]):
            with open(env["LOCUS_FAULT_TRACE"]) as f:
                trace = f.read().split("\n")
            os.unlink(env["LOCUS_FAULT_TRACE"])
        # A failed call returns -1; a write cut short by the byte limit returns fewer bytes.
        failed_calls = [t for t in trace if t and (t.endswith(" -1") or (
            t.split()[1] not in ("fsync", "fdatasync") and int(t.split()[-1]) < int(t.split()[-2])))]
        calls = sorted({t.split()[1] for t in trace if t})
        if not failed_calls:
            problems.append(f"the shim failed no call (calls seen: {calls}); the case tests nothing")
        if hung:
            problems.append("hang")
        if rc != 5:
            problems.append(f"expected exit 5, got {rc}:\n{text[-2000:]}")
        errors = [l for l in text.splitlines() if "error" in l.lower()]
        target = env["LOCUS_FAULT_PATH"].split("/")[-1].strip(".").replace(".locus-tmp", "")
        if target.startswith("ckpt-"):
            target = "ckpt-"
        if not any(target in l for l in errors):
            problems.append(f"no error line names the file ({target}): {errors[:4]}")
        # Nothing published: every output as before (bytes), or for an in-place incremental
        # output, the rows below its watermark intact.
        for out, kind in v["outputs"].items():
            p = os.path.join(work, out)
            now = sha256(p) if os.path.exists(p) else None
            if kind == "h5-incremental" and now is not None:
                self.check_incremental_prefix(p, os.path.join(ref, out), problems, "after the write fault", out)
            elif kind in ("json", "json-run", "metrics"):
                continue  # reports are written before the output (gates) or after it; the
                # metrics file is a log that grows as training goes
            elif now != before.get(out):
                problems.append(f"{out} changed although the run failed")
        self.verify_checkpoints(work, v, problems, "after the write fault")
        if v["ckpt"]:
            self.compare_checkpoints_with_reference(work, ref, v, problems)
        left = [os.path.relpath(p, work) for p in temp_files(work)]
        if left:
            notes.append(f"temporary files left after the failure: {left}")
        # The failure must not block the rerun: without the shim it completes and matches.
        rc2, _, text2, _ = run_to_end(cfg, v["app"], self.config_args() + v["rerun"], work)
        if rc2 != 0:
            problems.append(f"the rerun without the fault exited {rc2}: {text2[-1500:]}")
        else:
            self.check_final(work, ref, v, problems)
        message = next((l for l in errors if target in l), errors[0] if errors else "")
        if not problems and not cfg.keep:
            shutil.rmtree(work, ignore_errors=True)
        return dict(name=name, variant=variant, exit=rc, calls=calls, failed=len(failed_calls),
                    problems=problems, notes=notes, message=message.strip(), work=work)

    def compare_checkpoints_with_reference(self, work, ref, v, problems):
        """Checkpoints left after a write fault hold the same tensors as the uninterrupted
        run's checkpoint of the same step (locus-ckpt diff, bitwise)."""
        d, rd = os.path.join(work, v["ckpt"]), os.path.join(ref, v["ckpt"])
        ckpt = os.path.join(self.cfg.bindir, "locus-ckpt")
        ref_files = set(os.listdir(rd))
        for f in sorted(os.listdir(d)):
            if not re.fullmatch(r"ckpt-\d+\.h5", f):
                continue
            if f not in ref_files:
                continue  # pruned from the reference by keep_last
            p = subprocess.run([ckpt, "diff", os.path.join(d, f), os.path.join(rd, f)],
                               capture_output=True, text=True, timeout=120,
                               env=dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1",
                                        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
            if p.returncode != 0:
                problems.append(f"{f} differs from the uninterrupted run's: {(p.stdout + p.stderr)[-800:]}")


# ---------------------------------------------------------------- plans

def covering_order(cells, rng):
    """The cells shuffled, then reordered so that the first few cover every kind and every app
    (a short run such as CI's still meets each of them)."""
    order = list(cells)
    rng.shuffle(order)
    front, kinds_seen, apps_seen = [], set(), set()
    all_kinds, all_apps = {k for _, k in cells}, {a for a, _ in cells}
    while kinds_seen != all_kinds or apps_seen != all_apps:
        best = max((c for c in order if c not in front),
                   key=lambda c: (c[1] not in kinds_seen) + (c[0] not in apps_seen))
        front.append(best)
        kinds_seen.add(best[1])
        apps_seen.add(best[0])
    return front + [c for c in order if c not in front]


def plan(seed, count, apps, kinds, start=0, moments=(0.0, 1.0)):
    """Balanced: every app x kind in turn (shuffled per round), variant, moment, rank and
    suspension drawn from a generator seeded by (seed, index), so injection i is the same
    whatever the count."""
    cells = [(a, k) for a in apps for k in kinds]
    out = []
    for i in range(start, start + count):
        rnd, pos = divmod(i, len(cells))
        order = covering_order(cells, random.Random(f"{seed}:round:{rnd}"))
        app, kind = order[pos]
        r = random.Random(f"{seed}:{i}")
        variant = f"{app}/{r.choice(VARIANTS[app])}"
        frac = moments[0] + (moments[1] - moments[0]) * r.random()
        out.append(dict(index=i, variant=variant, kind=kind, frac=frac,
                        rank=r.randrange(RANKS), stop_s=round(r.uniform(2.0, 5.0), 1)))
    return out


def parse_replay(text):
    """variant/kind/at[/rN][/stopS]: e.g. train/dp2-async/kill-rank/1.234/r1."""
    parts = text.split("/")
    if len(parts) < 4:
        raise SystemExit(f"--replay {text!r}: expected APP/VARIANT/KIND/SECONDS[/rRANK][/sSTOP]")
    spec = dict(index=0, variant=f"{parts[0]}/{parts[1]}", kind=parts[2], at=float(parts[3]),
                rank=0, stop_s=3.0)
    for p in parts[4:]:
        if p.startswith("r"):
            spec["rank"] = int(p[1:])
        elif p.startswith("s"):
            spec["stop_s"] = float(p[1:])
    if parts[0] not in VARIANTS or parts[1] not in VARIANTS[parts[0]] or parts[2] not in KINDS:
        raise SystemExit(f"--replay {text!r}: unknown app, variant or kind")
    return spec


def spec_text(s):
    return f"{s['variant']}/{s['kind']}/{s['at']:.3f}/r{s['rank']}/s{s['stop_s']}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--injections", type=int, default=15)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="index of the first injection (replay)")
    ap.add_argument("--apps", default="ingest,train,infer")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--shim", default=None, help="the write-fault shim (default: in --build)")
    ap.add_argument("--write-faults", action="store_true", help="also run the write-fault cases")
    ap.add_argument("--only-write-faults", action="store_true")
    ap.add_argument("--write-fault-case", type=int, help="run only this write-fault case (0-based)")
    ap.add_argument("--replay", help="one injection: APP/VARIANT/KIND/SECONDS[/rRANK][/sSTOP]")
    ap.add_argument("--ci", action="store_true",
                    help="CI's bounded run: seed 16, 6 injections covering every app and kind, "
                         "then the write-fault cases")
    ap.add_argument("--workdir", help="where runs happen (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep every run's directory")
    ap.add_argument("--summary", help="write the counts as JSON to this file")
    cfg = ap.parse_args()
    if cfg.ci:
        cfg.seed, cfg.injections, cfg.write_faults = 16, 6, True
    apps = [a for a in cfg.apps.split(",") if a]
    kinds = [k for k in cfg.kinds.split(",") if k]
    for a in apps:
        if a not in VARIANTS:
            raise SystemExit(f"--apps: unknown app {a!r} (ingest, train, infer)")
    for k in kinds:
        if k not in KINDS:
            raise SystemExit(f"--kinds: unknown kind {k!r} ({', '.join(KINDS)})")
    cfg.build = os.path.abspath(cfg.build)
    cfg.bindir = os.path.join(cfg.build, "apps")
    cfg.mpiexec = os.environ.get("LOCUS_MPIEXEC", "mpiexec")
    cfg.shim = os.path.abspath(cfg.shim) if cfg.shim else os.path.join(
        cfg.build, "tests", "chaos", "liblocus_chaos_write_fault.so")
    need = [os.path.join(cfg.bindir, f"locus-{a}") for a in ("ingest", "train", "infer", "ckpt")]
    if cfg.write_faults or cfg.only_write_faults:
        need.append(cfg.shim)
    missing = [p for p in need if not os.path.exists(p)]
    if missing:
        raise SystemExit(f"chaos: not built: {missing}; run scripts/build.sh (or build the targets "
                         "locus-ingest locus-train locus-infer locus-ckpt locus_chaos_write_fault)")
    signal.signal(signal.SIGTERM, on_interrupt)
    signal.signal(signal.SIGINT, on_interrupt)
    if not become_subreaper():
        raise SystemExit("chaos: prctl(PR_SET_CHILD_SUBREAPER) failed: orphaned ranks could not be reaped")
    tmp = None
    if not cfg.workdir:
        tmp = tempfile.mkdtemp(prefix="locus-chaos-",
                               dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        cfg.workdir = tmp
    os.makedirs(cfg.workdir, exist_ok=True)
    me = os.path.relpath(__file__)
    base_cmd = f"{me} --build {cfg.build}"
    t_start = time.monotonic()
    log(f"chaos: seed {cfg.seed}, {0 if cfg.only_write_faults else (1 if cfg.replay else cfg.injections)} "
        f"injection(s), apps {','.join(apps)}, kinds {','.join(kinds)}, build {cfg.build}, "
        f"work {cfg.workdir}")
    camp = Campaign(cfg)
    camp.prepare()
    log(f"chaos: inputs ready ({time.monotonic() - t_start:.1f} s)")
    results, wf_results = [], []
    if not cfg.only_write_faults:
        # CI draws its moments from the first 60% of the reference run, so that every fault
        # lands while the job runs (a campaign draws from all of it: a fault may come late).
        moments = (0.05, 0.6) if cfg.ci else (0.0, 1.0)
        specs = [parse_replay(cfg.replay)] if cfg.replay else plan(
            cfg.seed, cfg.injections, apps, kinds, cfg.start, moments)
        for s in specs:
            _, ref_secs = camp.reference(s["variant"])
            if "at" not in s:
                s["at"] = round(s["frac"] * ref_secs, 3)
            t0 = time.monotonic()
            res = camp.inject(s)
            res["seconds"] = time.monotonic() - t0
            replay = f"{base_cmd} --replay {spec_text(s)}"
            res["replay"] = replay
            ok = "ok" if not res["problems"] else "VIOLATION"
            log(f"[{s['index']:4d}] {s['variant']:<18} {s['kind']:<11} at {s['at']:6.3f} s "
                f"(of {ref_secs:.2f}) rank {s['rank']}"
                + (f" stop {s['stop_s']} s" if s["kind"] == "stop" else "")
                + f": {'landed' if res['landed'] else 'job had ended'}, exits {res['exits']} "
                f"-> {ok} ({res['seconds']:.1f} s)")
            for n in res["notes"]:
                log(f"    note: {n}")
            for p in res["problems"]:
                log(f"    VIOLATION: {p}")
            if res["problems"]:
                log(f"    replay: {replay}   (kept: {res['work']})")
            results.append(res)
    if cfg.write_faults or cfg.only_write_faults:
        cases = list(enumerate(camp.write_fault_cases()))
        if cfg.write_fault_case is not None:
            cases = [cases[cfg.write_fault_case]]
        for i, (name, variant, env) in cases:
            if cfg.ci and name in KNOWN_OPEN:
                log(f"[write] {name}: skipped in CI, an open defect: {KNOWN_OPEN[name]}")
                continue
            t0 = time.monotonic()
            res = camp.write_fault(name, variant, env)
            res["seconds"] = time.monotonic() - t0
            ok = "ok" if not res["problems"] else "VIOLATION"
            log(f"[write] {name}: exit {res['exit']}, {res['failed']} call(s) failed of "
                f"{','.join(res['calls'])} -> {ok} ({res['seconds']:.1f} s)")
            log(f"    message: {res['message'][:300]}")
            for n in res["notes"]:
                log(f"    note: {n}")
            for p in res["problems"]:
                log(f"    VIOLATION: {p}")
            if res["problems"]:
                log(f"    replay: {base_cmd} --only-write-faults --write-fault-case {i}   (kept: {res['work']})")
            res["replay"] = f"{base_cmd} --only-write-faults --write-fault-case {i}"
            wf_results.append(res)
    elapsed = time.monotonic() - t_start
    summarize(results, wf_results, elapsed, cfg)
    bad = [r for r in results + wf_results if r["problems"]]
    if cfg.ci:
        # CI must have exercised every kind and app: a fault that came after the job ended
        # tests nothing.
        for what, key in (("kind", lambda s: s["kind"]), ("app", lambda s: s["variant"].split("/")[0])):
            wanted = set(kinds if what == "kind" else apps)
            hit = {key(r["spec"]) for r in results if r["landed"]}
            if wanted - hit:
                log(f"chaos: CI coverage: no fault landed for {what}(s) {sorted(wanted - hit)}")
                results.append(dict(problems=[f"no fault landed for {sorted(wanted - hit)}"],
                                    replay=f"{base_cmd} --ci"))
                bad.append(results[-1])
    if tmp and not bad and not cfg.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    if bad:
        log(f"\nchaos: {len(bad)} VIOLATION(S); replay:")
        for r in bad:
            log(f"  {r['replay']}")
        sys.exit(1)
    log("chaos: every invariant held")


def summarize(results, wf_results, elapsed, cfg):
    table = {}
    for r in results:
        key = (r["spec"]["variant"], r["spec"]["kind"])
        t = table.setdefault(key, dict(injections=0, landed=0, survived=0, reruns=0, exits={}))
        t["injections"] += 1
        t["landed"] += int(r["landed"])
        t["survived"] += int(not r["problems"])
        t["reruns"] += len(r["exits"]) - 1
        e = str(r["exits"][0])
        t["exits"][e] = t["exits"].get(e, 0) + 1
    if results:
        log("\nvariant            kind         injections landed survived reruns  first-run exits")
        for (variant, kind), t in sorted(table.items()):
            log(f"{variant:<18} {kind:<12} {t['injections']:>10} {t['landed']:>6} {t['survived']:>8} "
                f"{t['reruns']:>6}  {json.dumps(t['exits'], sort_keys=True)}")
        n, s = len(results), sum(not r["problems"] for r in results)
        log(f"total: {n} injections, {sum(r['landed'] for r in results)} landed, {s} survived")
    if wf_results:
        log(f"write faults: {len(wf_results)} cases, {sum(not r['problems'] for r in wf_results)} passed")
    log(f"chaos: {elapsed:.0f} s")
    if cfg.summary:
        with open(cfg.summary, "w") as f:
            json.dump(dict(seed=cfg.seed, elapsed_s=elapsed,
                           cells=[dict(variant=k[0], kind=k[1], **v) for k, v in sorted(table.items())],
                           injections=[dict(spec=r["spec"], landed=r["landed"], exits=r["exits"],
                                            problems=r["problems"], notes=r["notes"],
                                            seconds=r["seconds"]) for r in results],
                           write_faults=[{k: r[k] for k in ("name", "variant", "exit", "calls", "failed",
                                                             "problems", "notes", "message", "seconds")}
                                         for r in wf_results]), f, indent=1)


if __name__ == "__main__":
    main()
