"""The bad-input catalogue, extended (docs/RELIABILITY.md, "Bad-input catalogue"): HDF5 inputs
that are valid files but wrong, for locus-train and locus-infer; damaged model files and
checkpoints for locus-ckpt verify and locus-infer; config files that are missing or directories
and required paths left empty. Each row: the documented exit code on every rank, a message
naming the file / dataset / tensor / key, and nothing published. (Every key's wrong type, empty
value, range, duplicates and unknown sections: test_config_errors.cpp.)"""
import glob
import os
import shutil
import zlib

import h5py
import numpy as np

from apphelpers import check, expect_exit, main

os.environ.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "0")  # see test_infer_app.py

EXIT_CONFIG, EXIT_DATA = 2, 3
CONFIG = os.path.join(os.environ.get("LOCUS_SOURCE_DIR",
                                     os.path.join(os.path.dirname(__file__), "..", "..")),
                      "configs", "tiny.ini")
ROWS, COLS = 300, 12


def write_model(path, widths=(COLS, 32, 16, 4)):
    rng = np.random.default_rng(0)
    with h5py.File(path, "w") as f:
        for i in range(len(widths) - 1):
            f[f"layers.{i}.weight"] = rng.standard_normal((widths[i + 1], widths[i])).astype(np.float32)
            f[f"layers.{i}.bias"] = np.zeros(widths[i + 1], np.float32)
        f.attrs["locus_format"] = "locus-model"
        f.attrs["schema_version"] = 1
        f.attrs["widths"] = np.array(widths, dtype=np.int64)
        f.attrs["activation"] = "relu"
        f.attrs["loss"] = "cross_entropy"
    return path


def plain_file(path, x, y=None, **kw):
    """An input written by another tool (h5py): no locus attributes at all."""
    with h5py.File(path, "w") as f:
        f.create_dataset("features", data=x, **kw)
        if y is not None:
            f["labels"] = y
    return path


def data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, COLS)).astype(np.float32)
    y = rng.integers(0, 4, ROWS).astype(np.int32)
    x[np.arange(ROWS), y] += 3.0  # learnable
    return x, y


def train(r, tmp, path, *args):
    return r.run("locus-train", "--config", CONFIG, f"--data.train={path}", "--data.test=",
                 "--train.epochs=2", "--optim.warmup_steps=0", "--train.output=model.h5",
                 "--train.metrics=metrics.jsonl", *args, cwd=tmp)


def infer(r, tmp, path, *args, model="m.h5"):
    return r.run("locus-infer", "--config", CONFIG, f"--infer.model={model}",
                 f"--infer.input={path}", "--infer.output=scores.h5", *args, cwd=tmp)


def nothing_published(tmp, p):
    for name in ("model.h5", "metrics.jsonl", "scores.h5"):
        check(not os.path.exists(os.path.join(tmp, name)), f"{name} was published", p)


def refused_by_both(r, tmp, path, *needles):
    """locus-train and locus-infer both exit 3 naming the file and the needles."""
    for p in (train(r, tmp, path), infer(r, tmp, path)):
        expect_exit(p, EXIT_DATA, os.path.basename(path), *needles)
        nothing_published(tmp, p)


# --- HDF5 inputs: valid files, wrong contents ---------------------------------------------------

def test_features_of_integer_type(r, tmp):
    write_model(os.path.join(tmp, "m.h5"))
    x, y = data()
    refused_by_both(r, tmp, plain_file(os.path.join(tmp, "i64.h5"), x.astype(np.int64), y),
                    "/features", "int64 [300, 12]")


def test_features_of_float64_are_read_as_float32(r, tmp):
    """Documented (docs/FORMATS.md, "Inputs from other tools"): float64 features are converted on
    read; the scores equal those of the float32 file."""
    write_model(os.path.join(tmp, "m.h5"))
    x, y = data()
    plain_file(os.path.join(tmp, "f32.h5"), x, y)
    plain_file(os.path.join(tmp, "f64.h5"), x.astype(np.float64), y)
    expect_exit(train(r, tmp, "f64.h5"), 0)
    expect_exit(infer(r, tmp, "f64.h5"), 0)
    with h5py.File(os.path.join(tmp, "scores.h5")) as f:
        s64 = f["scores"][()]
    expect_exit(infer(r, tmp, "f32.h5", "--overwrite"), 0)
    with h5py.File(os.path.join(tmp, "scores.h5")) as f:
        check(np.array_equal(f["scores"][()], s64), "float64 input scored otherwise than float32")


def test_features_of_rank_1_and_3(r, tmp):
    write_model(os.path.join(tmp, "m.h5"))
    x, y = data()
    refused_by_both(r, tmp, plain_file(os.path.join(tmp, "r1.h5"), x.ravel(), y), "/features",
                    "[3600]")
    refused_by_both(r, tmp, plain_file(os.path.join(tmp, "r3.h5"), x.reshape(ROWS, 3, 4), y),
                    "/features", "3 dimensions")


def test_zero_rows(r, tmp):
    write_model(os.path.join(tmp, "m.h5"))
    path = plain_file(os.path.join(tmp, "zero.h5"), np.zeros((0, COLS), np.float32),
                      np.zeros(0, np.int32))
    refused_by_both(r, tmp, path, "no rows", "/features")


def test_declared_rows_far_beyond_the_file(r, tmp):
    """A dataset declared with 10^8 rows of which 300 were written (chunked: 1 chunk of 97657;
    contiguous: no storage at all): the rest would read as zeros. Refused, not trained on."""
    write_model(os.path.join(tmp, "m.h5"))
    x, y = data()
    with h5py.File(os.path.join(tmp, "chunked.h5"), "w") as f:
        d = f.create_dataset("features", shape=(10**8, COLS), dtype=np.float32, chunks=(1024, COLS))
        d[:ROWS] = x
    refused_by_both(r, tmp, os.path.join(tmp, "chunked.h5"), "declares 100000000 rows",
                    "1 of the 97657 chunks")
    with h5py.File(os.path.join(tmp, "contiguous.h5"), "w") as f:
        f.create_dataset("features", shape=(10**8, COLS), dtype=np.float32)
    refused_by_both(r, tmp, os.path.join(tmp, "contiguous.h5"), "declares 100000000 rows",
                    "0 of the 4800000000 bytes")


def test_labels_longer_or_shorter_than_features(r, tmp):
    write_model(os.path.join(tmp, "m.h5"))
    x, y = data()
    refused_by_both(r, tmp, plain_file(os.path.join(tmp, "long.h5"), x, np.concatenate([y, y])),
                    "/labels", "600")
    refused_by_both(r, tmp, plain_file(os.path.join(tmp, "short.h5"), x, y[:100]), "/labels",
                    "100")


def test_file_written_by_another_tool_is_accepted(r, tmp):
    """Documented: any HDF5 file with float [N, D] /features (and optionally int [N] /labels),
    without locus attributes, is read by locus-train and locus-infer; the row count is the
    extent."""
    write_model(os.path.join(tmp, "m.h5"))
    x, y = data()
    plain_file(os.path.join(tmp, "plain.h5"), x, y)
    p = train(r, tmp, "plain.h5")
    expect_exit(p, 0, "model written to model.h5")
    p = infer(r, tmp, "plain.h5", model="model.h5")
    expect_exit(p, 0, "over 300 labelled rows")


# --- damaged model files and checkpoints ----------------------------------------------------

def checkpoint(r, tmp):
    x, y = data()
    plain_file(os.path.join(tmp, "plain.h5"), x, y)
    expect_exit(train(r, tmp, "plain.h5", "--checkpoint.dir=ck", "--train.output=",
                      "--train.metrics="), 0)
    os.remove(os.path.join(tmp, "plain.h5"))
    src = sorted(glob.glob(os.path.join(tmp, "ck", "ckpt-*.h5")))[-1]
    # Trained on a file without num_classes: the digest once covered 0 where /model records
    # the output width, so no such checkpoint verified (or resumed).
    expect_exit(r.run("locus-ckpt", "verify", src, cwd=tmp), 0, "ok")
    return src


def damaged(src, name, edit):
    dst = os.path.join(os.path.dirname(os.path.dirname(src)), name)
    shutil.copy(src, dst)
    with h5py.File(dst, "a") as f:
        edit(f)
    return dst


def set_tensor(ds, value, index):
    """Writes value at index and recomputes the tensor's CRC: a digest that matches (as written
    by a run that diverged), so only the values give it away."""
    a = ds[()]
    a[index] = value
    ds[...] = a
    if "crc32" in ds.attrs:
        ds.attrs["crc32"] = np.int64(zlib.crc32(a.astype("<f4").tobytes()))


def verify_and_infer_refuse(r, tmp, path, *needles):
    p = r.run("locus-ckpt", "verify", path, cwd=tmp)
    expect_exit(p, EXIT_DATA, os.path.basename(path), *needles)
    x, y = data(1)
    plain_file(os.path.join(tmp, "in.h5"), x, y)
    p = infer(r, tmp, "in.h5", model=path)
    expect_exit(p, EXIT_DATA, os.path.basename(path), *needles)
    nothing_published(tmp, p)


def test_checkpoint_with_nan_or_inf_weights(r, tmp):
    src = checkpoint(r, tmp)
    nan = damaged(src, "nan.h5", lambda f: set_tensor(f["model/layers.1.weight"], np.nan, (3, 4)))
    verify_and_infer_refuse(r, tmp, nan, "layers.1.weight")
    inf = damaged(src, "inf.h5", lambda f: set_tensor(f["model/layers.2.bias"], np.inf, 1))
    verify_and_infer_refuse(r, tmp, inf, "layers.2.bias")
    # A model file, too (infer; locus-ckpt verify is for checkpoints).
    m = write_model(os.path.join(tmp, "minf.h5"))
    with h5py.File(m, "a") as f:
        set_tensor(f["layers.0.bias"], -np.inf, 2)
    p = infer(r, tmp, "in.h5", model="minf.h5")
    expect_exit(p, EXIT_DATA, "minf.h5", "layers.0.bias", "inf")


def test_checkpoint_with_a_tensor_of_the_wrong_shape(r, tmp):
    src = checkpoint(r, tmp)

    def reshape(f):
        del f["model/layers.0.weight"]
        f["model/layers.0.weight"] = np.zeros((32, 11), np.float32)
        f["model/layers.0.weight"].attrs["crc32"] = np.int64(zlib.crc32(np.zeros((32, 11), "<f4").tobytes()))
    verify_and_infer_refuse(r, tmp, damaged(src, "shape.h5", reshape), "layers.0.weight",
                            "[32, 11]", "[32, 12]")


def test_checkpoint_of_another_schema_version(r, tmp):
    src = checkpoint(r, tmp)
    newer = damaged(src, "newer.h5", lambda f: f.attrs.__setitem__("format_version", 2))
    verify_and_infer_refuse(r, tmp, newer, "format_version 2")
    model_newer = damaged(src, "mnewer.h5",
                          lambda f: f["model"].attrs.__setitem__("schema_version", 2))
    verify_and_infer_refuse(r, tmp, model_newer, "schema_version 2")


def test_truncated_checkpoint(r, tmp):
    src = checkpoint(r, tmp)
    blob = open(src, "rb").read()
    cut = os.path.join(tmp, "cut.h5")
    open(cut, "wb").write(blob[: len(blob) * 2 // 3])
    verify_and_infer_refuse(r, tmp, cut, "truncated")


# --- config files and required keys ---------------------------------------------------------------

def test_config_file_missing_or_a_directory(r, tmp):
    os.mkdir(os.path.join(tmp, "conf.d"))
    for app in ("locus-ingest", "locus-train", "locus-infer"):
        p = r.run(app, "--config", "nope.ini", cwd=tmp)
        expect_exit(p, EXIT_CONFIG, "nope.ini", "--config")
        p = r.run(app, "--config", "conf.d", cwd=tmp)
        expect_exit(p, EXIT_CONFIG, "conf.d", "is a directory")


def test_required_paths_left_empty(r, tmp):
    write_model(os.path.join(tmp, "m.h5"))
    x, y = data()
    plain_file(os.path.join(tmp, "plain.h5"), x, y)
    for key in ("infer.model", "infer.input", "infer.output", "infer.features"):
        p = infer(r, tmp, "plain.h5", f"--{key}=")
        expect_exit(p, EXIT_CONFIG, key, "empty")
    p = train(r, tmp, "")
    expect_exit(p, EXIT_CONFIG, "data.train", "empty")
    p = train(r, tmp, "plain.h5", "--model.widths=")
    expect_exit(p, EXIT_CONFIG, "model.widths")
    p = r.run("locus-ingest", "--config", CONFIG, "--ingest.output=", cwd=tmp)
    expect_exit(p, EXIT_CONFIG, "ingest.output", "empty")
    p = r.run("locus-ingest", "--config", CONFIG, "--ingest.csv=", "--ingest.output=o.h5", cwd=tmp)
    expect_exit(p, EXIT_CONFIG, "ingest.csv", "needs ingest.csv")
    nothing_published(tmp, p)
    check(not os.path.exists(os.path.join(tmp, "o.h5")), "a dataset was published")


if __name__ == "__main__":
    main([], once=[test_features_of_integer_type, test_features_of_float64_are_read_as_float32,
                   test_features_of_rank_1_and_3, test_zero_rows,
                   test_declared_rows_far_beyond_the_file,
                   test_labels_longer_or_shorter_than_features,
                   test_file_written_by_another_tool_is_accepted,
                   test_checkpoint_with_nan_or_inf_weights,
                   test_checkpoint_with_a_tensor_of_the_wrong_shape,
                   test_checkpoint_of_another_schema_version, test_truncated_checkpoint,
                   test_config_file_missing_or_a_directory, test_required_paths_left_empty])
