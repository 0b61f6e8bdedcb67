#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz/corpus/<target>/ (small, real-looking inputs in each
target's input format; see the comment at the top of each fuzz_<target>.cpp). Re-run after
changing a format; the files are committed, so the fuzzers need no Python."""
import gzip
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def put(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def idx(dtype, dims, payload):
    return bytes([0, 0, dtype, len(dims)]) + b"".join(struct.pack(">I", d) for d in dims) + payload


def idx_input(images, labels=None):
    if labels is None:
        return b"\x00" + images
    return b"\x01" + struct.pack("<I", len(images)) + images + labels


def gz(data):
    return gzip.compress(data, mtime=0)


def idx_seeds():
    u8 = idx(0x08, [3, 2, 2], bytes(range(12)))
    lab = idx(0x08, [3], bytes([0, 1, 2]))
    put("fuzz_idx", "u8-images", idx_input(u8))
    put("fuzz_idx", "u8-images-labels", idx_input(u8, lab))
    put("fuzz_idx", "gzip-images-labels", idx_input(gz(u8), gz(lab)))
    put("fuzz_idx", "gzip-images-plain-labels", idx_input(gz(u8), lab))
    put("fuzz_idx", "i8", idx_input(idx(0x09, [2, 3], bytes([0x80, 0xff, 0, 1, 2, 0x7f]))))
    put("fuzz_idx", "i16", idx_input(idx(0x0B, [2, 2], struct.pack(">4h", -2, -1, 0, 300)),
                                     idx(0x0B, [2], struct.pack(">2h", 1, 9))))
    put("fuzz_idx", "i32", idx_input(idx(0x0C, [2, 1], struct.pack(">2i", -7, 1 << 30)),
                                     idx(0x0C, [2], struct.pack(">2i", 3, 4))))
    put("fuzz_idx", "f32", idx_input(idx(0x0D, [2, 2], struct.pack(">4f", 0.5, -1, float("nan"), 3e38))))
    put("fuzz_idx", "f64", idx_input(idx(0x0E, [1, 2], struct.pack(">2d", 1e-300, 2.5))))
    put("fuzz_idx", "zero-records", idx_input(idx(0x08, [0, 28, 28], b""), idx(0x08, [0], b"")))
    put("fuzz_idx", "4d", idx_input(idx(0x08, [2, 1, 2, 2], bytes(8))))
    put("fuzz_idx", "truncated", idx_input(idx(0x08, [4, 2], bytes(5))))
    put("fuzz_idx", "gzip-truncated", idx_input(gz(u8)[:-6]))
    put("fuzz_idx", "float-labels", idx_input(u8, idx(0x0D, [3], bytes(12))))


def csv_seeds():
    put("fuzz_csv", "labelled", ",label\t\nx1,x2,label\n1,2.5,0\n-3e2,+4,1\n")
    put("fuzz_csv", "no-labels", ",\t\na,b,c\n1,2,3\n4,5,6")
    put("fuzz_csv", "crlf-bom-quoted", ',y\t\n\xef\xbb\xbf"a", "b" ,y\r\n"1",2,3\r\n\r\n4,"5",6\r\n')
    put("fuzz_csv", "semicolon-select", ";cls\tb,a\na;b;cls;note\n1;2;0;text\n3;4;1;more text\n")
    put("fuzz_csv", "tab", "\tl\t\nf\tl\n1.5\t2\n  \t \n2.5\t3\n")
    put("fuzz_csv", "nan-inf", ",\t\nv,w\nnan,INF\n-inf,1e39\n1e-46,0x10\n")
    put("fuzz_csv", "ragged", ",\t\na,b\n1,2\n3\n4,5,6\n")
    put("fuzz_csv", "empty-field", ",k\t\na,k\n,1\n")
    put("fuzz_csv", "label-not-int", ",k\t\na,k\n1,2.0\n1,cat\n1,99999999999\n")
    put("fuzz_csv", "header-only", ",\t\na,b\n")
    put("fuzz_csv", "duplicate-column", ",\t\na,a\n1,2\n")
    put("fuzz_csv", "missing-column", ",lable\tfeat\nlabel,feat1\n1,2\n")
    put("fuzz_csv", "pipe-long-line", "|\t\n" + "|".join(f"c{i}" for i in range(40)) + "\n" +
        "|".join(str(i * 0.25) for i in range(40)) + "\n")


def config_seeds():
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        with open(os.path.join(ROOT, "configs", name)) as f:
            put("fuzz_config", name, f.read())
    put("fuzz_config", "overrides", "[train]\nepochs = 2\n%%\n--train.epochs=3\n--infer.top_k=5\n"
        "--resume=auto\n--gates.min_rows=5\n--model.widths=4,8,2\n--ingest.labels=\n")
    put("fuzz_config", "csv-ingest", "[ingest]\nsource = csv\ncsv = in.csv\ncsv_label = y\n"
        "csv_features = a, b\ncsv_delimiter = ;\n[gates]\nreference = ref.h5\nmax_psi = 0.2\n")
    put("fuzz_config", "typos", "[trian]\nepochs = 1\n%%\n--train.epoch=3\n")
    put("fuzz_config", "bad-values", "[train]\nepochs = -1\nbatch = 1e3\n[optim]\nlr = abc\n"
        "%%\n--gates.psi_bins=1\n")
    put("fuzz_config", "pipeline", "[train]\npipeline_stages = 2\nmicro_batches = 4\n"
        "stage_boundaries = 1\n[model]\nwidths = 8,8,8,2\n%%\n--checkpoint.dir=ck\n"
        "--checkpoint.every_steps=10\n--print-config\n")


def h5_seeds():
    # FuzzedDataProvider inputs: empty = the valid baseline; 0xff bytes = delete/replace all.
    for t in ("fuzz_model_file", "fuzz_checkpoint_meta", "fuzz_prediction_meta"):
        put(t, "baseline", b"")
        put(t, "replace-first", b"\xff\x03\x00" + b"\x00" * 40)
        put(t, "delete-some", bytes([0x90, 0, 0x90, 0, 0, 0x90] * 4))
        put(t, "replace-all", bytes(range(256)) * 2)


if __name__ == "__main__":
    idx_seeds()
    csv_seeds()
    config_seeds()
    h5_seeds()
    sys.exit(0)
