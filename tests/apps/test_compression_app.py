"""ingest.compression end to end under mpiexec: Fashion-MNIST ingested with deflate reads back
through h5py bitwise equal to the uncompressed ingest (at 1 rank and N ranks), with the shuffle
and deflate filters at the level asked, in a smaller file; training (out of core: per-batch
scattered reads and streamed windows of compressed chunks) and inference from the compressed
dataset give bitwise the model and predictions they give from the uncompressed one; an h5py
gzip dataset is refused by --append (exit 3); bad values exit 2 naming the key and publish nothing."""
import gzip
import os

# Failed runs on purpose: do not wait for Open MPI's kill timeout (see test_infer_app.py).
os.environ.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "0")

import h5py
import numpy as np

from apphelpers import FASHION, check, expect_exit, main, no_outputs, read_dataset

EXIT_CONFIG = 2
ROWS = 3000  # the first records of Fashion-MNIST t10k: seconds per run, still 9.4 MB of values


def small_fashion(tmp):
    """The first ROWS records of Fashion-MNIST t10k as a gzip IDX pair in tmp."""
    paths = []
    for kind, record in (("images", 784), ("labels", 1)):
        with gzip.open(f"{FASHION}/t10k-{kind}-idx{3 if record > 1 else 1}-ubyte.gz", "rb") as f:
            raw = f.read()
        header = 4 + 4 * raw[3]
        out = bytearray(raw[:header])
        out[4:8] = ROWS.to_bytes(4, "big")
        out += raw[header:header + ROWS * record]
        paths.append(os.path.join(tmp, f"{kind}.gz"))
        with gzip.open(paths[-1], "wb") as f:
            f.write(bytes(out))
    return paths


def ingest(r, out, *extra, ranks=None):
    tmp = os.path.dirname(out)
    images, labels = os.path.join(tmp, "images.gz"), os.path.join(tmp, "labels.gz")
    if not os.path.exists(images):
        small_fashion(tmp)
    return r.run("locus-ingest", f"--ingest.images={images}", f"--ingest.labels={labels}",
                 f"--ingest.output={out}", *extra, ranks=ranks)


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        a.view(np.uint8), b.view(np.uint8))


def pair(r, tmp):
    """The t10k split ingested uncompressed and with deflate:6 at this suite's rank count."""
    plain, packed = os.path.join(tmp, "plain.h5"), os.path.join(tmp, "packed.h5")
    expect_exit(ingest(r, plain), 0, "compression none")
    expect_exit(ingest(r, packed, "--ingest.compression=deflate:6"), 0, "compression deflate:6")
    return plain, packed


def test_h5py_reads_the_same_values_from_a_smaller_file(r, tmp):
    plain, packed = pair(r, tmp)
    one = os.path.join(tmp, "one.h5")
    expect_exit(ingest(r, one, "--ingest.compression=deflate:6", ranks=1), 0)
    x, y, attrs = read_dataset(plain)
    for path in (packed, one):
        xc, yc, ac = read_dataset(path)
        check(same_bits(xc, x) and same_bits(yc, y), f"{path}: values differ from uncompressed")
        for k, v in attrs.items():
            check(np.array_equal(ac[k], v), f"{path}: attribute {k} differs")
        with h5py.File(path, "r") as f, h5py.File(plain, "r") as g:
            check(np.array_equal(f.attrs["source_crc32"], g.attrs["source_crc32"]), "source_crc32")
            for name in ("features", "labels"):
                d = f[name]
                check(d.compression == "gzip" and d.compression_opts == 6 and d.shuffle,
                      f"{name}: filters {d.compression} {d.compression_opts} shuffle {d.shuffle}")
                check(g[name].compression is None, f"uncompressed {name} has a filter")
            check(f["features"].chunks[1] == 784, "a chunk must span whole rows")
    size_plain, size_packed = os.path.getsize(plain), os.path.getsize(packed)
    check(size_packed * 3 < size_plain * 2,
          f"compressed file {size_packed} bytes, uncompressed {size_plain}")


def train(r, tmp, data, name, shuffle):
    p = r.run("locus-train", f"--data.train={data}", f"--data.test={data}",
              "--model.widths=784,32,10", "--train.epochs=1", "--train.max_steps=24",
              "--train.batch=64", "--optim.warmup_steps=4", f"--loader.shuffle={shuffle}",
              "--loader.memory_budget_mb=1", "--eval.batch=1000", f"--train.output={name}",
              "--train.metrics=", "--train.log_every=1000", cwd=tmp)
    expect_exit(p, 0, f"model written to {name}")
    with h5py.File(os.path.join(tmp, name), "r") as f:
        return {k: f[k][()] for k in f.keys()}


def test_training_and_inference_are_bitwise_the_same(r, tmp):
    plain, packed = pair(r, tmp)
    # 1 MiB of samples per rank: global shuffle reads each batch's scattered rows from the file,
    # local streams windows; either way every compressed chunk touched is decompressed.
    for shuffle in ("global", "local"):
        a = train(r, tmp, plain, f"plain-{shuffle}.h5", shuffle)
        b = train(r, tmp, packed, f"packed-{shuffle}.h5", shuffle)
        for k in a:
            check(same_bits(a[k], b[k]), f"{k} differs when trained from the compressed file "
                                         f"(shuffle {shuffle})")
    model = os.path.join(tmp, "plain-global.h5")
    outs = []
    for data in (plain, packed):
        out = os.path.join(tmp, "pred-" + os.path.basename(data))
        # The same units: by default they follow the chunks (83 rows compressed, 334 not), and
        # the batch boundaries change the last bits of the scores (BLAS blocking), not the file.
        p = r.run("locus-infer", f"--infer.model={model}", f"--infer.input={data}",
                  f"--infer.output={out}", "--infer.unit_rows=1000")
        expect_exit(p, 0)
        with h5py.File(out, "r") as f:
            outs.append({k: f[k][()] for k in ("scores", "predicted") if k in f})
    check(outs[0].keys() == outs[1].keys() and len(outs[0]) > 0, "prediction datasets")
    for k in outs[0]:
        check(same_bits(outs[0][k], outs[1][k]), f"predictions '{k}' differ")


def test_append_to_an_h5py_gzip_dataset_is_refused(r, tmp):
    """The docs/FORMATS.md hand-written layout, compressed by h5py (chunks allocated lazily and
    filled): refused with exit 3, the file untouched (appending hung with HDF5 1.10.8)."""
    rng = np.random.default_rng(3)
    x = rng.random((500, 8)).astype(np.float32)
    y = rng.integers(0, 3, 500).astype(np.int32)
    mine = os.path.join(tmp, "mine.h5")
    with h5py.File(mine, "w") as f:
        f.create_dataset("features", data=x, maxshape=(None, 8), chunks=(64, 8),
                         compression="gzip", compression_opts=2, shuffle=True)
        f.create_dataset("labels", data=y, maxshape=(None,), chunks=(64,), compression="gzip",
                         compression_opts=2, shuffle=True)
        a = f.attrs
        a["locus_format"] = "locus-dataset"; a["schema_version"] = 1
        a["committed_rows"] = 500; a["num_classes"] = 3; a["label_name"] = "y"
        a["tool_version"] = "h5py"; a["git_revision"] = ""; a["config"] = ""
        a["source_files"] = ["made.by.hand"]; a["source_bytes"] = [0]; a["source_crc32"] = [0]
        a = f["features"].attrs
        x64 = x.astype(np.float64)
        a["feature_names"] = [f"f{i}" for i in range(8)]
        a["count"] = 500; a["mean"] = x64.mean(0); a["std"] = x64.std(0)
        a["min"] = x64.min(0); a["max"] = x64.max(0)
        a["m2"] = ((x64 - x64.mean(0)) ** 2).sum(0)
        a["hist_bins"] = 10; a["hist_lo"] = x64.min(0); a["hist_hi"] = x64.max(0)
        a["hist_counts"] = np.zeros(80, np.int64)
        a["normalization"] = "none"; a["norm_offset"] = np.zeros(8); a["norm_scale"] = np.ones(8)
    more = rng.integers(0, 4000, (300, 8)) / 8.0  # exact in decimal and in float32
    csv = os.path.join(tmp, "more.csv")
    with open(csv, "w") as f:
        f.write(",".join(f"f{i}" for i in range(8)) + ",y\n")
        for i, row in enumerate(more):
            f.write(",".join(f"{v}" for v in row) + f",{i % 3}\n")
    before = open(mine, "rb").read()
    p = r.run("locus-ingest", "--ingest.source=csv", f"--ingest.csv={csv}", "--ingest.csv_label=y",
              "--ingest.normalize=none", "--ingest.num_classes=3", "--gates.features=8",
              "--gates.min_rows=0", f"--ingest.output={mine}", "--append")
    expect_exit(p, 3, "allocates chunks lazily", "mine.h5")
    check(open(mine, "rb").read() == before, "a refused append changed the file")


def test_bad_values_exit_2_and_publish_nothing(r, tmp):
    out = os.path.join(tmp, "out.h5")
    for bad in ("deflate:10", "gzip", "deflate:x"):
        p = ingest(r, out, f"--ingest.compression={bad}")
        expect_exit(p, EXIT_CONFIG, "ingest.compression", f"'{bad}'",
                    "none, deflate or deflate:1 ... deflate:9")
        check(no_outputs(out) and not os.path.exists(out + ".gates.json"),
              f"'{bad}' left an output behind", p)


if __name__ == "__main__":
    main([test_h5py_reads_the_same_values_from_a_smaller_file,
          test_training_and_inference_are_bitwise_the_same,
          test_append_to_an_h5py_gzip_dataset_is_refused],
         once=[test_bad_values_exit_2_and_publish_nothing])
