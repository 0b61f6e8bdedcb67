"""Shared helpers for end-to-end app tests: run an app under mpiexec, compare HDF5 files."""
import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np

FASHION = "/usr/share/datasets/fashion-mnist"


class AppRunner:
    def __init__(self, bindir, ranks):
        self.bindir = bindir
        self.ranks = ranks
        self.mpiexec = os.environ.get("LOCUS_MPIEXEC", "mpiexec")
        # LOCUS_RANK_WRAPPER: a command each rank runs the app through (bench/gpu/hostid_rank.sh:
        # a host id per rank, so that ranks on one GPU can form an NCCL communicator).
        self.wrapper = os.environ.get("LOCUS_RANK_WRAPPER", "").split()

    def command(self, app, *args, ranks=None):
        n = ranks or self.ranks
        return [self.mpiexec, "--oversubscribe", "--bind-to", "none", "-n", str(n), *self.wrapper,
                os.path.join(self.bindir, app), *args]

    @staticmethod
    def environment(env=None):
        full_env = dict(os.environ)
        full_env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                         "OPENBLAS_NUM_THREADS": "1"})
        if env:
            full_env.update(env)
        return full_env

    def run(self, app, *args, ranks=None, env=None, cwd=None):
        cmd = self.command(app, *args, ranks=ranks)
        return subprocess.run(cmd, capture_output=True, text=True, env=self.environment(env),
                              cwd=cwd, timeout=600)

    def start(self, app, *args, ranks=None, env=None):
        """The app started in the background (a subprocess.Popen with text pipes)."""
        return subprocess.Popen(self.command(app, *args, ranks=ranks), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.environment(env))


def check(cond, msg, proc=None):
    if not cond:
        if proc is not None:
            msg += f"\n--- rc {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        raise AssertionError(msg)


def expect_exit(proc, code, *needles):
    check(proc.returncode == code, f"expected exit {code}, got {proc.returncode}", proc)
    text = proc.stdout + proc.stderr
    for n in needles:
        check(n in text, f"expected {n!r} in the output", proc)


def progress_lines(proc, prefix, pattern, interval):
    """The lines of proc's stdout that start with prefix, each matched by pattern (a compiled
    regex with groups `won` and `secs`), checked as one printer's every `interval` seconds of a
    run several intervals long: at least two; the first after one interval; each later than the
    one before (below 10 s, where the time has a decimal), whose units done it never undercuts.
    Returns the matches."""
    lines = [l for l in proc.stdout.splitlines() if l.startswith(prefix)]
    check(len(lines) >= 2, f"expected a progress line every {interval} s, got {len(lines)}", proc)
    matches = []
    for line in lines:
        m = pattern.match(line)
        check(m is not None, f"progress line not as documented: {line!r}", proc)
        if matches:
            prev = matches[-1]
            secs, before = float(m["secs"]), float(prev["secs"])
            check(secs > before or (secs == before and secs >= 10), "two lines at the same "
                  f"time (more than one rank prints?): {prev[0]!r} then {line!r}", proc)
            check(int(m["won"]) >= int(prev["won"]),
                  f"units done went back: {prev[0]!r} then {line!r}", proc)
        matches.append(m)
    check(float(matches[0]["secs"]) >= interval,
          f"the first line came before its interval: {lines[0]!r}", proc)
    return matches


def whole_units(rows, won, unit_rows, ranks):
    """Whether `rows` done are whole units' rows and agree with the `won` units done. The two
    counters are read together but each atomically on its own (WorkQueue::counts): a win in
    flight on each rank may be counted in one and not yet in the other."""
    return rows % unit_rows == 0 and abs(rows - unit_rows * won) <= unit_rows * ranks


def prometheus_values(text, job):
    """Series -> value of a Prometheus text file's samples, checking the exposition format as
    node_exporter reads it: every sample after its family's `# HELP` and `# TYPE` (gauge or
    counter) lines, each family's samples together and no series twice, every sample labelled
    locus_job="<job>" first (the file's name without `.prom`: what tells two jobs' files apart
    in one directory). A sample with that label alone is keyed by its metric name; one with
    more labels by the name and the others, as `locus_ingest_phase{phase="write"}`."""
    values, helped, typed = {}, set(), []
    first = 'locus_job="%s"' % job
    for line in text.splitlines():
        if line.startswith("# HELP "):
            check(line.split(" ")[2] not in helped, f"two # HELP lines: {line!r}")
            helped.add(line.split(" ")[2])
        elif line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            check(kind in ("gauge", "counter"), f"{name}: type {kind!r}")
            check(name in helped and name not in typed, f"# TYPE of {name} before its # HELP, "
                  "or twice")
            typed.append(name)
        elif line:
            series, value = line.split(" ")
            m = re.fullmatch(r'([a-z_]+)\{(.*)\}', series)
            check(m is not None and (m[2] == first or m[2].startswith(first + ",")),
                  f"sample {line!r} is not labelled {first} first")
            name, rest = m[1], m[2][len(first) + 1:]
            key = f"{name}{{{rest}}}" if rest else name
            check(typed and typed[-1] == name and key not in values,
                  f"sample {line!r} away from its family's # TYPE, or twice")
            values[key] = float(value)
    check(text.endswith("\n"), "the file does not end with a newline")
    return values


def read_dataset(path):
    with h5py.File(path, "r") as f:
        n = int(f.attrs["committed_rows"])
        x = f["features"][:n]
        y = f["labels"][:n] if "labels" in f else None
        attrs = {k: f["features"].attrs[k] for k in f["features"].attrs}
        return x, y, attrs


def lock_path(path):
    """The output lock's file beside `path` (io::lock_path_for)."""
    d, name = os.path.split(path)
    return os.path.join(d, "." + name + ".locus-lock")


def lock_is_free(path):
    """Whether the lock file `path` exists (it stays) and no process holds it (util-linux
    flock(1), without waiting)."""
    check(os.path.exists(path), f"no lock file {path}")
    return subprocess.run(["flock", "-n", path, "true"]).returncode == 0


def hold_lock_file(path):
    """Another process holding `path` locked as a job would (util-linux flock(1), which writes
    no holder record), in a session of its own; returns it once the lock is taken. End it with
    os.killpg(p.pid, signal.SIGKILL): its lock goes with it."""
    ready = path + ".ready"
    p = subprocess.Popen(["flock", "-n", "-o", path, "sh", "-c", f"touch '{ready}'; exec sleep 120"],
                         start_new_session=True)
    for _ in range(600):
        if os.path.exists(ready) or p.poll() is not None:
            break
        time.sleep(0.01)
    check(os.path.exists(ready), f"flock(1) did not take {path}")
    os.remove(ready)
    return p


def rank_pids(launcher):
    """World rank -> pid of the launcher's descendants that are MPI ranks."""
    children = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    found, todo = {}, [launcher]
    while todo:
        pid = todo.pop()
        for c in children.get(pid, []):
            todo.append(c)
            try:
                with open(f"/proc/{c}/environ", "rb") as f:
                    for kv in f.read().split(b"\0"):
                        if kv.startswith(b"OMPI_COMM_WORLD_RANK="):
                            found[int(kv.split(b"=", 1)[1])] = c
            except OSError:
                pass
    return found


@contextlib.contextmanager
def suspended(proc, ranks):
    """mpirun `proc` and its `ranks` ranks SIGSTOPped (as Slurm suspends a job) for the body,
    then SIGCONTed: a window in which the job is known to be mid-run however fast or slow the
    machine is. A stopped process keeps its locks; the watchdog does not count stopped time."""
    pids = [proc.pid] + list(rank_pids(proc.pid).values())
    check(len(pids) == ranks + 1, f"found {len(pids) - 1} ranks under mpirun, not {ranks}")
    check(proc.poll() is None, f"the job ended (rc {proc.returncode}) before it was suspended")

    def signal_all(sig):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:  # ended meanwhile: nothing to stop or continue
                pass

    try:
        signal_all(signal.SIGSTOP)
        yield
    finally:
        signal_all(signal.SIGCONT)


def no_outputs(path):
    d, name = os.path.split(path)
    return not os.path.exists(path) and not os.path.exists(os.path.join(d, "." + name + ".locus-tmp"))


def main(tests, once=()):
    """Runs test functions; args: BINDIR RANKS. Prints 'N passed, N failed'.

    Tests in `once` check what does not depend on the rank count (option errors, --help) and run
    only in the 2-rank instance of a suite (every rank count when LOCUS_APP_TESTS=all), so CI
    does not pay for them three times."""
    bindir, ranks = sys.argv[1], int(sys.argv[2])
    runner = AppRunner(bindir, ranks)
    everything = os.environ.get("LOCUS_APP_TESTS") == "all"
    passed = failed = 0
    for t in list(tests) + [t for t in once if ranks == 2 or everything]:
        with tempfile.TemporaryDirectory(prefix="locus-app-") as tmp:
            start = time.monotonic()
            try:
                t(runner, tmp)
                print(f"[ OK ] {t.__name__} ({time.monotonic() - start:.1f} s)", flush=True)
                passed += 1
            except Exception as e:  # noqa: BLE001 - report every failure
                print(f"[FAIL] {t.__name__} ({time.monotonic() - start:.1f} s): {e}", flush=True)
                failed += 1
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
