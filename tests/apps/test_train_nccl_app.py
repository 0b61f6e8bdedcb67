"""locus-train over the NCCL gradient reducer when a rank dies or stops (label gpu): the job never
hangs, at 2 ranks on configs/tiny.ini with train.backend = cuda and train.reducer = nccl.

Killed: one rank is SIGKILLed (LOCUS_TEST_HOOK=train-before-allreduce:kill@1) while its peer's
step waits on the reduction: mpirun tears the job down within BOUND_S, non-zero, and no model
file is published. Stopped: at step 5 one rank sleeps (train-step-5:sleep60@1) before its
forward pass -- so it never enqueues that step's all-reduce, whose connections the first four
made -- far longer than train.reducer_timeout_s (3 s; the progress watchdog's 120 s would fire
much later): its peer, waiting on the device for that all-reduce, polls NCCL and gives up --
exit 70, a line naming the all-reduce, the timeout and the rank, the communicator aborted --
within BOUND_S, nothing published. (The stop must come before the rank's backward pass: the
NCCL reducer enqueues a step's buckets as the backward pass makes them, and the step's later
hook, train-before-allreduce, would leave the peer waiting in an MPI collective instead.)
A stopped pipeline stage: at 2 stages over the NCCL stage link, stage 0 stops at step 5 just
before it sends its activations up (pipeline-send-5:sleep60@0), past the step's MPI exchanges
(the header, the labels), so the last stage's loss waits for a transfer that never comes: it
gives up within the timeout naming the stage link -- not the all-reduce, whose reductions the
last stage waits for first and which are done.

NCCL needs a GPU of its own per rank (the multi-GPU case), or, on a one-GPU host, a host id per
rank (test device only: bench/gpu/hostid_rank.sh as LOCUS_RANK_WRAPPER, which run_gpu.sh's
host-id phase sets). Where NCCL cannot join the ranks, or there is no GPU, it prints why and
exits 77 (ctest: skipped) -- unless LOCUS_REQUIRE_NCCL=1, where that is a failure."""
import os
import sys
import tempfile
import time

from apphelpers import AppRunner, check, expect_exit, main
from test_dead_rank_app import BOUND_S, CONFIG, EXIT_INTERNAL, prepare, unpublished

EXIT_SKIP = 77
NCCL = ["--train.backend=cuda", "--train.reducer=nccl", "--data.test=", "--train.metrics="]


def run(r, tmp, *args, hook=None):
    t0 = time.monotonic()
    p = r.run("locus-train", "--config", CONFIG, *NCCL, *args,
              env={"LOCUS_TEST_HOOK": hook} if hook else None, cwd=tmp)
    return p, time.monotonic() - t0


def why_no_nccl(r, tmp):
    """None where the NCCL reducer runs here, else the trainer's reason."""
    prepare(r, tmp)
    p, _ = run(r, tmp, "--train.max_steps=2", "--optim.warmup_steps=0", "--train.output=probe.h5")
    if p.returncode == 0:
        check("gradient all-reduce: nccl" in p.stdout, "the probe trained, but not through NCCL", p)
        return None
    reasons = [l for l in (p.stdout + p.stderr).splitlines()
               if "train.reducer = nccl cannot be used" in l or "train.backend = cuda" in l]
    if p.returncode == 2 and reasons:
        return reasons[0].strip()
    raise AssertionError(f"the probe run failed otherwise (rc {p.returncode}):\n"
                         f"{p.stdout}\n{p.stderr}")


def test_killed_in_the_nccl_reduction_ends_the_job(r, tmp):
    prepare(r, tmp)
    hook = "train-before-allreduce:kill@1"
    p, seconds = run(r, tmp, hook=hook)
    check(p.returncode != 0, f"{hook}: the job exited 0 although a rank was killed", p)
    check(seconds < BOUND_S, f"{hook}: the job took {seconds:.1f} s to end (bound {BOUND_S} s)", p)
    check(f"test hook '{hook.split(':')[0]}': kill" in p.stderr, f"{hook}: the hook did not fire", p)
    check(unpublished(os.path.join(tmp, "tiny-model.h5")), "a model file was published", p)


def test_a_stopped_peer_ends_in_an_nccl_error_within_the_timeout(r, tmp):
    prepare(r, tmp)
    hook = "train-step-5:sleep60@1"
    p, seconds = run(r, tmp, "--train.reducer_timeout_s=3", "--train.watchdog_s=120", hook=hook)
    expect_exit(p, EXIT_INTERNAL, "NCCL communicator was aborted")
    # The error line (not the start-up line "gradient all-reduce: nccl ...") names the
    # all-reduce it gave up on, the timeout and the rank that gave up.
    gave_up = [l for l in p.stderr.splitlines()
               if "did not complete within train.reducer_timeout_s = 3 s (data-parallel rank" in l]
    check(gave_up and ("all-reduce" in gave_up[0] or "ncclAllReduce" in gave_up[0]),
          "no error line naming the all-reduce, the timeout and the rank", p)
    check(seconds < BOUND_S, f"the job took {seconds:.1f} s to end (bound {BOUND_S} s)", p)
    check(unpublished(os.path.join(tmp, "tiny-model.h5")), "a model file was published", p)


def test_a_stopped_pipeline_stage_ends_in_a_stage_link_error_within_the_timeout(r, tmp):
    if r.ranks != 2:
        print("  (2 pipeline stages need 2 ranks: not run at this rank count)")
        return
    prepare(r, tmp)
    hook = "pipeline-send-5:sleep60@0"
    p, seconds = run(r, tmp, "--train.pipeline_stages=2", "--train.stage_link=nccl",
                     "--train.reducer_timeout_s=3", "--train.watchdog_s=120", hook=hook)
    expect_exit(p, EXIT_INTERNAL, "stage link: nccl", "NCCL communicator was aborted")
    check(f"test hook '{hook.split(':')[0]}'" in p.stderr, f"{hook}: the hook did not fire", p)
    gave_up = [l for l in p.stderr.splitlines()
               if "did not complete within train.reducer_timeout_s = 3 s (pipeline rank 1/2" in l]
    check(gave_up and "(stage link)" in gave_up[0],
          "no error line naming the stage link, the timeout and the last stage's rank", p)
    check(seconds < BOUND_S, f"the job took {seconds:.1f} s to end (bound {BOUND_S} s)", p)
    check(unpublished(os.path.join(tmp, "tiny-model.h5")), "a model file was published", p)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: test_train_nccl_app.py BINDIR RANKS")
    with tempfile.TemporaryDirectory(prefix="locus-nccl-probe-") as probe_dir:
        why = why_no_nccl(AppRunner(sys.argv[1], int(sys.argv[2])), probe_dir)
    if why is not None:
        if os.environ.get("LOCUS_REQUIRE_NCCL") == "1":
            print(f"FAILED: LOCUS_REQUIRE_NCCL=1, but the NCCL reducer cannot run: {why}")
            print("0 passed, 1 failed")
            sys.exit(1)
        print(f"skipped: the NCCL reducer cannot run here: {why}")
        sys.exit(EXIT_SKIP)
    main([test_killed_in_the_nccl_reduction_ends_the_job,
          test_a_stopped_peer_ends_in_an_nccl_error_within_the_timeout,
          test_a_stopped_pipeline_stage_ends_in_a_stage_link_error_within_the_timeout])
