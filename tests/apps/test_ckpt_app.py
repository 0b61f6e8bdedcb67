"""End-to-end tests of locus-ckpt under mpiexec: list (with verification and the latest
marker), verify (exit 3 naming the damaged tensor), inspect, export (a model file with the
checkpoint's tensors, as locus-infer reads it) and diff (bitwise, with a tolerance, exit 1 when
different), on checkpoints written by configs/tiny.ini runs; bad command lines (exit 2)."""
import os
import shutil

import h5py
import numpy as np

from apphelpers import check, expect_exit, main
from test_resume_app import flip_bit, prepare, train

# Failed runs on purpose: do not wait for Open MPI's kill timeout (see test_infer_app.py).
os.environ.setdefault("OMPI_MCA_odls_base_sigkill_timeout", "0")

EXIT_USAGE, EXIT_DATA, EXIT_DIFFER = 2, 3, 1


def ckpt(r, tmp, *args):
    return r.run("locus-ckpt", *args, cwd=tmp)


def make_checkpoints(r, tmp):
    prepare(r, tmp)
    expect_exit(train(r, tmp, "--checkpoint.dir=ck", "--checkpoint.every_steps=40",
                      "--checkpoint.keep_last=0", "--train.metrics="), 0)
    # Not `stragglers`: the straggler detector writes it whenever the machine's load makes a
    # rank look slow (docs/FORMATS.md), which says nothing about the checkpoints.
    return sorted(f for f in os.listdir(os.path.join(tmp, "ck")) if f != "stragglers")


def test_list_verify_inspect(r, tmp):
    files = make_checkpoints(r, tmp)
    # .lock: the training job's ownership lock (docs/FORMATS.md); the file stays after the job.
    check(files == [".lock", "ckpt-00000040.h5", "ckpt-00000063.h5", "ckpt-00000080.h5",
                    "ckpt-00000120.h5", "ckpt-00000126.h5", "latest"], f"files {files}")
    p = ckpt(r, tmp, "list", "ck")
    expect_exit(p, 0, "5 checkpoint(s)", "* ckpt-00000126.h5")
    check(p.stdout.count(" ok") == 5, "list must verify every checkpoint", p)
    check(p.stdout.index("ckpt-00000126.h5") < p.stdout.index("ckpt-00000040.h5"),
          "newest first", p)
    expect_exit(ckpt(r, tmp, "verify", "ck"), 0, "ok       ck/ckpt-00000063.h5 (step 63")
    p = ckpt(r, tmp, "inspect", "ck/ckpt-00000080.h5")
    expect_exit(p, 0, "step                 80", "epoch                1",
                "samples_in_epoch     544", "world_size           " + str(r.ranks),
                "optimizer/momentum_buffer/layers.2.bias", "[4]", "verification: ok")
    flip_bit(os.path.join(tmp, "ck", "ckpt-00000080.h5"), "model/layers.0.weight")
    p = ckpt(r, tmp, "verify", "ck/ckpt-00000040.h5", "ck/ckpt-00000080.h5")
    expect_exit(p, EXIT_DATA, "ok       ck/ckpt-00000040.h5",
                "DAMAGED  ck/ckpt-00000080.h5", "model/layers.0.weight",
                "1 of 2 checkpoint(s) failed verification")
    expect_exit(ckpt(r, tmp, "list", "ck"), 0, "DAMAGED")
    expect_exit(ckpt(r, tmp, "inspect", "ck/ckpt-00000080.h5"), EXIT_DATA,
                "verification: FAILED")
    expect_exit(ckpt(r, tmp, "verify", "nowhere"), EXIT_DATA, "'nowhere' does not exist")
    expect_exit(ckpt(r, tmp, "frobnicate"), EXIT_USAGE, "unknown command 'frobnicate'")
    # No command: the usage on stdout, written before any rank leaves (mpirun ends the others
    # at once when one exits non-zero here).
    expect_exit(ckpt(r, tmp), EXIT_USAGE, "usage: locus-ckpt COMMAND", "Exit codes:")
    expect_exit(ckpt(r, tmp, "diff", "a"), EXIT_USAGE, "takes 2 operands")


def test_export_is_a_model_file(r, tmp):
    make_checkpoints(r, tmp)
    p = ckpt(r, tmp, "export", "ck/ckpt-00000126.h5", "m.h5")
    expect_exit(p, 0, "exported the model of ck/ckpt-00000126.h5 (step 126")
    with h5py.File(os.path.join(tmp, "m.h5"), "r") as m, \
            h5py.File(os.path.join(tmp, "ck", "ckpt-00000126.h5"), "r") as c:
        check(m.attrs["locus_format"] == "locus-model", "export is not a model file")
        check(int(m.attrs["trained_steps"]) == 126, "trained_steps")
        for k in c["model"].keys():
            check(np.array_equal(m[k][()], c["model"][k][()]), f"{k} differs from the checkpoint")
    # The final model of the run (train.output) is the same model.
    with h5py.File(os.path.join(tmp, "m.h5"), "r") as m, \
            h5py.File(os.path.join(tmp, "tiny-model.h5"), "r") as t:
        for k in t.keys():
            check(np.array_equal(m[k][()], t[k][()]), f"{k} differs from train.output")
    flip_bit(os.path.join(tmp, "ck", "ckpt-00000120.h5"), "model/layers.1.weight")
    expect_exit(ckpt(r, tmp, "export", "ck/ckpt-00000120.h5", "bad.h5"), EXIT_DATA,
                "does not match its digest")
    check(not os.path.exists(os.path.join(tmp, "bad.h5")), "a damaged checkpoint was exported")


def test_diff(r, tmp):
    make_checkpoints(r, tmp)
    shutil.copy(os.path.join(tmp, "ck", "ckpt-00000080.h5"), os.path.join(tmp, "copy.h5"))
    expect_exit(ckpt(r, tmp, "diff", "ck/ckpt-00000080.h5", "copy.h5"), 0,
                "same: every tensor is bitwise equal")
    p = ckpt(r, tmp, "diff", "ck/ckpt-00000080.h5", "ck/ckpt-00000120.h5")
    expect_exit(p, EXIT_DIFFER, "different: 12 of 12 tensors", "counters: A at step 80")
    expect_exit(ckpt(r, tmp, "diff", "--tolerance=100", "ck/ckpt-00000080.h5",
                     "ck/ckpt-00000120.h5"), 0, "same: every tensor within 100")
    expect_exit(ckpt(r, tmp, "diff", "ck/ckpt-00000080.h5", "--tolerance", "100",
                     "ck/ckpt-00000120.h5"), 0, "same: every tensor within 100")
    # One ulp in one element: found bitwise, ignored with a tolerance.
    with h5py.File(os.path.join(tmp, "copy.h5"), "r+") as f:
        w = f["model/layers.2.bias"]
        v = w[()]
        v[1] = np.nextafter(v[1], np.float32(np.inf))
        w[...] = v
    p = ckpt(r, tmp, "diff", "ck/ckpt-00000080.h5", "copy.h5")
    # The copy's digest no longer matches: diff reads verified checkpoints only.
    expect_exit(p, EXIT_DATA, "model/layers.2.bias", "does not match its digest")


def test_usage_errors(r, tmp):
    """Bad command lines and operands: exit 2 (3 for a path that holds no checkpoint), a
    message naming what was wrong, nothing written."""
    for bad in ("abc", "-1", "nan", "inf", "1e999", ""):
        expect_exit(ckpt(r, tmp, "diff", f"--tolerance={bad}", "a.h5", "b.h5"), EXIT_USAGE,
                    f"--tolerance '{bad}' is not a non-negative number")
    expect_exit(ckpt(r, tmp, "diff", "a.h5", "b.h5", "--tolerance"), EXIT_USAGE,
                "--tolerance needs a value")
    expect_exit(ckpt(r, tmp, "verify", "--tolerance", "0.5", "a.h5"), EXIT_USAGE,
                "--tolerance applies to diff only")
    expect_exit(ckpt(r, tmp, "list", "--all", "ck"), EXIT_USAGE, "unknown option '--all'",
                "usage: locus-ckpt COMMAND")
    expect_exit(ckpt(r, tmp, "inspect", "a.h5", "b.h5"), EXIT_USAGE, "'inspect' takes 1 operand, got 2")
    os.mkdir(os.path.join(tmp, "empty"))
    expect_exit(ckpt(r, tmp, "verify", "empty"), EXIT_DATA,
                "'empty' holds no checkpoints (ckpt-<step>.h5)")
    with open(os.path.join(tmp, "plain.txt"), "w") as f:
        f.write("not a directory\n")
    expect_exit(ckpt(r, tmp, "list", "plain.txt"), EXIT_DATA,
                "'plain.txt' is not a directory: give a checkpoint.dir")
    check(sorted(os.listdir(tmp)) == ["empty", "plain.txt"], f"files written: {os.listdir(tmp)}")


if __name__ == "__main__":
    main([test_list_verify_inspect, test_export_is_a_model_file],
         once=[test_diff, test_usage_errors])
