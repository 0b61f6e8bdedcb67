// The trainer with pipeline stages at 2 and 4 ranks (pp = 2, pp = 2 x dp = 2, pp = 4) on real
// locus datasets: the same weights, losses and evaluation as a 1-rank run up to float
// rounding for GPipe and 1F1B, SGD and AdamW; bitwise the same run twice; gradient
// accumulation (pp = 1, micro-batches); checkpoints: interrupted and resumed on the same grid
// bitwise equal to an uninterrupted run, resumed on another grid (pp = 2 -> pp = 1 and back)
// continuing correctly; a preemption signal on one stage; invalid grids refused with agreed
// ConfigErrors.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <string>

#include "locus/train/checkpoint/preempt.hpp"
#include "agreed_error.hpp"
#include "shared_tmpdir.hpp"
#include "test_checkpoint_util.hpp"

namespace locus::train::test {
namespace {

using locus::test::agreed_error;

class PipelineTrainer : public CheckpointSuite {
 protected:
  // 4 layers (up to 4 stages), 2 epochs of 15 steps, evaluation at each epoch's end.
  static TrainOptions options(int stages, int micro, PipelineSchedule schedule) {
    TrainOptions o = small_options(data());
    o.model.widths = {kFeatures, 24, 16, 12, kClasses};
    o.model.dropout = 0.2f;
    o.clip_max_norm = 0.5;
    o.pipeline_stages = stages;
    o.micro_batches = micro;
    o.pipeline_schedule = schedule;
    o.log_every = 1;
    return o;
  }
  static TrainOptions adamw(TrainOptions o) {
    o.model.activation = Activation::gelu;
    o.optimizer = {};
    o.optimizer.kind = OptimizerKind::adamw;
    o.optimizer.weight_decay = 0.01;
    o.schedule.base_lr = 0.01;
    o.clip_max_norm = 0;
    return o;
  }
};

struct PpRun {
  Outcome out;
  Recorder rec;
  TrainSummary summary;
  bool replicas_agree = false;  // every stage's data-parallel replicas hold the same bits
};

// A fresh trainer on comm with o's grid; the state after train() (the stages' layers gathered
// on every rank).
PpRun train_on(const mpi::Comm& comm, const TrainOptions& o) {
  const Grid grid(comm, o.pipeline_stages);
  Trainer t(grid, o);
  PpRun r;
  r.summary = t.train(&r.rec);
  r.replicas_agree = same_on_all_ranks(grid.dp(), t.state().model.params());
  add_state(r.out, t);
  r.out.steps = r.rec.steps;
  return r;
}

TrainOptions single(TrainOptions o) {
  o.pipeline_stages = 1;
  o.micro_batches = 1;
  return o;
}

// The stage counts this world size can hold (pp x dp = world).
std::vector<int> stage_counts() {
  std::vector<int> out;
  for (int s = 2; s <= world().size() && s <= 4; s *= 2) out.push_back(s);
  return out;
}

std::string describe(const TrainOptions& o) {
  return fmt::format("pp={} x dp={}, {} micro-batches, {}", o.pipeline_stages,
                     world().size() / o.pipeline_stages, o.micro_batches,
                     to_string(o.pipeline_schedule));
}

// The same tolerance as data parallelism (test_trainer_dp.cpp): micro-batch gradients add up
// in another order than one batch's, a float ulp or so per step.
void expect_matches_single_rank(const TrainOptions& o) {
  SCOPED_TRACE(describe(o));
  const PpRun pp = train_on(world(), o);
  const PpRun one = train_on(mpi::Comm::borrow(MPI_COMM_SELF), single(o));
  EXPECT_TRUE(pp.replicas_agree) << "a stage's data-parallel replicas disagree";
  expect_close(pp.out.params, one.out.params, "parameters");
  const Mlp init(o.model);
  double moved = 0;
  for (std::size_t i = 0; i < one.out.params.size(); ++i) {
    moved = std::max(moved, static_cast<double>(std::abs(one.out.params[i] - init.params()[i])));
  }
  EXPECT_GT(moved, 1e-2) << "training hardly moved the weights";
  EXPECT_EQ(pp.summary.steps, 30);
  ASSERT_EQ(pp.rec.steps.size(), one.rec.steps.size());
  for (std::size_t i = 0; i < pp.rec.steps.size(); ++i) {
    EXPECT_EQ(pp.rec.steps[i].samples, one.rec.steps[i].samples);
    EXPECT_NEAR(pp.rec.steps[i].loss, one.rec.steps[i].loss, 1e-4) << "step " << i;
    EXPECT_NEAR(pp.rec.steps[i].grad_norm, one.rec.steps[i].grad_norm,
                1e-4 * (1 + one.rec.steps[i].grad_norm));
  }
  ASSERT_EQ(pp.rec.epochs.size(), one.rec.epochs.size());
  for (std::size_t e = 0; e < pp.rec.epochs.size(); ++e) {
    ASSERT_TRUE(pp.rec.epochs[e].evaluated);
    EXPECT_EQ(pp.rec.epochs[e].eval.rows, one.rec.epochs[e].eval.rows);
    EXPECT_NEAR(pp.rec.epochs[e].eval.loss, one.rec.epochs[e].eval.loss, 1e-4);
    EXPECT_NEAR(pp.rec.epochs[e].eval.accuracy, one.rec.epochs[e].eval.accuracy, 1.5 / 250);
  }
}

TEST_F(PipelineTrainer, SgdMatchesOneRank) {
  for (const int stages : stage_counts()) {
    for (const auto sched : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
      expect_matches_single_rank(options(stages, 3, sched));
    }
  }
}

TEST_F(PipelineTrainer, AdamWMatchesOneRank) {
  for (const int stages : stage_counts()) {
    for (const auto sched : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
      expect_matches_single_rank(adamw(options(stages, 4, sched)));
    }
  }
}

// micro_batches > 1 on one stage is gradient accumulation over the data-parallel ranks.
TEST_F(PipelineTrainer, GradientAccumulationMatchesOneRank) {
  expect_matches_single_rank(options(1, 3, PipelineSchedule::one_f_one_b));
}

TEST_F(PipelineTrainer, SameGridTwiceIsBitwiseIdentical) {
  const TrainOptions o = options(2, 3, PipelineSchedule::one_f_one_b);
  const PpRun a = train_on(world(), o);
  const PpRun b = train_on(world(), o);
  expect_bitwise(a.out, b.out, describe(o));
  for (std::size_t e = 0; e < a.rec.epochs.size(); ++e) {
    EXPECT_EQ(a.rec.epochs[e].eval.loss, b.rec.epochs[e].eval.loss);
  }
}

// Trains `first` to `stop` with checkpoints and saves there (a preempted job), then a new
// trainer with `second` (maybe another grid) resumes from the directory and finishes.
Outcome interrupted(const TrainOptions& first, const TrainOptions& second, std::int64_t stop,
                    const std::string& dir) {
  Outcome out;
  {
    const Grid grid(world(), first.pipeline_stages);
    Trainer t(grid, first);
    Checkpointer c(t, checkpoint_options(dir), "[train]\nepochs = 2\n");
    c.resume("none");
    Recorder rec;
    t.train(&rec, stop, &c);
    c.save_now("test");
    c.wait();
    out.steps = rec.steps;
  }
  const Grid grid(world(), second.pipeline_stages);
  Trainer t(grid, second);
  Checkpointer c(t, checkpoint_options(dir), "[train]\nepochs = 2\n");
  const ResumeResult r = c.resume("auto");
  EXPECT_TRUE(r.resumed);
  EXPECT_EQ(r.meta.step, stop);
  EXPECT_EQ(r.meta.pipeline_stages, first.pipeline_stages);
  Recorder rec;
  const TrainSummary s = t.train(&rec, -1, &c);
  c.wait();
  EXPECT_TRUE(s.finished);
  EXPECT_EQ(s.steps, t.planned_steps() - stop);
  out.steps.insert(out.steps.end(), rec.steps.begin(), rec.steps.end());
  add_state(out, t);
  return out;
}

TEST_F(PipelineTrainer, ResumeOnTheSameGridIsBitwise) {
  for (const TrainOptions& o : {options(2, 3, PipelineSchedule::one_f_one_b),
                                adamw(options(2, 2, PipelineSchedule::gpipe))}) {
    const PpRun want = train_on(world(), o);
    for (const std::int64_t stop : {1, 9, 15}) {
      const locus::test::SharedTmpDir dir(world());
      expect_bitwise(interrupted(o, o, stop, dir.path()), want.out,
                     describe(o) + ", stopped at step " + std::to_string(stop));
    }
  }
}

// A checkpoint holds global tensors: pp = 2 -> pp = 1 (all ranks data-parallel) and back
// continue the run; the result differs from the uninterrupted run only by float rounding.
// (Other grids: test_pipeline_state.cpp.)
TEST_F(PipelineTrainer, ResumeOnAnotherGridContinues) {
  const TrainOptions pp = options(2, 3, PipelineSchedule::one_f_one_b);
  const TrainOptions dp = single(pp);
  const PpRun want = train_on(world(), pp);
  for (const auto& [from, to] : {std::pair{pp, dp}, std::pair{dp, pp}}) {
    const locus::test::SharedTmpDir dir(world());
    const Outcome got = interrupted(from, to, 9, dir.path());
    SCOPED_TRACE(describe(from) + " -> " + describe(to));
    EXPECT_TRUE(same_on_all_ranks(world(), got.params));
    expect_close(got.params, want.out.params, "parameters");
    ASSERT_EQ(got.steps.size(), want.out.steps.size());
    EXPECT_EQ(got.optimizer_steps, want.out.optimizer_steps);
    for (std::size_t i = 0; i < got.steps.size(); ++i) {
      EXPECT_EQ(got.steps[i].step, want.out.steps[i].step);
      EXPECT_NEAR(got.steps[i].loss, want.out.steps[i].loss, 1e-4) << "step " << i;
    }
  }
}

// Raises `signal` on the last rank (a later pipeline stage, which holds no loader) after step
// `at` was reported; the other ranks never see it.
struct SignalAt final : TrainObserver {
  SignalAt(std::int64_t at, int signal) : at_(at), signal_(signal) {}
  void on_step(const StepMetrics& m) override {
    if (m.step == at_ && world().rank() == world().size() - 1) std::raise(signal_);
  }
  std::int64_t at_;
  int signal_;
};

// Preemption with pp > 1: every rank stops at the same step boundary with a checkpoint, and
// the resumed run ends bitwise where an uninterrupted one does.
TEST_F(PipelineTrainer, PreemptionSignalCheckpointsAndResumesBitwise) {
  const TrainOptions o = options(2, 3, PipelineSchedule::one_f_one_b);
  const PpRun want = train_on(world(), o);
  const locus::test::SharedTmpDir dir(world());
  CheckpointOptions co = checkpoint_options(dir.path());
  co.signals = parse_signals("USR1");
  const Grid grid(world(), o.pipeline_stages);
  Outcome got;
  {
    const PreemptSignals handlers(co.signals);
    Trainer t(grid, o);
    Checkpointer c(t, co, "");
    c.resume("none");
    ObserverList obs;
    Recorder rec;
    SignalAt sig(7, SIGUSR1);
    obs.add(&rec);
    obs.add(&sig);
    const TrainSummary s = t.train(&obs, -1, &c);
    EXPECT_FALSE(s.finished);
    EXPECT_EQ(c.stopped_by_signal(), SIGUSR1);
    EXPECT_EQ(world().allreduce(t.state().step, MPI_MAX), 7);
    EXPECT_EQ(world().allreduce(t.state().step, MPI_MIN), 7);
    got.steps = rec.steps;
  }
  Trainer t(grid, o);
  Checkpointer c(t, co, "");
  EXPECT_EQ(c.resume("auto").meta.step, 7);
  Recorder rec;
  t.train(&rec, -1, &c);
  got.steps.insert(got.steps.end(), rec.steps.begin(), rec.steps.end());
  add_state(got, t);
  expect_bitwise(got, want.out, "signalled at step 7");
}

TEST_F(PipelineTrainer, InvalidGridsAreAgreedConfigErrors) {
  const Grid grid(world(), world().size());
  TrainOptions o = options(world().size(), 2, PipelineSchedule::one_f_one_b);
  o.model.widths.resize(static_cast<std::size_t>(world().size()));  // world - 1 layers
  o.model.widths.back() = kClasses;
  const std::string more = agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(more.find("use at most"), std::string::npos) << more;
  o = options(world().size(), 0, PipelineSchedule::gpipe);
  const std::string micro = agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(micro.find("train.micro_batches = 0"), std::string::npos) << micro;
  o = options(world().size(), 2, PipelineSchedule::gpipe);
  o.stage_boundaries = {99};  // beyond the last layer (and the wrong count on 4 ranks)
  const std::string bounds = agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(bounds.find("train.stage_boundaries"), std::string::npos) << bounds;
  // NCCL moves GPU buffers: on the cpu backend it is refused, naming the way out; auto and
  // mpi take the MPI link.
  o = options(world().size(), 2, PipelineSchedule::one_f_one_b);
  o.stage_link.backend = comm::LinkBackend::nccl;
  const std::string nccl = agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(nccl.find("train.stage_link = nccl moves GPU buffers between pipeline stages, but "
                      "train.backend = cpu keeps them in host memory: set train.stage_link = "
                      "auto or mpi"),
            std::string::npos)
      << nccl;
  o.stage_link.backend = comm::LinkBackend::automatic;
  const Trainer t(grid, o);
  EXPECT_EQ(t.link_description(), world().size() > 1 ? "mpi" : "");
}

}  // namespace
}  // namespace locus::train::test
