"""End-to-end tests of locus-ingest's ingest.join under mpiexec: the joined dataset is the same
bytes at 1 rank and N ranks and equals a join done here in plain Python; join_missing = fail
(exit 4, nothing published, the count in the JSON report) and drop (rows left out, counted);
every bad join table or option a clear error with its exit code and no output."""
import json
import os
import zlib

import h5py
import numpy as np

from apphelpers import check, expect_exit, main, no_outputs
from test_ingest_app import dataset_bytes

# Failed runs on purpose: do not wait for Open MPI's kill timeout (see test_infer_app.py).
os.environ.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "0")

EXIT_CONFIG, EXIT_DATA, EXIT_GATE = 2, 3, 4


def write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


def make_tables(tmp, rows=3000, missing_every=0):
    """in.csv (a, key, b, y) and dim.csv (key, u, v, w); keys are text: "7" and "007" differ.
    Returns the paths and the reference join (features a, b, w, u; rows with a missing key
    left out) and the number of such rows."""
    rng = np.random.default_rng(17)
    keys = [f"{k:03d}" if k % 3 == 0 else str(k) for k in range(150)]
    # Dyadic values: exact in float32, so the reference needs no rounding of its own.
    dim = {k: rng.integers(-4000, 4000, size=3) / 64 for k in keys}
    dim_lines = ["key,u,v,w"] + [f"{k},{d[0]},{d[1]},{d[2]}" for k, d in dim.items()]
    big_lines, x, y, missing = ["a,key,b,y"], [], [], 0
    for i in range(rows):
        a, b = int(rng.integers(-9000, 9000)) / 128, int(rng.integers(0, 256)) / 256
        key = keys[int(rng.integers(0, len(keys)))]
        if missing_every and i % missing_every == 7:
            key = key + ".0"  # a number equal to a key, but not the same text
        big_lines.append(f"{a},{key},{b},{i % 4}")
        if key not in dim:
            missing += 1
            continue
        x.append([a, b, dim[key][2], dim[key][0]])
        y.append(i % 4)
    big, dimf = os.path.join(tmp, "in.csv"), os.path.join(tmp, "dim.csv")
    write_text(big, "\n".join(big_lines) + "\n")
    write_text(dimf, "\n".join(dim_lines) + "\n")
    return big, dimf, np.array(x, dtype=np.float32), np.array(y, dtype=np.int32), missing


def join_ingest(r, csv, dim, out, *extra, ranks=None, env=None):
    return r.run("locus-ingest", "--ingest.source=csv", f"--ingest.csv={csv}",
                 "--ingest.csv_label=y", "--ingest.normalize=none", "--ingest.num_classes=0",
                 "--gates.features=0", "--gates.min_rows=0", f"--ingest.output={out}",
                 f"--ingest.join={dim}", "--ingest.join_key=key", "--ingest.join_columns=w,u",
                 "--ingest.unit_bytes=4096", *extra, ranks=ranks, env=env)


def test_joined_bytes_match_one_rank_and_a_join_by_hand(r, tmp):
    csv, dim, x, y, _ = make_tables(tmp)
    one, many = os.path.join(tmp, "one.h5"), os.path.join(tmp, "many.h5")
    expect_exit(join_ingest(r, csv, dim, one, ranks=1), 0, "3000 rows x 4 features")
    p = join_ingest(r, csv, dim, many)
    expect_exit(p, 0, "3000 rows x 4 features", "rows whose key it lacks: 0")
    check(dataset_bytes(many) == dataset_bytes(one),
          f"{r.ranks} ranks wrote other bytes than 1 rank (features, labels or attributes)")
    with h5py.File(many, "r") as f:
        n = int(f.attrs["committed_rows"])
        check(np.array_equal(f["features"][:n], x), "joined features differ from the reference")
        check(np.array_equal(f["labels"][:n], y), "labels differ from the reference")
        names = [s.decode() if isinstance(s, bytes) else s for s in f["features"].attrs["feature_names"]]
        check(names == ["a", "b", "w", "u"], f"feature names {names}")
        sources = [s.decode() if isinstance(s, bytes) else s for s in f.attrs["source_files"]]
        check(sources == [csv, dim], f"sources {sources}")
        with open(dim, "rb") as d:
            check(int(f.attrs["source_crc32"][1]) == zlib.crc32(d.read()), "join table CRC-32")


def test_join_missing_fails_the_gate_or_drops_and_counts(r, tmp):
    csv, dim, x, y, missing = make_tables(tmp, missing_every=97)
    check(missing == 31, f"fixture: {missing} missing keys")
    out, report = os.path.join(tmp, "fail.h5"), os.path.join(tmp, "fail.json")
    p = join_ingest(r, csv, dim, out, f"--ingest.report={report}")
    expect_exit(p, EXIT_GATE, "gate 'join_missing' failed: 31 rows of", "line 9: key '",
                "gates.join_missing = drop")
    check(no_outputs(out), "a failed join_missing gate published the dataset")
    with open(report) as f:
        rep = json.load(f)
    check(rep["join_missing_rows"] == 31 and "join_missing" in rep["failed"], f"report {rep}")

    out, report = os.path.join(tmp, "drop.h5"), os.path.join(tmp, "drop.json")
    p = join_ingest(r, csv, dim, out, "--gates.join_missing=drop", f"--ingest.report={report}")
    expect_exit(p, 0, f"{3000 - missing} rows x 4 features", "rows whose key it lacks: 31")
    with open(report) as f:
        rep = json.load(f)
    check(rep["passed"] and rep["join_missing_rows"] == 31 and rep["rows"] == 3000 - missing,
          f"report {rep}")
    with h5py.File(out, "r") as f:
        n = int(f.attrs["committed_rows"])
        check(np.array_equal(f["features"][:n], x) and np.array_equal(f["labels"][:n], y),
              "rows after dropped ones out of place")


def test_bad_join_tables_and_options_are_clear_errors(r, tmp):
    csv, dim, _, _, _ = make_tables(tmp, rows=200)
    out = os.path.join(tmp, "out.h5")

    def bad(name, text, code, *needles, extra=()):
        path = os.path.join(tmp, name)
        write_text(path, text)
        expect_exit(join_ingest(r, csv, path, out, *extra), code, *needles)
        check(no_outputs(out), f"{name}: a failed ingest published output")

    bad("dup.csv", "key,u,v,w\n1,1,1,1\n2,2,2,2\n1,3,3,3\n", EXIT_DATA, "dup.csv' line 4",
        "key '1'", "first on line 2")
    bad("nokey.csv", "id,u,v,w\n1,1,1,1\n", EXIT_DATA, "nokey.csv' has no column 'key'",
        "join_key")
    bad("nocol.csv", "key,u,v\n1,1,1\n", EXIT_DATA, "nocol.csv' has no column 'w'", "join_columns")
    bad("text.csv", "key,u,v,w\n1,1,1,1\n2,2,2,lion\n", EXIT_DATA, "text.csv' line 3",
        "join column 'w'", "'lion'")
    big = "key,u,v,w\n" + "".join(f"k{i},{i},{i},{i}\n" for i in range(60000))
    bad("large.csv", big, EXIT_CONFIG, "large.csv' is 1.4 MiB", "ingest.join_max_mb = 1",
        extra=("--ingest.join_max_mb=1",))
    write_text(os.path.join(tmp, "in2.csv"), "a,b,y\n1,2,0\n")
    p = join_ingest(r, os.path.join(tmp, "in2.csv"), dim, out)
    expect_exit(p, EXIT_DATA, "in2.csv' has no column 'key'", "join_key")
    p = r.run("locus-ingest", "--ingest.source=csv", f"--ingest.csv={csv}",
              f"--ingest.output={out}", "--ingest.join_key=key")
    expect_exit(p, EXIT_CONFIG, "ingest.join_key and ingest.join_columns need ingest.join")
    p = join_ingest(r, csv, dim, out, "--ingest.join_max_mb=0")
    expect_exit(p, EXIT_CONFIG, "ingest.join_max_mb")
    check(no_outputs(out), "a failed ingest published output")


if __name__ == "__main__":
    main([test_joined_bytes_match_one_rank_and_a_join_by_hand,
          test_join_missing_fails_the_gate_or_drops_and_counts],
         once=[test_bad_join_tables_and_options_are_clear_errors])
