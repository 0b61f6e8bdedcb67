"""Node-local staging end to end (locus-train with data.stage_dir, configs/tiny.ini): training
from the staged copy writes bitwise the model of training from the source (local and global
shuffle; also as two emulated nodes, LOCUS_TEST_RANKS_PER_NODE = half the ranks; and at 1 rank);
the copy is removed at the end unless data.stage_keep; a preempted run (SIGTERM, exit 75) keeps it, and its --resume=auto reuses it
(the log says so) and ends bitwise where an uninterrupted run ends; a missing stage_dir is
exit 2 on every rank with nothing written."""
import os

from apphelpers import check, expect_exit, main
from test_resume_app import (BASE, expect_same_model, prepare, sigterm_mid_run, train,
                             uninterrupted)

EXIT_CONFIG, EXIT_REQUEUE = 2, 75
# 20 steps (a third of an epoch of tiny.ini; the loader stages before the first), no evaluation.
SHORT = ["--checkpoint.dir=", "--train.max_steps=20", "--data.test="]


def two_nodes(r):
    """The environment that makes the suite's ranks two emulated nodes (None at 1 rank)."""
    return {"LOCUS_TEST_RANKS_PER_NODE": str(r.ranks // 2)} if r.ranks >= 2 else None


def staged_files(d):
    return sorted(f for f in os.listdir(d) if f.startswith("locus-stage-")) if os.path.isdir(d) else []


def test_staged_training_is_bitwise(r, tmp):
    prepare(r, tmp)
    os.mkdir(os.path.join(tmp, "stage"))
    layouts = [("one node", None)]
    if two_nodes(r):
        layouts.append(("two nodes", two_nodes(r)))
    for shuffle in ("local", "global"):
        args = [f"--loader.shuffle={shuffle}", *SHORT]
        p = train(r, tmp, *args, f"--train.output=src-{shuffle}.h5")
        expect_exit(p, 0)
        for name, env in layouts:
            out = f"st-{shuffle}-{name[0]}.h5"
            p = train(r, tmp, *args, "--data.stage_dir=stage", f"--train.output={out}", env=env)
            nodes = 2 if env else 1
            expect_exit(p, 0, f"{nodes} of {nodes} node{'s' if nodes > 1 else ''} staged it afresh",
                        "removed the staged copy of the training data from stage")
            expect_same_model(os.path.join(tmp, out), os.path.join(tmp, f"src-{shuffle}.h5"),
                              f"{shuffle} shuffle, staged on {name}")
            check(staged_files(os.path.join(tmp, "stage")) == [],
                  f"the staged copy was not removed: {staged_files(os.path.join(tmp, 'stage'))}")
    if r.ranks != 2:
        return
    # One rank (its node stages every row), bitwise the source's 1-rank model (in the 2-rank
    # instance only: it does not depend on the suite's rank count).
    one = ["--loader.shuffle=local", *SHORT]
    expect_exit(train(r, tmp, *one, "--train.output=src-one.h5", ranks=1), 0)
    p = train(r, tmp, *one, "--data.stage_dir=stage", "--data.stage_keep=true",
              "--train.output=one.h5", ranks=1)
    expect_exit(p, 0, "1 of 1 node staged it afresh")
    expect_same_model(os.path.join(tmp, "one.h5"), os.path.join(tmp, "src-one.h5"),
                      "staged at 1 rank")
    check(len(staged_files(os.path.join(tmp, "stage"))) == 1, "data.stage_keep removed the copy")


def test_preempted_run_keeps_the_copy_and_the_resume_reuses_it(r, tmp):
    prepare(r, tmp)
    uninterrupted(r, tmp)
    stage = os.path.join(tmp, "stage")
    os.mkdir(stage)
    env_nodes = two_nodes(r)
    p = sigterm_mid_run(r, tmp, "--checkpoint.dir=ck", "--train.metrics=p.jsonl",
                        "--data.stage_dir=stage")
    expect_exit(p, EXIT_REQUEUE, "staged it afresh")
    nodes = 1
    check(len(staged_files(stage)) == nodes, f"a preempted run must keep its staged copy: "
          f"{staged_files(stage)}")
    q = train(r, tmp, "--checkpoint.dir=ck", "--resume=auto", "--train.output=p.h5",
              "--train.metrics=p.jsonl", "--data.stage_dir=stage")
    expect_exit(q, 0, "1 of 1 node reused its staged copy (checksum verified)",
                "removed the staged copy")
    expect_same_model(os.path.join(tmp, "p.h5"), os.path.join(tmp, "u.h5"),
                      "preempted + resumed from the staged copy")
    check(staged_files(stage) == [], "the finished run did not remove its staged copy")
    if env_nodes:
        # Two emulated nodes: both copies kept by the first run, both reused by the second.
        p = train(r, tmp, *SHORT, "--data.stage_dir=stage", "--data.stage_keep=true",
                  env=env_nodes)
        expect_exit(p, 0, "2 of 2 nodes staged it afresh")
        check(len(staged_files(stage)) == 2, f"expected two node copies: {staged_files(stage)}")
        p = train(r, tmp, *SHORT, "--data.stage_dir=stage", env=env_nodes)
        expect_exit(p, 0, "2 of 2 nodes reused their staged copy")
        check(staged_files(stage) == [], "the copies were not removed")


def test_missing_stage_dir_is_a_config_error(r, tmp):
    prepare(r, tmp)
    p = train(r, tmp, "--checkpoint.dir=", "--data.stage_dir=nowhere", "--train.output=m.h5")
    expect_exit(p, EXIT_CONFIG, "data.stage_dir 'nowhere' is not a directory on node 0",
                "create it on every node")
    check(not os.path.exists(os.path.join(tmp, "m.h5")), "a failed run wrote a model file")
    check((p.stdout + p.stderr).count("is not a directory") == 1,
          "the error must be printed once (rank 0)", p)


if __name__ == "__main__":
    main([test_staged_training_is_bitwise,
          test_preempted_run_keeps_the_copy_and_the_resume_reuses_it],
         once=[test_missing_stage_dir_is_a_config_error])
