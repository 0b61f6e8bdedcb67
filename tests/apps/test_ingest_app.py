"""End-to-end tests of locus-ingest under mpiexec: real Fashion-MNIST, N ranks against 1 rank
and against a numpy reference, every quality gate, bad inputs, append and crash-safety."""
import filecmp
import gzip
import json
import os
import re
import shutil
import signal
import subprocess

import h5py
import numpy as np

from apphelpers import (FASHION, check, expect_exit, hold_lock_file, lock_is_free, lock_path, main,
                        no_outputs, progress_lines, prometheus_values, read_dataset,
                        whole_units)

# Many runs here fail on purpose (gates, bad inputs, config errors): do not wait for Open MPI's
# kill timeout after each (see test_infer_app.py). The two runs that kill a rank keep Open MPI's
# default teardown (the survivors get SIGTERM, then 1 s), as a job sees it in production.
os.environ.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "0")
DEFAULT_TEARDOWN = {"OMPI_MCA_odls_base_sigkill_timeout": "1"}

EXIT_CONFIG, EXIT_DATA, EXIT_GATE, EXIT_IO = 2, 3, 4, 5


def idx_array(path):
    with gzip.open(path, "rb") as f:
        raw = f.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def write_csv(path, header, rows):
    with open(path, "w") as f:
        f.write(",".join(header) + "\n")
        for r in rows:
            f.write(",".join(str(v) for v in r) + "\n")


def csv_ingest(r, tmp, csv, out, *extra, ranks=None, env=None):
    return r.run("locus-ingest", "--ingest.source=csv", f"--ingest.csv={csv}",
                 "--ingest.csv_label=y", "--ingest.normalize=none", "--ingest.num_classes=0",
                 "--gates.features=0", "--gates.min_rows=0", f"--ingest.output={out}", *extra,
                 ranks=ranks, env=env)


def gaussian_rows(rng, n, shift=0.0, classes=3):
    x = rng.normal(shift, 1.0, size=(n, 4))
    y = rng.integers(0, classes, size=n)
    return [[*np.round(xi, 6), int(yi)] for xi, yi in zip(x, y)]


HEADER = ["a", "b", "c", "d", "y"]


def test_fashion_mnist_train_and_test(r, tmp):
    for split, rows in (("train", 60000), ("t10k", 10000)):
        out = os.path.join(tmp, f"{split}.h5")
        p = r.run("locus-ingest", f"--ingest.images={FASHION}/{split}-images-idx3-ubyte.gz",
                  f"--ingest.labels={FASHION}/{split}-labels-idx1-ubyte.gz",
                  f"--ingest.output={out}")
        expect_exit(p, 0, f"{rows} rows x 784 features")
        check(subprocess.run(["h5dump", "-H", out], capture_output=True).returncode == 0,
              "h5dump -H must read the dataset")
        x, y, attrs = read_dataset(out)
        raw = idx_array(f"{FASHION}/{split}-images-idx3-ubyte.gz").reshape(rows, 784)
        labels = idx_array(f"{FASHION}/{split}-labels-idx1-ubyte.gz")
        check(x.shape == (rows, 784) and x.dtype == np.float32, f"shape {x.shape} {x.dtype}")
        check(np.array_equal(y, labels.astype(np.int32)), "labels differ from the IDX file")
        rawf = raw.astype(np.float64)
        mean, std = rawf.mean(axis=0), rawf.std(axis=0)
        check(np.allclose(attrs["mean"], mean, rtol=1e-6, atol=1e-9), "mean differs from numpy")
        check(np.allclose(attrs["std"], std, rtol=1e-6, atol=1e-9), "std differs from numpy")
        lo, hi = rawf.min(axis=0), rawf.max(axis=0)
        scale = np.where(hi > lo, 1.0 / np.where(hi > lo, hi - lo, 1.0), 1.0)
        ref = ((rawf - lo) * scale).astype(np.float32)
        check(np.allclose(x, ref, rtol=0, atol=1e-6), "minmax-normalized features differ")
        if r.ranks > 1:  # N ranks must write exactly what 1 rank writes
            one = os.path.join(tmp, f"{split}-1rank.h5")
            p = r.run("locus-ingest", f"--ingest.images={FASHION}/{split}-images-idx3-ubyte.gz",
                      f"--ingest.labels={FASHION}/{split}-labels-idx1-ubyte.gz",
                      f"--ingest.output={one}", ranks=1)
            expect_exit(p, 0)
            x1, y1, a1 = read_dataset(one)
            check(np.array_equal(x1.view(np.uint32), x.view(np.uint32)), "features not bitwise equal to 1 rank")
            check(np.array_equal(y1, y), "labels differ from 1 rank")
            check(np.allclose(a1["mean"], attrs["mean"], rtol=1e-12), "stats differ from 1 rank")


def test_csv_matches_serial_parse(r, tmp):
    rng = np.random.default_rng(1)
    rows = gaussian_rows(rng, 777)
    csv = os.path.join(tmp, "in.csv")
    write_csv(csv, HEADER, rows)
    out = os.path.join(tmp, "out.h5")
    expect_exit(csv_ingest(r, tmp, csv, out), 0, "777 rows x 4 features")
    x, y, attrs = read_dataset(out)
    ref = np.array([row[:4] for row in rows], dtype=np.float32)
    check(np.array_equal(x, ref), "CSV features differ from a serial parse")
    check(np.array_equal(y, np.array([row[4] for row in rows], dtype=np.int32)), "CSV labels differ")
    check(list(attrs["feature_names"]) == ["a", "b", "c", "d"], f"names {attrs['feature_names']}")


def gate_case(r, tmp, rows, rule, *extra, header=HEADER):
    csv = os.path.join(tmp, f"{rule}.csv")
    write_csv(csv, header, rows)
    out = os.path.join(tmp, f"{rule}.h5")
    report = os.path.join(tmp, f"{rule}.json")
    p = csv_ingest(r, tmp, csv, out, f"--ingest.report={report}", *extra)
    expect_exit(p, EXIT_GATE, f"'{rule}'")
    check(no_outputs(out), f"gate {rule}: something was published")
    with open(report) as f:
        rep = json.load(f)
    check(rep["passed"] is False, "report must say failed")
    failed = [x for x in rep["rules"] if not x["passed"]]
    check(any(x["rule"] == rule for x in failed), f"rule {rule} not failed in {failed}")
    return rep


def test_every_gate_fires_and_publishes_nothing(r, tmp):
    rng = np.random.default_rng(2)
    good = gaussian_rows(rng, 200)
    gate_case(r, tmp, good, "features", "--gates.features=5")
    bad_label = [row[:] for row in good]
    bad_label[150][4] = 7
    gate_case(r, tmp, bad_label, "label_range", "--ingest.num_classes=3")
    nan_rows = [row[:] for row in good]
    nan_rows[123][2] = "nan"
    nan_rows[7][0] = "inf"
    gate_case(r, tmp, nan_rows, "nonfinite")
    gate_case(r, tmp, good, "min_rows", "--gates.min_rows=1000")
    gate_case(r, tmp, good, "max_rows", "--gates.max_rows=100")
    gate_case(r, tmp, good[:5], "require_labels", "--ingest.csv_label=", "--gates.require_labels=true",
              header=HEADER)
    # Reference-based gates.
    ref_csv = os.path.join(tmp, "ref.csv")
    write_csv(ref_csv, HEADER, gaussian_rows(rng, 2000))
    ref = os.path.join(tmp, "ref.h5")
    expect_exit(csv_ingest(r, tmp, ref_csv, ref), 0)
    gate_case(r, tmp, good, "rows_within_pct", f"--gates.reference={ref}", "--gates.rows_within_pct=10")
    drifted = gaussian_rows(rng, 2000, shift=3.0)
    gate_case(r, tmp, drifted, "max_mean_shift", f"--gates.reference={ref}", "--gates.max_mean_shift=0.5")
    gate_case(r, tmp, drifted, "max_psi", f"--gates.reference={ref}", "--gates.max_psi=0.25")
    # The same data without drift passes all of them.
    same = gaussian_rows(rng, 2000)
    csv = os.path.join(tmp, "same.csv")
    write_csv(csv, HEADER, same)
    p = csv_ingest(r, tmp, csv, os.path.join(tmp, "same.h5"), f"--gates.reference={ref}",
                   "--gates.rows_within_pct=10", "--gates.max_mean_shift=0.5", "--gates.max_psi=0.25")
    expect_exit(p, 0)


def test_nonfinite_drop_counts(r, tmp):
    rng = np.random.default_rng(3)
    rows = gaussian_rows(rng, 100)
    rows[10][1] = "nan"
    rows[99][3] = "-inf"
    csv = os.path.join(tmp, "in.csv")
    write_csv(csv, HEADER, rows)
    out = os.path.join(tmp, "out.h5")
    report = os.path.join(tmp, "r.json")
    p = csv_ingest(r, tmp, csv, out, "--gates.nonfinite=drop", f"--ingest.report={report}")
    expect_exit(p, 0, "dropped 2")
    x, _, _ = read_dataset(out)
    check(x.shape[0] == 98 and np.isfinite(x).all(), f"expected 98 finite rows, got {x.shape}")
    with open(report) as f:
        check(json.load(f)["dropped_rows"] == 2, "report must count dropped rows")


def test_validate_only_writes_report_only(r, tmp):
    rng = np.random.default_rng(4)
    csv = os.path.join(tmp, "in.csv")
    write_csv(csv, HEADER, gaussian_rows(rng, 50))
    out = os.path.join(tmp, "out.h5")
    report = os.path.join(tmp, "r.json")
    p = csv_ingest(r, tmp, csv, out, "--validate-only", f"--ingest.report={report}")
    expect_exit(p, 0, "validated 50 rows")
    check(no_outputs(out) and os.path.exists(report), "validate-only must publish only the report")


def test_bad_inputs_give_clear_errors_and_no_output(r, tmp):
    out = os.path.join(tmp, "out.h5")
    p = r.run("locus-ingest", f"--ingest.images={tmp}/missing.gz", f"--ingest.output={out}")
    expect_exit(p, EXIT_DATA, "missing.gz")
    with open(f"{FASHION}/t10k-images-idx3-ubyte.gz", "rb") as f:
        blob = f.read()
    trunc = os.path.join(tmp, "trunc.gz")
    with open(trunc, "wb") as f:
        f.write(blob[: len(blob) // 2])
    p = r.run("locus-ingest", f"--ingest.images={trunc}",
              f"--ingest.labels={FASHION}/t10k-labels-idx1-ubyte.gz", f"--ingest.output={out}")
    expect_exit(p, EXIT_DATA, "trunc.gz")
    badmagic = os.path.join(tmp, "bad.idx")
    with open(badmagic, "wb") as f:
        f.write(b"\x12\x34\x08\x03" + b"\x00" * 64)
    p = r.run("locus-ingest", f"--ingest.images={badmagic}", "--ingest.labels=", f"--ingest.output={out}")
    expect_exit(p, EXIT_DATA, "bad.idx")
    ragged = os.path.join(tmp, "ragged.csv")
    with open(ragged, "w") as f:
        f.write("a,b,c,d,y\n" + "1,2,3,4,0\n" * 50 + "1,2,3,0\n" + "1,2,3,4,1\n" * 50)
    expect_exit(csv_ingest(r, tmp, ragged, out), EXIT_DATA, "ragged.csv", "line 52")
    text = os.path.join(tmp, "text.csv")
    with open(text, "w") as f:
        f.write("a,b,c,d,y\n" + "1,2,3,4,0\n" * 70 + "1,zebra,3,4,0\n")
    expect_exit(csv_ingest(r, tmp, text, out), EXIT_DATA, "zebra", "line 72")
    empty = os.path.join(tmp, "empty.csv")
    with open(empty, "w") as f:
        f.write("a,b,c,d,y\n")
    expect_exit(csv_ingest(r, tmp, empty, out), EXIT_DATA, "empty.csv")
    check(no_outputs(out), "a failed ingest must publish nothing")
    good = os.path.join(tmp, "good.csv")
    write_csv(good, HEADER, gaussian_rows(np.random.default_rng(5), 20))
    p = csv_ingest(r, tmp, good, "/proc/locus-denied/out.h5", f"--ingest.report={tmp}/r.json")
    expect_exit(p, EXIT_IO, "/proc/locus-denied")


def test_config_errors_name_the_key(r, tmp):
    p = r.run("locus-ingest", "--ingest.outptu=x.h5")
    expect_exit(p, EXIT_CONFIG, "ingest.outptu", "did you mean 'ingest.output'")
    p = r.run("locus-ingest", "--gates.min_rows=lots")
    expect_exit(p, EXIT_CONFIG, "gates.min_rows", "lots")
    p = r.run("locus-ingest", "--ingest.normalize=zscore")
    expect_exit(p, EXIT_CONFIG, "zscore", "standardize")
    p = r.run("locus-ingest", "--gates.psi_bins=1")
    expect_exit(p, EXIT_CONFIG, "gates.psi_bins", "[2, 1000]")
    cfg = os.path.join(tmp, "c.ini")
    with open(cfg, "w") as f:
        f.write("[ingest]\nsource = idx\n[gatez]\nmin_rows = 3\n")
    p = r.run("locus-ingest", f"--config={cfg}")
    expect_exit(p, EXIT_CONFIG, "gatez", "did you mean [gates]")
    p = r.run("locus-ingest", "--help")
    expect_exit(p, 0, "--gates.max_psi", "default: 10")
    p = r.run("locus-ingest", "--print-config", "--ingest.output=zzz.h5")
    expect_exit(p, 0, "output = zzz.h5", "[gates]")
    existing = os.path.join(tmp, "exists.h5")
    open(existing, "w").close()
    p = r.run("locus-ingest", f"--ingest.output={existing}")
    expect_exit(p, EXIT_CONFIG, "--overwrite")


def test_append_equals_full_ingest_and_survives_a_crash(r, tmp):
    rng = np.random.default_rng(6)
    rows = gaussian_rows(rng, 900)
    a, b, full = (os.path.join(tmp, n) for n in ("a.csv", "b.csv", "full.csv"))
    write_csv(a, HEADER, rows[:500])
    write_csv(b, HEADER, rows[500:])
    write_csv(full, HEADER, rows)
    out, ref = os.path.join(tmp, "out.h5"), os.path.join(tmp, "full.h5")
    expect_exit(csv_ingest(r, tmp, full, ref), 0)
    expect_exit(csv_ingest(r, tmp, a, out), 0)
    backup = os.path.join(tmp, "backup.h5")
    shutil.copy(out, backup)
    # Killed between writing the rows and publishing: the original must be untouched.
    p = csv_ingest(r, tmp, b, out, "--append",
                   env={"LOCUS_TEST_HOOK": "ingest-before-commit:kill@0", **DEFAULT_TEARDOWN})
    check(p.returncode != 0, "the killed append must fail", p)
    check(filecmp.cmp(out, backup, shallow=False), "a crashed append changed the dataset")
    x0, _, _ = read_dataset(out)
    check(x0.shape[0] == 500, "committed rows changed after a crash")
    check(lock_is_free(lock_path(out)), "the killed job's lock must have gone with it")
    # The rerun completes; the result equals a full ingest of all rows.
    p = csv_ingest(r, tmp, b, out, "--append")
    expect_exit(p, 0, "appended 400 rows")
    # Its phase line says it writes onto a copy of the dataset (the original is replaced only
    # at the commit).
    check(re.search(rf"^writing: 400 rows x \d+ features \([\d.]+ MiB\) appended to a copy of "
                    rf"{re.escape(out)} \(collective\); the gates passed in [\d.]+ s$",
                    p.stdout, re.M) is not None, "the append's writing line", p)
    x, y, attrs = read_dataset(out)
    xr, yr, ar = read_dataset(ref)
    check(np.array_equal(x, xr) and np.array_equal(y, yr), "append differs from a full ingest")
    check(attrs["count"] == 900, "merged count")
    for k in ("mean", "std", "min", "max"):
        check(np.allclose(attrs[k], ar[k], rtol=1e-9, atol=1e-12), f"merged {k} differs")
    check(np.array_equal(attrs["hist_counts"].sum(), ar["hist_counts"].sum()), "histogram total")


def test_append_to_an_output_another_job_writes_is_refused(r, tmp):
    """While another job holds the output's lock (io::OutputLock), an append is refused before
    it reads the dataset (two appends would each add their rows to the same old dataset, and
    the later publication would drop the earlier one's rows); --validate-only writes nothing
    and still runs."""
    rng = np.random.default_rng(8)
    rows = gaussian_rows(rng, 600)
    a, b = os.path.join(tmp, "a.csv"), os.path.join(tmp, "b.csv")
    write_csv(a, HEADER, rows[:400])
    write_csv(b, HEADER, rows[400:])
    out = os.path.join(tmp, "out.h5")
    expect_exit(csv_ingest(r, tmp, a, out), 0)
    backup = os.path.join(tmp, "backup.h5")
    shutil.copy(out, backup)
    holder = hold_lock_file(lock_path(out))
    try:
        p = csv_ingest(r, tmp, b, out, "--append")
        expect_exit(p, EXIT_CONFIG, f"output '{out}' (ingest.output) is being written by another "
                    "job (holder not recorded)", "Wait until that job ends")
        check(filecmp.cmp(out, backup, shallow=False), "a refused append changed the dataset")
        check(not os.path.exists(os.path.join(tmp, ".out.h5.locus-tmp")),
              "a refused append wrote a temporary file")
        expect_exit(csv_ingest(r, tmp, b, out, "--append", "--validate-only"), 0)
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()
    expect_exit(csv_ingest(r, tmp, b, out, "--append"), 0, "appended 200 rows")
    check(read_dataset(out)[0].shape[0] == 600, "the append after the holder ended")
    check(lock_is_free(lock_path(out)), "the append must release the output lock")


def dataset_bytes(path):
    """Every dataset and attribute of a locus dataset as bytes, but the recorded config."""
    out = {}
    with h5py.File(path, "r") as f:
        for owner, prefix in ((f, "/"), (f["features"], "features"), *(
                ((f["labels"], "labels"),) if "labels" in f else ())):
            for k, v in owner.attrs.items():
                if prefix == "/" and k == "config":
                    continue
                a = np.asarray(v)
                out[f"{prefix}@{k}"] = repr(a.tolist()) if a.dtype == object else (a.dtype.str, a.tobytes())
        for name in f:
            out[name] = f[name][()].tobytes()
    return out


def test_same_bytes_at_any_rank_count_schedule_or_straggler(r, tmp):
    images = f"{FASHION}/t10k-images-idx3-ubyte.gz"
    labels = f"{FASHION}/t10k-labels-idx1-ubyte.gz"

    def ingest(name, *extra, ranks=None, env=None):
        out = os.path.join(tmp, f"{name}.h5")
        p = r.run("locus-ingest", f"--ingest.images={images}", f"--ingest.labels={labels}",
                  f"--ingest.output={out}", "--ingest.unit_bytes=100000", *extra,
                  ranks=ranks, env=env)
        expect_exit(p, 0, "10000 rows x 784 features", "units: 79 of")
        with open(out + ".gates.json") as f:
            return dataset_bytes(out), json.load(f)["schedule"]

    one, _ = ingest("one", ranks=1)
    dyn, sched = ingest("dynamic")
    check(dyn == one, f"{r.ranks} ranks wrote other bytes than 1 rank")
    check(sum(x["won"] for x in sched["per_rank"]) == 79, f"units kept {sched}")
    static, sched = ingest("static", "--ingest.schedule=static")
    check(static == one, "the static split wrote other bytes")
    check(all(x["reruns"] == 0 for x in sched["per_rank"]), f"static re-ran units: {sched}")
    # Rank 1 takes 30 s per unit: its unit is re-run by another rank, which wins. On a loaded
    # machine rank 1 may be descheduled until the others drained every unit; such a run proves
    # nothing, so try again (a few times at most), as test_ingest's SlowRanksUnitIsRerun does.
    for _ in range(4):
        slow, sched = ingest("slow", "--overwrite",
                             env={"LOCUS_TEST_HOOK": "ingest-unit:delay30000@1"})
        if sched["per_rank"][1]["claimed"] > 0:
            break
    check(slow == one, "a run with a slowed rank wrote other bytes")
    ranks = sched["per_rank"]
    check(ranks[1]["claimed"] > 0, f"rank 1 never got a unit in 4 runs: {sched}")
    check(ranks[1]["won"] == 0 and ranks[1]["abandoned"] >= 1 and
          sum(x["rerun_wins"] for x in ranks) >= 1, f"no speculation seen: {sched}")


def test_append_rerun_after_its_publication_adds_nothing(r, tmp):
    """A job killed after its append was published (before it exited) is rerun with the same
    command (a requeued Slurm job, the chaos suite's reruns): the rows must not be added twice.
    Found by tests/chaos (SIGKILL of mpirun at the end of an append: 5000 rows instead of 4000)."""
    rng = np.random.default_rng(8)
    rows = gaussian_rows(rng, 700)
    a, b, full = (os.path.join(tmp, n) for n in ("a.csv", "b.csv", "full.csv"))
    write_csv(a, HEADER, rows[:400])
    write_csv(b, HEADER, rows[400:])
    write_csv(full, HEADER, rows)
    out, ref = os.path.join(tmp, "out.h5"), os.path.join(tmp, "full.h5")
    expect_exit(csv_ingest(r, tmp, full, ref), 0)
    expect_exit(csv_ingest(r, tmp, a, out), 0)
    p = csv_ingest(r, tmp, b, out, "--append",
                   env={"LOCUS_TEST_HOOK": "ingest-after-commit:kill@1", **DEFAULT_TEARDOWN})
    check(p.returncode != 0, "the append killed after its publication must fail", p)
    published = os.path.join(tmp, "published.h5")
    shutil.copy(out, published)
    check(read_dataset(out)[0].shape[0] == 700, "the append was published before the kill")
    p = csv_ingest(r, tmp, b, out, "--append")
    expect_exit(p, 0, "nothing appended", "b.csv", "already the last input")
    check(filecmp.cmp(out, published, shallow=False), "the rerun changed the dataset")
    x, y, _ = read_dataset(out)
    xr, yr, _ = read_dataset(ref)
    check(np.array_equal(x, xr) and np.array_equal(y, yr), "rows differ from a full ingest")
    # Another input (or the same rows under another name) is still appended.
    again = os.path.join(tmp, "b-again.csv")
    shutil.copy(b, again)
    expect_exit(csv_ingest(r, tmp, again, out, "--append"), 0, "appended 300 rows")
    check(read_dataset(out)[0].shape[0] == 1000, "a copy under another name must be appended")


def formats_md_example(tmp):
    """Runs the 'Writing one by hand (h5py)' example of docs/FORMATS.md in tmp."""
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "FORMATS.md")
    text = open(doc).read()
    section = text[text.index("### Writing one by hand"):]
    code = section[section.index("```python") + len("```python"):]
    code = code[:code.index("```")]
    subprocess.run(["/usr/bin/python3", "-c", code], cwd=tmp, check=True)
    return os.path.join(tmp, "mine.h5")


def test_documented_h5py_dataset_is_readable(r, tmp):
    mine = formats_md_example(tmp)
    rng = np.random.default_rng(7)
    csv = os.path.join(tmp, "in.csv")
    write_csv(csv, [f"f{i}" for i in range(8)] + ["y"],
              [[*np.round(rng.random(8), 5), int(rng.integers(0, 3))] for _ in range(1000)])
    out = os.path.join(tmp, "out.h5")
    p = csv_ingest(r, tmp, csv, out, f"--gates.reference={mine}", "--gates.rows_within_pct=5",
                   "--gates.max_mean_shift=0.5", "--gates.max_psi=0.5")
    expect_exit(p, 0, "reference")
    p = csv_ingest(r, tmp, csv, mine, "--append")
    expect_exit(p, EXIT_DATA, "allocates chunks lazily", "mine.h5")


PROGRESS = re.compile(r"^parsing: (?P<won>\d+) of (\d+) units, (\d+) rows \((\d+)% of the units\) "
                      r"in (?P<secs>[\d.]+) s, \d+ rows/s(?:, \d+ re-runs?)?"
                      r"(?:; about [\d.]+ (?:s|min|h) left|; no unit finished yet)?$")


def phase_lines(p):
    """The phase lines of an ingest's stdout (all after its last progress line)."""
    lines = p.stdout.splitlines()
    found = [i for i, l in enumerate(lines) if l.startswith(("gates:", "writing:", "committing:"))]
    last_progress = max((i for i, l in enumerate(lines) if l.startswith("parsing:")), default=-1)
    check(all(i > last_progress for i in found), "a phase line before the last parsing line", p)
    return [lines[i] for i in found]


def each_matches(lines, patterns):
    """Whether there are as many lines as patterns and each line fully matches its own."""
    return len(lines) == len(patterns) and all(
        re.fullmatch(pat, line) for line, pat in zip(lines, patterns))


def phases_of(values):
    """The phases a Prometheus file's state set says the job is in (or ended in)."""
    return {k.split('"')[1] for k, v in values.items()
            if k.startswith("locus_ingest_phase{") and v == 1}


def test_progress_lines_while_parsing(r, tmp):
    """ingest.progress_s: rank 0 alone prints, once an interval, how many units and rows are
    parsed; the counts only grow and rows are always whole units' rows; then a line as each
    later phase begins (gates, write, commit), which ingest.prometheus names too. 0 turns the
    lines off."""
    out = os.path.join(tmp, "t.h5")
    args = (f"--ingest.images={FASHION}/t10k-images-idx3-ubyte.gz",
            f"--ingest.labels={FASHION}/t10k-labels-idx1-ubyte.gz", f"--ingest.output={out}",
            f"--ingest.unit_bytes={784 * 500}")  # 20 units of 500 records
    # Every rank waits 150 ms x ranks per unit: about 3 s at any rank count.
    prom = os.path.join(tmp, "ingest.prom")
    p = r.run("locus-ingest", *args, "--ingest.progress_s=0.3", f"--ingest.prometheus={prom}",
              env={"LOCUS_TEST_HOOK": f"ingest-unit:delay{150 * r.ranks}"})
    expect_exit(p, 0, "ingested 10000 rows")
    for m in progress_lines(p, "parsing:", PROGRESS, 0.3):
        won, units, rows, pct = (int(m[i]) for i in range(1, 5))
        check(units == 20 and whole_units(rows, won, 500, r.ranks),
              f"rows are whole units' rows: {m[0]!r}", p)
        check(pct == round(100 * won / units), f"share: {m[0]!r}", p)
    # After the parse, a line as each phase begins, once (rank 0 alone), in order.
    check(each_matches(phase_lines(p), [
        r"gates: 10000 rows parsed in [\d.]+ s; checking them against the quality gates",
        rf"writing: 10000 rows x 784 features \(29\.9 MiB\) into {re.escape(out)} \(collective\); "
        r"the gates passed in [\d.]+ s",
        rf"committing: {re.escape(out)} written in [\d.]+ s; making it durable and publishing it"]),
        "the phase lines", p)
    # ingest.prometheus: its last version says the job stopped with every unit and row parsed
    # (the rows to do are not known ahead: no locus_ingest_rows), in its last phase.
    with open(prom) as f:
        v = prometheus_values(f.read(), "ingest")
    check(v["locus_ingest_running"] == 0 and v["locus_ingest_units"] == 20 and
          v["locus_ingest_units_done"] == 20 and v["locus_ingest_rows_done"] == 10000 and
          "locus_ingest_rows" not in v and phases_of(v) == {"commit"}, f"ingest.prom: {v}", p)
    # A gate that fails: the job ends in the gates phase, with no write line.
    p = r.run("locus-ingest", *args, "--gates.max_rows=5000", "--ingest.progress_s=0.3",
              f"--ingest.prometheus={prom}", "--overwrite")
    expect_exit(p, EXIT_GATE, "max_rows")
    with open(prom) as f:
        v = prometheus_values(f.read(), "ingest")
    check(v["locus_ingest_running"] == 0 and phases_of(v) == {"gates"} and
          v["locus_ingest_units_done"] == 20 and len(phase_lines(p)) == 1,
          f"a failed gate: {v}", p)
    # The file is written before anything else: naming an input is a configuration error, and
    # the input is left as it was.
    labels = os.path.join(tmp, "labels.gz")
    shutil.copy(f"{FASHION}/t10k-labels-idx1-ubyte.gz", labels)
    own = [a for a in args if not a.startswith("--ingest.labels=")]
    p = r.run("locus-ingest", *own, f"--ingest.labels={labels}", "--overwrite",
              f"--ingest.prometheus={labels}")
    expect_exit(p, 2, f"ingest.prometheus = '{labels}' and ingest.labels = '{labels}' name one "
                "file")
    check(filecmp.cmp(labels, f"{FASHION}/t10k-labels-idx1-ubyte.gz", shallow=False),
          "a refused job overwrote its labels", p)
    p = r.run("locus-ingest", *args, "--ingest.progress_s=0", "--overwrite",
              env={"LOCUS_TEST_HOOK": "ingest-unit:delay20"})
    expect_exit(p, 0)
    check("parsing:" not in p.stdout and not phase_lines(p),
          "ingest.progress_s = 0 printed a progress line", p)

if __name__ == "__main__":
    main([test_fashion_mnist_train_and_test, test_csv_matches_serial_parse,
          test_every_gate_fires_and_publishes_nothing, test_nonfinite_drop_counts,
          test_bad_inputs_give_clear_errors_and_no_output,
          test_append_equals_full_ingest_and_survives_a_crash,
          test_same_bytes_at_any_rank_count_schedule_or_straggler,
          test_append_rerun_after_its_publication_adds_nothing,
          test_documented_h5py_dataset_is_readable, test_progress_lines_while_parsing],
         once=[test_validate_only_writes_report_only, test_config_errors_name_the_key,
               test_append_to_an_output_another_job_writes_is_refused])
