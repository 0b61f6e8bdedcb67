// Resharded resume at 2 and 4 ranks: a checkpoint written by P data-parallel ranks continues
// on P/2, 1 and (from 1) P ranks at the same data position in global samples, and with global
// shuffling ends where an uninterrupted run at the new size ends, within the data-parallel
// tolerance of test_trainer_dp.cpp: a skipped or repeated batch would move the weights by far
// more. Local shuffling mid-epoch on another rank count is refused.
#include <gtest/gtest.h>

#include "shared_tmpdir.hpp"
#include "test_checkpoint_util.hpp"

namespace locus::train::test {
namespace {

class CheckpointReshard : public CheckpointSuite {
 protected:
  static TrainOptions options(OptimizerKind kind) {
    TrainOptions o = small_options(data());
    o.log_every = 1;
    if (kind == OptimizerKind::adamw) {
      o.optimizer = {};
      o.optimizer.kind = OptimizerKind::adamw;
      o.optimizer.weight_decay = 0.01;
      o.schedule.base_lr = 0.01;
    } else {
      o.model.dropout = 0.2f;  // masks keyed by sample id: the same at any rank count
    }
    return o;
  }
};

// Collective over `comm`: trains to `stop` and saves into `dir` (on comm's ranks only).
void save_at(const mpi::Comm& comm, const TrainOptions& o, std::int64_t stop,
             const std::string& dir) {
  const Grid grid(comm, 1);
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir), "");
  c.resume("none");
  t.train(nullptr, stop, &c);
  c.save_now();
}

// Collective over `comm`: resumes from `path` and finishes; what the continuation saw.
struct Continued {
  Outcome outcome;
  CheckpointMeta meta;
  std::vector<std::string> notes;
  std::int64_t samples = 0;  // global samples trained on after the resume
};
Continued resume_from(const mpi::Comm& comm, const TrainOptions& o, const std::string& path) {
  const Grid grid(comm, 1);
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(""), "");
  const ResumeResult r = c.resume(path);
  EXPECT_TRUE(r.resumed);
  Recorder rec;
  const TrainSummary s = t.train(&rec);
  Continued out;
  add_state(out.outcome, t.state());
  out.outcome.steps = rec.steps;
  out.meta = r.meta;
  out.notes = r.notes;
  out.samples = s.samples;
  return out;
}

// A checkpoint of `from_comm` at `stop`, continued on `to_comm`, against an uninterrupted run
// on `to_comm`.
void expect_reshards(const mpi::Comm& from_comm, const mpi::Comm& to_comm, const TrainOptions& o,
                     std::int64_t stop, const std::string& dir) {
  if (from_comm.get() != MPI_COMM_NULL) save_at(from_comm, o, stop, dir);
  world().barrier();
  if (to_comm.get() == MPI_COMM_NULL) return;
  const Outcome want = straight_run(to_comm, o);
  const Continued got = resume_from(to_comm, o, dir + "/" + checkpoint_file_name(stop));
  const std::string what = "checkpoint of " + std::to_string(got.meta.data_parallel) +
                           " ranks continued on " + std::to_string(to_comm.size());
  // The data position: the continuation starts at sample stop * 42 of epoch 0 and trains on
  // exactly the samples the uninterrupted run trains on after it.
  EXPECT_EQ(got.meta.samples_in_epoch, stop * 42) << what;
  EXPECT_EQ(got.meta.samples_seen, stop * 42) << what;
  EXPECT_EQ(got.samples, 2 * 600 - stop * 42) << what;
  ASSERT_EQ(got.outcome.steps.size(), want.steps.size() - static_cast<std::size_t>(stop)) << what;
  for (std::size_t i = 0; i < got.outcome.steps.size(); ++i) {
    const StepMetrics& a = got.outcome.steps[i];
    const StepMetrics& b = want.steps[i + static_cast<std::size_t>(stop)];
    EXPECT_EQ(a.step, b.step) << what;
    EXPECT_EQ(a.samples, b.samples) << what << " step " << b.step;
    EXPECT_NEAR(a.loss, b.loss, 1e-4) << what << " step " << b.step;
  }
  expect_close(got.outcome.params, want.params, what + ": parameters");
  for (std::size_t s = 0; s < want.optimizer.size(); ++s) {
    expect_close(got.outcome.optimizer[s], want.optimizer[s], what + ": optimizer state");
  }
  if (got.meta.data_parallel != to_comm.size()) {
    ASSERT_FALSE(got.notes.empty()) << what;
    EXPECT_NE(got.notes[0].find("resharding"), std::string::npos) << got.notes[0];
  }
}

mpi::Comm self() { return mpi::Comm::borrow(MPI_COMM_SELF); }
mpi::Comm none() { return mpi::Comm::borrow(MPI_COMM_NULL); }

TEST_F(CheckpointReshard, ToOneRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const locus::test::SharedTmpDir dir(world());
  // Written by every rank, continued by each rank alone (each reads the same file).
  expect_reshards(world(), self(), options(OptimizerKind::sgd), 9, dir.path());
}

TEST_F(CheckpointReshard, FromOneRank) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const locus::test::SharedTmpDir dir(world());
  const mpi::Comm root = world().split(world().is_root() ? 0 : MPI_UNDEFINED, 0);
  expect_reshards(world().is_root() ? root.view() : none(), world(),
                  options(OptimizerKind::adamw), 11, dir.path());
}

TEST_F(CheckpointReshard, ToHalfTheRanks) {
  if (world().size() < 4) GTEST_SKIP() << "needs 4 ranks";
  const locus::test::SharedTmpDir dir(world());
  // Both halves continue the same checkpoint, each as its own job.
  const mpi::Comm half = world().split(world().rank() / (world().size() / 2), world().rank());
  for (OptimizerKind kind : {OptimizerKind::sgd, OptimizerKind::adamw}) {
    const std::string sub = dir.file(kind == OptimizerKind::sgd ? "sgd" : "adamw");
    expect_reshards(world(), half, options(kind), 7, sub);
  }
}

TEST_F(CheckpointReshard, LocalShuffleMidEpochNeedsTheSameRankCount) {
  if (world().size() < 2) GTEST_SKIP() << "needs 2 or more ranks";
  const locus::test::SharedTmpDir dir(world());
  TrainOptions o = options(OptimizerKind::sgd);
  o.data.shuffle = Shuffle::local;
  save_at(world(), o, 9, dir.path());
  world().barrier();
  const Grid grid(self(), 1);
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(""), "");
  try {
    c.resume(dir.file(checkpoint_file_name(9)));
    ADD_FAILURE() << "a local-shuffle checkpoint continued mid-epoch on another rank count";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("loader.shuffle = local"), std::string::npos) << msg;
    EXPECT_NE(msg.find("resume on " + std::to_string(world().size())), std::string::npos) << msg;
  }
}

}  // namespace
}  // namespace locus::train::test
