// The trainer's data-parallel contract at 1, 2 and 4 ranks: with global shuffling N ranks
// train to the weights of 1 rank (same global batch) up to float rounding; the same config
// gives bitwise the same weights and metrics on every run; a run stopped at any step and
// restored from its TrainState continues bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "test_trainer_util.hpp"

namespace locus::train::test {
namespace {

const mpi::Comm& world() {
  static const mpi::Comm w = mpi::Comm::world();
  return w;
}

class TrainerDp : public WorldDataSuite {};

// Trains a fresh trainer on `comm` with `o`; returns the parameters and what was reported.
struct Run {
  std::vector<float> params;
  Recorder rec;
  TrainSummary summary;
};

Run train_on(const mpi::Comm& comm, const TrainOptions& o) {
  const Grid grid(comm, 1);
  Trainer t(grid, o);
  Run r;
  r.summary = t.train(&r.rec);
  const auto p = t.state().model.params();
  r.params.assign(p.begin(), p.end());
  return r;
}

// Every optimizer step reduces the rows' gradients in a different order on N ranks (each
// rank's sgemm sums its own rows, then the N partial sums are added in rank order) than on one
// (one sgemm over all rows): a relative difference of a float ulp or so per step, which the
// following steps carry along without amplifying it much (lr 0.05 on a smooth loss). Measured
// after these 30 steps: max |w_N - w_1| = 1.2e-7 at 2 and 4 ranks (weights ~0.5). The
// tolerance, 2e-6 absolute + 2e-5 relative, leaves 15x headroom for other BLAS kernels and
// CPUs and is still a thousand times below what a real bug does (a lost rank's rows or a
// wrong gradient divisor moves weights by > 1e-2 here).
void expect_matches_serial(TrainOptions o) {
  const Run dp = train_on(world(), o);
  const Run serial = train_on(mpi::Comm::borrow(MPI_COMM_SELF), o);
  EXPECT_TRUE(same_on_all_ranks(world(), dp.params)) << "ranks disagree on the weights";
  ASSERT_EQ(dp.params.size(), serial.params.size());
  const Mlp init(o.model);
  double max_diff = 0.0, max_change = 0.0;
  for (std::size_t i = 0; i < dp.params.size(); ++i) {
    const double q = serial.params[i];
    max_diff = std::max(max_diff, std::abs(dp.params[i] - q));
    max_change = std::max(max_change, std::abs(q - init.params()[i]));
    ASSERT_NEAR(dp.params[i], q, 2e-6 + 2e-5 * std::abs(q)) << "parameter " << i;
  }
  EXPECT_GT(max_change, 1e-2) << "training hardly moved the weights: the test would not see "
                                 "a difference";
  ::testing::Test::RecordProperty("max_abs_diff", std::to_string(max_diff));
  if (world().is_root()) std::printf("    max |w_N - w_1| = %.3g\n", max_diff);
  // The reported losses are sums over the same samples: equal up to the same rounding.
  ASSERT_EQ(dp.rec.epochs.size(), serial.rec.epochs.size());
  for (std::size_t e = 0; e < dp.rec.epochs.size(); ++e) {
    EXPECT_EQ(dp.rec.epochs[e].samples, serial.rec.epochs[e].samples);
    EXPECT_NEAR(dp.rec.epochs[e].train_loss, serial.rec.epochs[e].train_loss, 1e-4);
    EXPECT_NEAR(dp.rec.epochs[e].eval.loss, serial.rec.epochs[e].eval.loss, 1e-4);
  }
  EXPECT_EQ(dp.summary.steps, 30);  // 600 rows / 42 = 15 steps x 2 epochs
  EXPECT_LT(dp.rec.epochs.back().train_loss, dp.rec.epochs.front().train_loss);
}

TEST_F(TrainerDp, DataParallelSgdNesterovMatchesOneRank) {
  TrainOptions o = small_options(data());
  o.model.dropout = 0.2f;  // masks are keyed by sample id: the same on any rank count
  o.clip_max_norm = 0.5;   // clipping by the global norm of the reduced gradient
  expect_matches_serial(o);
}

TEST_F(TrainerDp, DataParallelAdamWGeluMatchesOneRank) {
  TrainOptions o = small_options(data());
  o.model.activation = Activation::gelu;
  o.optimizer = {};
  o.optimizer.kind = OptimizerKind::adamw;
  o.optimizer.weight_decay = 0.01;
  o.schedule.base_lr = 0.01;
  o.data.global_batch = 40;  // 15 full batches; 4 ranks get 10 rows each
  expect_matches_serial(o);
}

// Everything a run computes is a function of the config and the world size.
void expect_reproducible(const TrainOptions& o) {
  const Run a = train_on(world(), o);
  const Run b = train_on(world(), o);
  EXPECT_EQ(a.params, b.params) << "two runs of one config differ";
  EXPECT_TRUE(same_on_all_ranks(world(), a.params));
  ASSERT_EQ(a.rec.steps.size(), b.rec.steps.size());
  ASSERT_FALSE(a.rec.steps.empty());
  for (std::size_t i = 0; i < a.rec.steps.size(); ++i) {
    const StepMetrics &x = a.rec.steps[i], &y = b.rec.steps[i];
    EXPECT_EQ(x.step, y.step);
    EXPECT_EQ(x.samples, y.samples);
    EXPECT_EQ(x.loss, y.loss) << "interval " << i;  // bitwise: EXPECT_EQ on doubles
    EXPECT_EQ(x.accuracy, y.accuracy);
    EXPECT_EQ(x.lr, y.lr);
    EXPECT_EQ(x.grad_norm, y.grad_norm);
  }
  ASSERT_EQ(a.rec.epochs.size(), b.rec.epochs.size());
  for (std::size_t i = 0; i < a.rec.epochs.size(); ++i) {
    EXPECT_EQ(a.rec.epochs[i].train_loss, b.rec.epochs[i].train_loss);
    EXPECT_EQ(a.rec.epochs[i].eval.loss, b.rec.epochs[i].eval.loss);
    EXPECT_EQ(a.rec.epochs[i].eval.accuracy, b.rec.epochs[i].eval.accuracy);
  }
}

TEST_F(TrainerDp, DeterminismGlobalShuffleDropoutClipping) {
  TrainOptions o = small_options(data());
  o.model.dropout = 0.3f;
  o.clip_max_norm = 0.3;
  expect_reproducible(o);
}

TEST_F(TrainerDp, DeterminismLocalShuffleAdamMse) {
  TrainOptions o = small_options(data());
  o.data.shuffle = Shuffle::local;
  o.loss = Loss::mse;
  o.optimizer = {};
  o.optimizer.kind = OptimizerKind::adam;
  o.schedule.kind = ScheduleKind::step;
  o.schedule.step_size = 7;
  o.schedule.base_lr = 0.01;
  expect_reproducible(o);
}

// Stops at `stop`, restores the state into a new trainer (what a checkpoint restart does) and
// finishes: the weights must equal an uninterrupted run's bit for bit.
void expect_resumes(TrainOptions o, std::int64_t stop) {
  const Run straight = train_on(world(), o);
  const Grid grid(world(), 1);
  Trainer first(grid, o);
  first.train(nullptr, stop);
  EXPECT_EQ(first.state().step, stop);
  Trainer second(grid, o);
  second.state().assign(first.state());
  const TrainSummary s = second.train();
  EXPECT_TRUE(s.finished);
  EXPECT_EQ(s.steps, first.planned_steps() - stop);
  const auto p = second.state().model.params();
  EXPECT_EQ(std::vector<float>(p.begin(), p.end()), straight.params)
      << "resumed at step " << stop << " but ended elsewhere";
}

TEST_F(TrainerDp, ResumeMidEpochIsBitExact) {
  TrainOptions o = small_options(data());
  o.model.dropout = 0.2f;
  o.data.shuffle = Shuffle::local;
  expect_resumes(o, 9);  // epoch 0, step 9 of 15
}

TEST_F(TrainerDp, ResumeAtEpochBoundaryIsBitExact) {
  TrainOptions o = small_options(data());
  o.optimizer = {};
  o.optimizer.kind = OptimizerKind::adamw;
  o.schedule.base_lr = 0.01;
  expect_resumes(o, 15);  // exactly one epoch
}

}  // namespace
}  // namespace locus::train::test
