// Checkpoint/restart through the trainer's step hook at 1, 2 and 4 ranks: a run checkpointed
// and stopped at step 1, mid-epoch or at an epoch end, then resumed by a new trainer with
// --resume=auto, ends bitwise where an uninterrupted run ends (weights, optimizer state and
// every step's loss), for SGD and AdamW; a signal on one rank stops every rank at one step;
// background saves change nothing; a damaged newest checkpoint (tensors or metadata) is skipped,
// and so are the checkpoints of a run that --resume=none replaced; a failed save leaves
// training intact; incompatible checkpoints are refused with what differs.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>

#include <fmt/format.h>

#include "locus/io/attribute.hpp"
#include "locus/io/h5.hpp"
#include "locus/train/checkpoint/preempt.hpp"
#include "shared_tmpdir.hpp"
#include "test_checkpoint_util.hpp"

namespace locus::train::test {
namespace {

class CheckpointResume : public CheckpointSuite {
 public:
  static TrainOptions sgd() {
    TrainOptions o = small_options(data());
    o.model.dropout = 0.2f;
    o.clip_max_norm = 0.5;
    o.log_every = 1;
    return o;
  }
  static TrainOptions adamw() {
    TrainOptions o = small_options(data());
    o.optimizer = {};
    o.optimizer.kind = OptimizerKind::adamw;
    o.optimizer.weight_decay = 0.01;
    o.schedule.base_lr = 0.01;
    o.log_every = 1;
    return o;
  }
};

// Trains to `stop` with a Checkpointer and saves there (as a preempted job would), then a new
// trainer resumes with --resume=auto and finishes.
Outcome interrupted_run(const TrainOptions& o, std::int64_t stop, const std::string& dir,
                        ResumeResult* resumed = nullptr) {
  const Grid grid(world(), 1);
  Outcome out;
  {
    Trainer t(grid, o);
    Checkpointer c(t, checkpoint_options(dir), "[train]\nepochs = 2\n");
    c.resume("none");
    Recorder rec;
    t.train(&rec, stop, &c);
    c.save_now("test");
    c.wait();
    out.steps = rec.steps;
  }
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir), "[train]\nepochs = 2\n");
  const ResumeResult r = c.resume("auto");
  EXPECT_TRUE(r.resumed);
  EXPECT_EQ(r.meta.step, stop);
  EXPECT_TRUE(r.skipped.empty());
  if (resumed != nullptr) *resumed = r;
  Recorder rec;
  const TrainSummary s = t.train(&rec, -1, &c);
  c.wait();
  EXPECT_TRUE(s.finished);
  EXPECT_EQ(s.steps, t.planned_steps() - stop);
  out.steps.insert(out.steps.end(), rec.steps.begin(), rec.steps.end());
  add_state(out, t.state());
  return out;
}

void expect_resumes_bitwise(const TrainOptions& o) {
  const Outcome want = straight_run(world(), o);
  for (std::int64_t stop : {1, 9, 15}) {  // step 1, mid-epoch (9 of 15), an epoch end
    const locus::test::SharedTmpDir dir(world());
    ResumeResult r;
    const Outcome got = interrupted_run(o, stop, dir.path(), &r);
    expect_bitwise(got, want, "stopped at step " + std::to_string(stop));
    EXPECT_EQ(r.meta.samples_in_epoch, stop == 15 ? 0 : stop * 42);
    EXPECT_EQ(r.meta.epoch, stop == 15 ? 1 : 0);
    EXPECT_EQ(r.meta.samples_seen, stop == 15 ? 600 : stop * 42);
  }
}

TEST_F(CheckpointResume, SgdNesterovDropoutClippingIsBitExact) { expect_resumes_bitwise(sgd()); }

TEST_F(CheckpointResume, AdamWIsBitExact) { expect_resumes_bitwise(adamw()); }

// Raises `signal` on one rank after step `at` was reported (the other ranks never see it).
struct SignalAt final : TrainObserver {
  SignalAt(std::int64_t at, int rank, int signal) : at_(at), rank_(rank), signal_(signal) {}
  void on_step(const StepMetrics& m) override {
    if (m.step == at_ && world().rank() == rank_) std::raise(signal_);
  }
  std::int64_t at_;
  int rank_, signal_;
};

TEST_F(CheckpointResume, SignalOnOneRankStopsEveryRankAtOneStep) {
  const TrainOptions o = sgd();
  const Outcome want = straight_run(world(), o);
  const locus::test::SharedTmpDir dir(world());
  CheckpointOptions co = checkpoint_options(dir.path());
  co.signals = parse_signals("USR1,TERM");
  const Grid grid(world(), 1);
  Outcome got;
  {
    const PreemptSignals handlers(co.signals);
    Trainer t(grid, o);
    Checkpointer c(t, co, "");
    c.resume("none");
    ObserverList obs;
    Recorder rec;
    SignalAt sig(7, world().size() - 1, SIGUSR1);
    obs.add(&rec);
    obs.add(&sig);
    const TrainSummary s = t.train(&obs, -1, &c);
    EXPECT_FALSE(s.finished);
    EXPECT_EQ(c.stopped_by_signal(), SIGUSR1);
    EXPECT_EQ(t.state().step, 7);
    EXPECT_EQ(world().allreduce(t.state().step, MPI_MAX), 7);
    ASSERT_EQ(c.saves().size(), 1u);
    EXPECT_EQ(c.saves()[0].reason, "signal");
    EXPECT_EQ(read_latest(dir.path()).file, checkpoint_file_name(7));
    got.steps = rec.steps;
  }
  Trainer t(grid, o);
  Checkpointer c(t, co, "");
  EXPECT_EQ(c.resume("auto").meta.step, 7);
  Recorder rec;
  t.train(&rec, -1, &c);
  got.steps.insert(got.steps.end(), rec.steps.begin(), rec.steps.end());
  add_state(got, t.state());
  expect_bitwise(got, want, "signalled at step 7");
}

// The handlers give the previous dispositions back, unless the process is leaving after a
// preemption checkpoint (ignore_after): then a late SIGTERM (mpirun's, to the ranks still in
// MPI_Finalize once the first one exited 75) must not turn its exit 75 into 143.
TEST(PreemptSignals, RestoreDispositionsOrIgnoreThemWhenLeaving) {
  const auto handler_of = [](int signal) {
    struct sigaction now {};
    ::sigaction(signal, nullptr, &now);
    return now.sa_handler;
  };
  std::signal(SIGUSR2, SIG_DFL);
  { const PreemptSignals handlers({SIGUSR2}); }
  EXPECT_EQ(handler_of(SIGUSR2), SIG_DFL);
  {
    PreemptSignals handlers({SIGUSR2});
    EXPECT_NE(handler_of(SIGUSR2), SIG_DFL);
    handlers.ignore_after();
  }
  EXPECT_EQ(handler_of(SIGUSR2), SIG_IGN);
  std::raise(SIGUSR2);  // would end this test program under SIG_DFL
  EXPECT_EQ(PreemptSignals::pending(), 0);
  std::signal(SIGUSR2, SIG_DFL);
}

TEST_F(CheckpointResume, BackgroundSavesChangeNothing) {
  const TrainOptions o = adamw();
  const Outcome want = straight_run(world(), o);
  const locus::test::SharedTmpDir dir(world());
  CheckpointOptions co = checkpoint_options(dir.path());
  co.async = true;
  co.every_steps = 4;
  co.at_epoch_end = false;
  const Grid grid(world(), 1);
  {
    Trainer t(grid, o);
    Checkpointer c(t, co, "");
    c.resume("none");
    Recorder rec;
    t.train(&rec, -1, &c);
    c.wait();
    Outcome got;
    add_state(got, t.state());
    got.steps = rec.steps;
    expect_bitwise(got, want, "with background saves");
    std::vector<std::int64_t> steps;
    for (const auto& s : c.saves()) {
      EXPECT_TRUE(s.committed);
      steps.push_back(s.step);
    }
    // Every 4 steps in the background; the end (step 30) synchronously.
    EXPECT_EQ(steps, (std::vector<std::int64_t>{4, 8, 12, 16, 20, 24, 28, 30}));
  }
  for (const auto& e : list_checkpoints(dir.path())) {
    const VerifyReport r = verify_checkpoint(world(), e.path);
    EXPECT_TRUE(r.ok) << r.problem;
  }
  // A background checkpoint resumes bit for bit.
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(""), "");
  c.resume(dir.file(checkpoint_file_name(8)));
  EXPECT_EQ(t.state().step, 8);
  Recorder rec;
  t.train(&rec);
  Outcome got;
  add_state(got, t.state());
  got.steps.assign(want.steps.begin(), want.steps.begin() + 8);
  got.steps.insert(got.steps.end(), rec.steps.begin(), rec.steps.end());
  expect_bitwise(got, want, "resumed from the background checkpoint of step 8");
}

// Rank 0 flips one bit in the middle of the file's largest region of tensor bytes.
void damage(const std::string& path, std::span<const float> tensor_bytes) {
  if (world().is_root()) {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    const std::string needle(reinterpret_cast<const char*>(tensor_bytes.data()),
                             tensor_bytes.size_bytes());
    const auto at = bytes.find(needle);
    ASSERT_NE(at, std::string::npos);
    bytes[at + 7] ^= 0x01;
    std::ofstream(path, std::ios::binary | std::ios::trunc)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  world().barrier();
}

// A run checkpointed at steps 5 and 11; `damage` then spoils the newest checkpoint (given the
// trainer that wrote it). --resume=auto must skip it with a reason naming `why` and end bitwise
// where an uninterrupted run ends, from step 5.
void expect_resume_past_a_damaged_newest(
    const std::string& why, const std::function<void(const std::string&, const Trainer&)>& damage) {
  const TrainOptions o = CheckpointResume::sgd();
  const Outcome want = straight_run(world(), o);
  const locus::test::SharedTmpDir dir(world());
  const Grid grid(world(), 1);
  Outcome got;
  {
    Trainer t(grid, o);
    Checkpointer c(t, checkpoint_options(dir.path()), "");
    c.resume("none");
    Recorder rec;
    t.train(&rec, 5, &c);
    c.save_now();
    t.train(&rec, 11, &c);
    c.save_now();
    got.steps.assign(rec.steps.begin(), rec.steps.begin() + 5);
    damage(dir.file(checkpoint_file_name(11)), t);
  }
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir.path()), "");
  const ResumeResult r = c.resume("auto");
  EXPECT_EQ(r.meta.step, 5);
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_NE(r.skipped[0].find("ckpt-00000011.h5"), std::string::npos) << r.skipped[0];
  EXPECT_NE(r.skipped[0].find(why), std::string::npos) << r.skipped[0];
  Recorder rec;
  t.train(&rec, -1, &c);
  got.steps.insert(got.steps.end(), rec.steps.begin(), rec.steps.end());
  add_state(got, t.state());
  expect_bitwise(got, want, "resumed past a damaged checkpoint (" + why + ")");
  // The abandoned branch (step 11) is retired by the first new checkpoint.
  EXPECT_FALSE(std::filesystem::exists(dir.file(checkpoint_file_name(11))));
}

// A flipped bit in a tensor: found by its digest when the tensors are read.
TEST_F(CheckpointResume, AutoSkipsADamagedNewestCheckpoint) {
  expect_resume_past_a_damaged_newest(
      "model/layers.0.weight", [](const std::string& path, const Trainer& t) {
        damage(path, t.state().model.params().subspan(0, 16));
      });
}

// An attribute edited, so the metadata no longer matches its digest: found before any tensor
// is read.
TEST_F(CheckpointResume, AutoSkipsANewestCheckpointWithDamagedMetadata) {
  expect_resume_past_a_damaged_newest(
      "do not match their digest", [](const std::string& path, const Trainer&) {
        if (world().is_root()) {
          h5::init();
          h5::Id f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
          ASSERT_TRUE(f);
          h5::write_attr(f.get(), "step", std::int64_t{12});
        }
        world().barrier();
      });
}

// A run of 20 steps in `dir` with checkpoints at step 15 (the epoch's end) and 20; its run id.
std::string checkpointed_run(const TrainOptions& o, const std::string& dir) {
  const Grid grid(world(), 1);
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir), "");
  c.resume("none");
  t.train(nullptr, 20, &c);
  c.save_now();
  return c.run_id();
}

// A job restarted with --resume=none, then preempted before its first checkpoint and requeued
// with --resume=auto, must not take up the run it replaced: the pointer names the new run, so
// the old run's checkpoints are skipped (each named, with both runs) and training starts over.
TEST_F(CheckpointResume, AutoDoesNotTakeUpTheRunThatResumeNoneReplaced) {
  const TrainOptions o = sgd();
  const locus::test::SharedTmpDir dir(world());
  const Grid grid(world(), 1);
  const std::string old_run = checkpointed_run(o, dir.path());
  std::string new_run;
  {
    Trainer t(grid, o);
    Checkpointer c(t, checkpoint_options(dir.path()), "");
    c.resume("none");
    new_run = c.run_id();
    t.train(nullptr, 3, nullptr);  // preempted before its first checkpoint
  }
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir.path()), "");
  const ResumeResult r = c.resume("auto");
  EXPECT_FALSE(r.resumed);
  EXPECT_EQ(t.state().step, 0);
  ASSERT_EQ(r.skipped.size(), 2u);  // steps 20 and 15
  for (const std::string& s : r.skipped) {
    EXPECT_NE(s.find(fmt::format("belongs to run {}, not to the latest run {}", old_run, new_run)),
              std::string::npos) << s;
  }
  // Starting over is a run of its own, as --resume=none would have begun.
  EXPECT_NE(c.run_id(), old_run);
  EXPECT_EQ(read_latest(dir.path()).run_id, c.run_id());
}

// --resume=auto without a checkpoint.dir has nothing to look in: a new run, nothing resumed.
TEST_F(CheckpointResume, AutoWithoutACheckpointDirStartsFromScratch) {
  const Grid grid(world(), 1);
  Trainer t(grid, sgd());
  Checkpointer c(t, checkpoint_options(""), "");
  const ResumeResult r = c.resume("auto");
  EXPECT_FALSE(r.resumed);
  EXPECT_TRUE(r.skipped.empty());
  EXPECT_FALSE(c.run_id().empty());
  EXPECT_EQ(t.state().step, 0);
}

TEST_F(CheckpointResume, FailedSaveLeavesTrainingIntact) {
  const TrainOptions o = sgd();
  const Outcome want = straight_run(world(), o);
  const locus::test::SharedTmpDir dir(world());
  const Grid grid(world(), 1);
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir.path()), "");
  c.resume("none");
  Recorder rec;
  t.train(&rec, 6, &c);
  c.save_now();
  t.train(&rec, 10, &c);
  {
    rlimit saved{};
    getrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit tight = saved;
    tight.rlim_cur = 4096;
    setrlimit(RLIMIT_FSIZE, &tight);
    EXPECT_THROW(c.save_now(), IoError);
    setrlimit(RLIMIT_FSIZE, &saved);
  }
  EXPECT_EQ(read_latest(dir.path()).file, checkpoint_file_name(6));
  t.train(&rec, -1, &c);  // continues, and its end-of-run checkpoint works
  Outcome got;
  add_state(got, t.state());
  got.steps = rec.steps;
  expect_bitwise(got, want, "after a failed save");
  EXPECT_EQ(read_latest(dir.path()).file, checkpoint_file_name(30));
}

TEST_F(CheckpointResume, TimeTriggerFollowsRankZerosClock) {
  const locus::test::SharedTmpDir dir(world());
  CheckpointOptions co = checkpoint_options(dir.path());
  co.every_seconds = 1e-9;  // due at every boundary -- on rank 0's clock, agreed by all
  co.at_end = false;
  const Grid grid(world(), 1);
  Trainer t(grid, sgd());
  Checkpointer c(t, co, "");
  c.resume("none");
  t.train(nullptr, 4, &c);
  std::vector<std::int64_t> steps;
  for (const auto& s : c.saves()) {
    EXPECT_EQ(s.reason, "seconds");
    steps.push_back(s.step);
  }
  EXPECT_EQ(steps, (std::vector<std::int64_t>{1, 2, 3, 4}));
}

std::string resume_error(const TrainOptions& o, const std::string& dir) {
  const Grid grid(world(), 1);
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir), "");
  try {
    c.resume("auto");
  } catch (const ConfigError& e) {
    EXPECT_TRUE(e.agreed());
    return e.what();
  }
  ADD_FAILURE() << "an incompatible checkpoint was accepted";
  return "";
}

TEST_F(CheckpointResume, IncompatibleCheckpointsAreRefused) {
  const TrainOptions o = sgd();
  const locus::test::SharedTmpDir dir(world());
  {
    const Grid grid(world(), 1);
    Trainer t(grid, o);
    Checkpointer c(t, checkpoint_options(dir.path()), "");
    c.resume("none");
    t.train(nullptr, 4, &c);
    c.save_now();
  }
  TrainOptions batch = o;
  batch.data.global_batch = 40;
  EXPECT_NE(resume_error(batch, dir.path()).find("train.batch is 42 in the checkpoint and 40"),
            std::string::npos);
  TrainOptions widths = o;
  widths.model.widths = {kFeatures, 20, kClasses};
  EXPECT_NE(resume_error(widths, dir.path()).find("the checkpoint holds 12,24,16,4"),
            std::string::npos);
  TrainOptions other_data = o;
  other_data.data.path = data().test();
  EXPECT_NE(resume_error(other_data, dir.path()).find("the training data differs"),
            std::string::npos);
  TrainOptions seed = o;
  seed.data.seed = 99;  // mid-epoch: the rest of the epoch would be another order
  const std::string msg = resume_error(seed, dir.path());
  EXPECT_NE(msg.find("middle of epoch 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--resume=none"), std::string::npos) << msg;
}

TEST_F(CheckpointResume, ResumeNoneRetiresAnEarlierRun) {
  const TrainOptions o = sgd();
  const locus::test::SharedTmpDir dir(world());
  const Grid grid(world(), 1);
  const std::string first_run = checkpointed_run(o, dir.path());
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir.path()), "");
  c.resume("none");
  EXPECT_NE(c.run_id(), first_run);
  // Before this run's first checkpoint --resume=auto must not pick the earlier run up.
  EXPECT_EQ(read_latest(dir.path()).run_id, c.run_id());
  t.train(nullptr, 3, &c);
  c.save_now();
  world().barrier();
  const auto left = list_checkpoints(dir.path());
  ASSERT_EQ(left.size(), 1u);
  EXPECT_EQ(left[0].step, 3);
}

}  // namespace
}  // namespace locus::train::test
