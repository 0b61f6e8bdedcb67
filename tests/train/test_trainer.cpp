// The process grid and the trainer's checks and bookkeeping at 1, 2 and 4 ranks: grid layout,
// errors raised alike on every rank (width/dataset mismatch, pipeline stages), step and epoch
// counters with max_steps, interval metrics that add up, and distributed evaluation against a
// serial forward pass over the whole evaluation set.
#include <gtest/gtest.h>

#include <string>

#include "locus/comm/error.hpp"
#include "locus/io/dataset_file.hpp"
#include "locus/io/file.hpp"
#include "locus/train/model/forward.hpp"
#include "agreed_error.hpp"
#include "test_trainer_util.hpp"

namespace locus::train::test {
namespace {

using locus::test::agreed_error;

const mpi::Comm& world() {
  static const mpi::Comm w = mpi::Comm::world();
  return w;
}

class TrainerTest : public WorldDataSuite {};

TEST(Grid, PureDataParallel) {
  const Grid g(world(), 1);
  EXPECT_EQ(g.data_parallel(), world().size());
  EXPECT_EQ(g.pipeline_stages(), 1);
  EXPECT_EQ(g.dp_rank(), world().rank());
  EXPECT_EQ(g.stage(), 0);
  EXPECT_EQ(g.pp().size(), 1);
  EXPECT_EQ(g.dp().allreduce(1, MPI_SUM), world().size());
}

TEST(Grid, TwoStagesSplitIntoReplicas) {
  if (world().size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  const Grid g(world(), 2);
  EXPECT_EQ(g.data_parallel(), world().size() / 2);
  EXPECT_EQ(g.pipeline_stages(), 2);
  EXPECT_EQ(world().rank(), g.dp_rank() * 2 + g.stage());
  // Every dp group holds one stage; every pp group one replica, ordered by stage.
  EXPECT_EQ(g.dp().allreduce(g.stage(), MPI_MAX), g.stage());
  EXPECT_EQ(g.pp().allreduce(g.dp_rank(), MPI_MAX), g.dp_rank());
  EXPECT_EQ(g.pp().rank(), g.stage());
  EXPECT_NE(g.describe().find("2 pipeline stages"), std::string::npos) << g.describe();
}

TEST(Grid, StagesMustDivideTheRanks) {
  const int stages = world().size() + 1;  // never divides
  const std::string msg = [&] {
    try {
      const Grid g(world(), stages);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  }();
  EXPECT_NE(msg.find("does not divide"), std::string::npos) << msg;
  EXPECT_THROW(Grid(world(), 0), ConfigError);
}

// Pipeline training itself is tested in test_trainer_pipeline.cpp; here: the option checks.
TEST_F(TrainerTest, PipelineStagesMustFitTheModelAndTheGrid) {
  TrainOptions o = small_options(data());
  o.pipeline_stages = 4;  // small_options has 3 layers
  try {
    validate(o);  // local: not agreed
    ADD_FAILURE() << "validate() accepted 4 stages for 3 layers";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("use at most 3 stages"), std::string::npos) << e.what();
  }
  o.pipeline_stages = 2;
  const Grid g(world(), 1);
  const std::string msg = agreed_error<ConfigError>([&] { Trainer t(g, o); });
  EXPECT_NE(msg.find("train.pipeline_stages = 2"), std::string::npos) << msg;
}

TEST_F(TrainerTest, InputWidthMustMatchTheFeatures) {
  TrainOptions o = small_options(data());
  o.model.widths.front() = kFeatures + 1;
  const Grid g(world(), 1);
  const std::string msg = agreed_error<ConfigError>([&] { Trainer t(g, o); });
  EXPECT_NE(msg.find("model.widths = 13,24,16,4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("has 12 features"), std::string::npos) << msg;
  EXPECT_NE(msg.find(data().train()), std::string::npos) << msg;
}

TEST_F(TrainerTest, OutputWidthMustMatchTheClasses) {
  TrainOptions o = small_options(data());
  o.model.widths.back() = kClasses + 3;
  const Grid g(world(), 1);
  const std::string msg = agreed_error<ConfigError>([&] { Trainer t(g, o); });
  EXPECT_NE(msg.find("ends in 7 outputs"), std::string::npos) << msg;
  EXPECT_NE(msg.find("has 4 classes"), std::string::npos) << msg;
}

TEST_F(TrainerTest, CosineNeedsStepsAfterTheWarmup) {
  TrainOptions o = small_options(data());
  o.schedule.warmup_steps = 30;  // the run has 2 x 15 steps
  const Grid g(world(), 1);
  const std::string msg = agreed_error<ConfigError>([&] { Trainer t(g, o); });
  EXPECT_NE(msg.find("optim.warmup_steps = 30"), std::string::npos) << msg;
}

TEST_F(TrainerTest, MaxStepsStopsMidEpochAndMetricsAddUp) {
  TrainOptions o = small_options(data());
  o.epochs = 3;
  o.max_steps = 20;
  o.log_every = 4;
  const Grid g(world(), 1);
  Trainer t(g, o);
  EXPECT_EQ(t.steps_per_epoch(), 15);
  EXPECT_EQ(t.planned_steps(), 20);
  Recorder rec;
  const TrainSummary s = t.train(&rec);
  EXPECT_TRUE(s.finished);
  EXPECT_EQ(t.state().step, 20);
  EXPECT_EQ(t.state().epoch, 1);
  EXPECT_EQ(t.state().step_in_epoch, 5);
  EXPECT_EQ(t.state().optimizer->steps(), 20);
  // Intervals end every 4 steps and at the epoch end (step 15): 4, 8, 12, 15, 16, 20.
  std::vector<std::int64_t> ends;
  std::int64_t steps = 0, samples = 0;
  for (const auto& m : rec.steps) {
    ends.push_back(m.step);
    steps += m.steps;
    samples += m.samples;
    EXPECT_GT(m.loss, 0.0);
    EXPECT_GE(m.data_wait_s, 0.0);
  }
  EXPECT_EQ(ends, (std::vector<std::int64_t>{4, 8, 12, 15, 16, 20}));
  EXPECT_EQ(steps, 20);
  EXPECT_EQ(samples, 14 * 42 + 12 + 5 * 42);  // epoch 0: 600 rows; epoch 1: 5 full batches
  EXPECT_EQ(s.samples, samples);
  ASSERT_EQ(rec.epochs.size(), 2u);  // the full epoch 0 and the partial last one
  EXPECT_EQ(rec.epochs[0].samples, 600);
  EXPECT_TRUE(rec.epochs[1].evaluated);  // the end of training is always evaluated
  EXPECT_EQ(rec.epochs[1].eval.rows, 250);
}

// Reads a whole dataset on this rank alone.
io::Table read_all(const std::string& path) {
  const mpi::Comm self = mpi::Comm::borrow(MPI_COMM_SELF);
  h5::File f = h5::File::open(self, path, h5::File::Mode::read);
  const io::DatasetMeta meta = io::read_meta(f);
  io::Table t = io::read_rows(f, meta, h5::RowRange{0, static_cast<std::uint64_t>(meta.rows)});
  f.close();
  return t;
}

TEST_F(TrainerTest, EvaluationCoversEveryRowOnce) {
  TrainOptions o = small_options(data());
  o.max_steps = 6;
  o.eval_batch = 17;  // uneven batches and partitions
  const Grid g(world(), 1);
  EvalMetrics e;
  std::vector<float> params;
  {
    Trainer t(g, o);
    t.train();
    e = t.evaluate();
    params.assign(t.state().model.params().begin(), t.state().model.params().end());
  }
  // Serial reference: one forward pass over all rows with the same weights.
  const io::Table all = read_all(data().test());
  Mlp model(o.model);
  std::ranges::copy(params, model.params().begin());
  const int rows = static_cast<int>(all.rows());
  Workspace ws(model, rows, Mode::inference);
  const auto logits = forward(model, all.features, rows, ws);
  const LossStats ref = softmax_cross_entropy(logits, rows, kClasses, all.labels, {}, 1.0);
  EXPECT_EQ(e.rows, 250);
  EXPECT_NEAR(e.loss, ref.loss_sum / rows, 1e-5);
  // A row's logits may round differently in a batch of other size; allow one flipped argmax.
  EXPECT_NEAR(e.accuracy, static_cast<double>(ref.correct) / rows, 1.01 / rows);
  EXPECT_GT(e.accuracy, 0.5);  // 6 steps already beat chance (0.25)
}

}  // namespace
}  // namespace locus::train::test
