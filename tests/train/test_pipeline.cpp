// Pipeline-parallel training against a 1-rank run of the same global batches: pp = 2 (2 ranks),
// pp = 2 x dp = 2 and pp = 4 (4 ranks), plus pp = 1 (micro-batching alone), under GPipe and
// 1F1B with SGD and AdamW, dropout, clipping, mse, empty micro-batches; bitwise
// reproducibility, schedule independence, bounded 1F1B activations and evaluation; and the
// pipeline's transfers under the NCCL link's ordering rules (in_order_link.hpp).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include "agreed_error.hpp"
#include "in_order_link.hpp"
#include "locus/comm/mpi.hpp"
#include "locus/train/model/backward.hpp"
#include "locus/train/optim/clip.hpp"
#include "locus/train/compute.hpp"
#include "locus/train/grid.hpp"
#include "locus/train/optim/optimizer.hpp"
#include "locus/train/pipeline/pipeline.hpp"
#include "locus/train/train_state.hpp"

namespace locus::train {
namespace {

constexpr int kSamples = 72;
const std::vector<int> kWidths{10, 24, 16, 12, 4};  // 4 layers: up to 4 stages

// A sample is a pure function of its id (as a dataset row would be).
void sample(std::uint64_t id, float* x, std::int32_t* label) {
  for (int k = 0; k < kWidths.front(); ++k) {
    x[k] = static_cast<float>(std::sin(0.37 * static_cast<double>(id) + 1.3 * k));
  }
  *label = static_cast<std::int32_t>((id * 7) % static_cast<std::uint64_t>(kWidths.back()));
}

// The global batch of a step: a shuffled window over the sample ids (same on every rank).
std::vector<std::uint64_t> global_ids(std::int64_t step, int batch) {
  std::vector<std::uint64_t> perm(kSamples);
  std::iota(perm.begin(), perm.end(), 0);
  const int per_epoch = kSamples / batch;
  std::uint64_t s = 12345 + static_cast<std::uint64_t>(step / per_epoch);
  for (int i = kSamples - 1; i > 0; --i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(perm[static_cast<std::size_t>(i)],
              perm[(s >> 33) % static_cast<std::uint64_t>(i + 1)]);
  }
  const auto first = static_cast<std::size_t>(step % per_epoch) * static_cast<std::size_t>(batch);
  return {perm.begin() + static_cast<std::ptrdiff_t>(first),
          perm.begin() + static_cast<std::ptrdiff_t>(first) + batch};
}

struct RunSetup {
  int stages = 2;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int micro = 3;
  OptimizerOptions opt;
  Activation act = Activation::relu;
  float dropout = 0.0f;
  Loss loss = Loss::softmax_cross_entropy;
  double clip = 0;  // > 0: clip the global gradient norm to this
  int steps = 6;
  int batch = 18;  // global rows per step; dp = 2 gets 9 each, split 3/3/3 or 2/2/2/3
  // The stage link (null: the backend's, MPI) and whether each step also evaluates its batch.
  decltype(comm::LinkOptions::factory) link;
  bool evaluate = false;
};

ModelSpec spec_of(const RunSetup& s) { return ModelSpec{kWidths, s.act, Init::he, s.dropout, 5}; }
double lr_of(const RunSetup& s) { return s.opt.kind == OptimizerKind::sgd ? 0.1 : 0.01; }

// Rows [begin, end) of a step's global batch.
struct Rows {
  std::vector<float> x, targets;
  std::vector<std::int32_t> labels;
  std::vector<std::uint64_t> ids;
  int rows = 0;
};

Rows rows_of(const RunSetup& s, std::int64_t step, int begin, int end) {
  const std::vector<std::uint64_t> all = global_ids(step, s.batch);
  Rows r;
  r.rows = end - begin;
  r.ids.assign(all.begin() + begin, all.begin() + end);
  r.x.resize(static_cast<std::size_t>(r.rows) * kWidths.front());
  r.labels.resize(static_cast<std::size_t>(r.rows));
  for (int i = 0; i < r.rows; ++i) {
    sample(r.ids[static_cast<std::size_t>(i)], r.x.data() + i * kWidths.front(),
           r.labels.data() + i);
  }
  if (s.loss == Loss::mse) {
    r.targets.assign(static_cast<std::size_t>(r.rows) * kWidths.back(), 0.0f);
    for (int i = 0; i < r.rows; ++i) {
      r.targets[static_cast<std::size_t>(i * kWidths.back() +
                                         r.labels[static_cast<std::size_t>(i)])] = 1.0f;
    }
  }
  return r;
}

struct RunResult {
  std::vector<float> slice;      // this stage's parameters at the end
  std::vector<LossStats> stats;  // per step (pipeline: this replica's rows)
  std::vector<LossStats> evals;  // per step with RunSetup::evaluate, after its update
  int peak_live = 0;
  std::size_t peak_bytes = 0;
};

RunResult run_pipeline(const Grid& grid, const RunSetup& s) {
  Mlp model(spec_of(s));
  PipelineOptions po;
  po.micro_batches = s.micro;
  po.schedule = s.schedule;
  po.link.factory = s.link;
  const StageRange r = StagePartition(model.layout(), grid.pipeline_stages()).stage(grid.stage());
  const std::span<float> params = model.params().subspan(r.begin, r.size());
  std::vector<float> grads(r.size());
  auto opt = make_optimizer(s.opt, r.size());
  PipelineStage stage(grid, model.spec(), s.loss, po, {params, grads});
  EXPECT_EQ(stage.range().begin, r.begin);
  const int dp = grid.data_parallel(), d = grid.dp_rank();
  RunResult run;
  for (std::int64_t step = 0; step < s.steps; ++step) {
    const Rows rows =
        grid.stage() == 0 ? rows_of(s, step, d * s.batch / dp, (d + 1) * s.batch / dp) : Rows{};
    const PipelineBatch b{rows.x, rows.rows, rows.labels, rows.targets, rows.ids};
    run.stats.push_back(stage.train_step(b, static_cast<std::uint64_t>(step), s.batch));
    const float scale = s.clip > 0 ? clip_factor(stage.grad_norm(), s.clip) : 1.0f;
    opt->step(params, grads, lr_of(s), scale);
    if (s.evaluate) run.evals.push_back(stage.evaluate(b));
  }
  run.slice.assign(params.begin(), params.end());
  run.peak_live = stage.peak_live_micro_batches();
  run.peak_bytes = stage.peak_activation_bytes();
  return run;
}

// The same steps on one rank, whole batches, the unpartitioned model.
RunResult run_serial(const RunSetup& s, std::size_t begin, std::size_t end) {
  Mlp model(spec_of(s));
  Workspace ws(model, s.batch);
  std::vector<float> grads(model.layout().size());
  auto opt = make_optimizer(s.opt, grads.size());
  RunResult run;
  for (std::int64_t step = 0; step < s.steps; ++step) {
    const Rows rows = rows_of(s, step, 0, s.batch);
    const Batch b{rows.x, rows.rows, rows.labels, rows.targets, rows.ids};
    LossStats st =
        forward_backward(model, ws, s.loss, b, static_cast<std::uint64_t>(step), s.batch, grads);
    if (s.loss == Loss::mse) {
      st.correct = count_correct(ws.output(), rows.rows, kWidths.back(), rows.labels);
    }
    run.stats.push_back(st);
    const float scale = s.clip > 0 ? clip_factor(global_grad_norm(grads), s.clip) : 1.0f;
    opt->step(model.params(), grads, lr_of(s), scale);
  }
  run.slice.assign(model.params().begin() + static_cast<std::ptrdiff_t>(begin),
                   model.params().begin() + static_cast<std::ptrdiff_t>(end));
  return run;
}

const mpi::Comm& world() {
  static const mpi::Comm w = mpi::Comm::world();
  return w;
}

// The stage counts this world size can hold: pp alone, and pp x dp.
std::vector<int> stage_counts() {
  std::vector<int> out{1};
  for (int s = 2; s <= world().size() && s <= static_cast<int>(kWidths.size()) - 1; s *= 2) {
    out.push_back(s);
  }
  return out;
}

std::string name(const Grid& g, const RunSetup& s) {
  return fmt::format("{} x {} micro-batches, {}", g.describe(), s.micro, to_string(s.schedule));
}

// The replica's per-step stats summed over dp (the global batch's sums).
LossStats global(const Grid& g, const LossStats& st) {
  double v[3] = {st.loss_sum, static_cast<double>(st.correct), static_cast<double>(st.rows)};
  g.dp().allreduce_inplace(std::span<double>(v), MPI_SUM);
  return {v[0], static_cast<std::int64_t>(v[1]), static_cast<std::int64_t>(v[2])};
}

// Replicas of a stage must agree bit for bit; the stage must match the serial run to rounding
// (micro-batch gradients add up in another order than one batch's); training must have moved.
void expect_matches_serial(const Grid& g, const RunSetup& s, const RunResult& pp) {
  SCOPED_TRACE(name(g, s));
  const StageRange r = StagePartition(ParamLayout(kWidths), g.pipeline_stages()).stage(g.stage());
  const RunResult serial = run_serial(s, r.begin, r.end);
  std::vector<float> lo = pp.slice, hi = pp.slice;
  g.dp().allreduce_inplace(std::span<float>(lo), MPI_MIN);
  g.dp().allreduce_inplace(std::span<float>(hi), MPI_MAX);
  EXPECT_EQ(lo, hi) << "data-parallel replicas of stage " << g.stage() << " disagree";
  const Mlp init(spec_of(s));
  double moved = 0;
  ASSERT_EQ(pp.slice.size(), serial.slice.size());
  for (std::size_t i = 0; i < pp.slice.size(); ++i) {
    const float q = serial.slice[i];
    moved = std::max(moved, std::abs(static_cast<double>(q) - init.params()[r.begin + i]));
    ASSERT_NEAR(pp.slice[i], q, 1e-5 + 1e-4 * std::abs(q)) << "parameter " << r.begin + i;
  }
  EXPECT_GT(moved, 1e-3) << "training did not move stage " << g.stage();
  for (std::size_t k = 0; k < pp.stats.size(); ++k) {
    const LossStats all = global(g, pp.stats[k]);
    const LossStats& ref = serial.stats[k];
    EXPECT_EQ(all.rows, ref.rows) << "step " << k;
    EXPECT_NEAR(all.loss_sum, ref.loss_sum, 1e-5 * std::abs(ref.loss_sum)) << "step " << k;
    // Later steps run on parameters equal only to rounding: an argmax could tie-break apart.
    if (k == 0) {
      EXPECT_EQ(all.correct, ref.correct);
    }
    EXPECT_NEAR(static_cast<double>(all.correct), static_cast<double>(ref.correct), 1.0);
  }
}

void check_all_grids(RunSetup s) {
  for (const int stages : stage_counts()) {
    const Grid g(world(), stages);
    for (const auto sched : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
      s.stages = stages;
      s.schedule = sched;
      expect_matches_serial(g, s, run_pipeline(g, s));
    }
  }
}

TEST(Pipeline, SgdNesterovWithDropoutAndClippingMatchesSerial) {
  RunSetup s;
  s.opt.momentum = 0.9;
  s.opt.nesterov = true;
  s.opt.weight_decay = 1e-4;
  s.dropout = 0.2f;
  s.clip = 0.8;
  check_all_grids(s);
}

TEST(Pipeline, AdamWMatchesSerial) {
  RunSetup s;
  s.opt.kind = OptimizerKind::adamw;
  s.opt.weight_decay = 0.01;
  s.act = Activation::gelu;
  s.dropout = 0.1f;
  s.micro = 4;  // uneven micro-batches: 9 rows as 2/2/2/3
  check_all_grids(s);
}

TEST(Pipeline, MseWithTanhMatchesSerial) {
  RunSetup s;
  s.loss = Loss::mse;
  s.act = Activation::tanh;
  s.micro = 2;
  check_all_grids(s);
}

TEST(Pipeline, EmptyMicroBatchesMatchSerial) {
  RunSetup s;  // 4 rows per step: a replica of dp = 2 has 2 rows for 3 micro-batches
  s.batch = 4;
  s.micro = 3;
  s.opt.momentum = 0.5;
  check_all_grids(s);
}

// One micro-batch runs the very sgemm shapes of the unpartitioned model: with one replica the
// pipeline must reproduce the serial bits.
TEST(Pipeline, OneMicroBatchOneReplicaIsBitwiseSerial) {
  for (const int stages : stage_counts()) {
    if (world().size() / stages != 1) continue;
    const Grid g(world(), stages);
    RunSetup s;
    s.micro = 1;
    s.opt.kind = OptimizerKind::adamw;
    s.act = Activation::gelu;
    s.dropout = 0.1f;
    const RunResult pp = run_pipeline(g, s);
    const StageRange r = StagePartition(ParamLayout(kWidths), stages).stage(g.stage());
    EXPECT_EQ(pp.slice, run_serial(s, r.begin, r.end).slice) << name(g, s);
  }
}

TEST(Pipeline, ReproducibleAndIndependentOfTheSchedule) {
  for (const int stages : stage_counts()) {
    const Grid g(world(), stages);
    RunSetup s;
    s.opt.kind = OptimizerKind::adamw;
    s.dropout = 0.2f;
    s.micro = 4;
    s.schedule = PipelineSchedule::one_f_one_b;
    const RunResult a = run_pipeline(g, s);
    const RunResult b = run_pipeline(g, s);
    EXPECT_EQ(a.slice, b.slice) << "same grid, same config: " << name(g, s);
    s.schedule = PipelineSchedule::gpipe;
    const RunResult c = run_pipeline(g, s);
    // Both schedules add the micro-batch gradients in the same order.
    EXPECT_EQ(a.slice, c.slice) << "1f1b against gpipe: " << name(g, s);
    for (std::size_t k = 0; k < a.stats.size(); ++k) {
      EXPECT_EQ(a.stats[k].loss_sum, b.stats[k].loss_sum);
      EXPECT_EQ(a.stats[k].loss_sum, c.stats[k].loss_sum);
    }
  }
}

TEST(Pipeline, OneFOneBBoundsLiveActivations) {
  for (const int stages : stage_counts()) {
    if (stages == 1) continue;
    const Grid g(world(), stages);
    RunSetup s;
    s.micro = 8;
    s.batch = 72;
    s.steps = 2;
    s.schedule = PipelineSchedule::one_f_one_b;
    const RunResult one = run_pipeline(g, s);
    s.schedule = PipelineSchedule::gpipe;
    const RunResult all = run_pipeline(g, s);
    SCOPED_TRACE(name(g, s));
    EXPECT_LE(one.peak_live, stages) << "stage " << g.stage();
    EXPECT_GE(one.peak_live, 1);
    EXPECT_EQ(all.peak_live, s.micro) << "stage " << g.stage();
    EXPECT_LT(one.peak_bytes, all.peak_bytes) << "stage " << g.stage();
    EXPECT_EQ(one.slice, all.slice);
  }
}

TEST(Pipeline, EvaluateMatchesSerialForward) {
  for (const int stages : stage_counts()) {
    const Grid g(world(), stages);
    RunSetup s;
    s.act = Activation::gelu;
    s.dropout = 0.3f;  // evaluation runs without dropout
    s.batch = 36;
    s.micro = 5;
    const Mlp model(spec_of(s));
    const StageRange r = StagePartition(model.layout(), stages).stage(g.stage());
    std::vector<float> params(model.params().begin() + static_cast<std::ptrdiff_t>(r.begin),
                              model.params().begin() + static_cast<std::ptrdiff_t>(r.end));
    std::vector<float> grads(r.size());
    PipelineOptions po;
    po.micro_batches = s.micro;
    PipelineStage stage(g, model.spec(), s.loss, po, {params, grads});
    const int dp = g.data_parallel(), d = g.dp_rank();
    const Rows rows =
        g.stage() == 0 ? rows_of(s, 1, d * s.batch / dp, (d + 1) * s.batch / dp) : Rows{};
    const LossStats got = global(g, stage.evaluate({rows.x, rows.rows, rows.labels, {}, {}}));
    const Rows all = rows_of(s, 1, 0, s.batch);
    Workspace ws(model, s.batch, Mode::inference);
    const auto logits = forward(model, all.x, all.rows, ws);
    const LossStats ref =
        softmax_cross_entropy(logits, all.rows, kWidths.back(), all.labels, {}, 1.0);
    EXPECT_EQ(got.rows, ref.rows);
    EXPECT_NEAR(got.loss_sum, ref.loss_sum, 1e-5 * std::abs(ref.loss_sum));
    EXPECT_EQ(got.correct, ref.correct);
  }
}

// The NCCL stage link runs only on GPUs. Its ordering rules -- a channel per tag running its
// transfers in issue order, a send done only once the peer's receive runs, receives issued
// where they are waited for and in posting order, a host-side rendezvous at each first
// transfer -- are kept by a model over host buffers (in_order_link.hpp). Under it every grid,
// schedule and micro-batch count this world holds (one micro-batch, fewer than the stages,
// more; empty ones) must complete its training steps (dropout; mse targets) and evaluations --
// a deadlock aborts the job naming the transfer waited for -- with the bits of the MPI link,
// each stage having connected each neighbour once per direction.
TEST(Pipeline, StepsUnderTheNcclLinksOrderingCompleteBitwiseAsOverMpi) {
  for (const int stages : stage_counts()) {
    if (stages == 1) continue;
    const Grid g(world(), stages);
    for (const auto sched : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
      for (const int micro : {1, stages - 1, stages + 1}) {
        for (const bool mse : {false, true}) {
          RunSetup s;
          s.stages = stages;
          s.schedule = sched;
          s.micro = micro;
          s.steps = 3;
          s.evaluate = true;
          if (mse) {
            s.loss = Loss::mse;
            s.act = Activation::tanh;
            s.batch = 4;  // 2 rows a replica at dp = 2: empty micro-batches
          } else {
            s.opt.kind = OptimizerKind::adamw;
            s.dropout = 0.2f;
          }
          SCOPED_TRACE(fmt::format("{}, {}", name(g, s), mse ? "mse" : "cross-entropy"));
          const RunResult over_mpi = run_pipeline(g, s);
          auto log = std::make_shared<test::InOrderLog>();
          s.link = [log](const mpi::Comm& pp, std::span<const int> tags) {
            return std::make_unique<test::InOrderLink>(pp, tags, log);
          };
          const RunResult in_order = run_pipeline(g, s);
          EXPECT_EQ(in_order.slice, over_mpi.slice);
          ASSERT_EQ(in_order.stats.size(), over_mpi.stats.size());
          ASSERT_EQ(in_order.evals.size(), over_mpi.evals.size());
          for (std::size_t k = 0; k < in_order.stats.size(); ++k) {
            EXPECT_EQ(in_order.stats[k].loss_sum, over_mpi.stats[k].loss_sum) << "step " << k;
            EXPECT_EQ(in_order.stats[k].rows, over_mpi.stats[k].rows) << "step " << k;
            EXPECT_EQ(in_order.evals[k].loss_sum, over_mpi.evals[k].loss_sum) << "step " << k;
            EXPECT_EQ(in_order.evals[k].correct, over_mpi.evals[k].correct) << "step " << k;
          }
          const bool end = g.stage() == 0 || g.stage() == stages - 1;
          EXPECT_EQ(log->connects.load(), end ? 2 : 4) << "stage " << g.stage();
          EXPECT_GT(log->sends.load(), 0);
          EXPECT_GT(log->receives.load(), 0);
        }
      }
    }
  }
}

// The trainer's backend: a TrainState of the stage's layers only (parameters, gradients and
// optimizer state all the stage's size, together exactly the model), trained like a serial
// run to rounding, replicas bitwise alike; a whole state is refused (agreed).
TEST(Pipeline, ComputeBackendTrainsAStageSizedState) {
  for (const int stages : stage_counts()) {
    if (stages == 1) continue;
    const Grid g(world(), stages);
    RunSetup s;
    s.opt.kind = OptimizerKind::adamw;
    s.micro = 3;
    const ParamLayout layout(kWidths);
    const StageRange r = StagePartition(layout, stages).stage(g.stage());
    TrainState state(spec_of(s), s.opt, r.held());
    PipelineOptions po;
    po.micro_batches = s.micro;
    PipelineCompute compute(g, state, s.loss, po);
    SCOPED_TRACE(name(g, s));
    EXPECT_EQ(state.model.offset(), r.begin);
    EXPECT_EQ(state.model.params().size(), r.size());
    EXPECT_EQ(compute.grads().size, r.size());
    const auto buffers = std::as_const(*state.optimizer).state();
    ASSERT_EQ(buffers.size(), 2u);
    for (const auto& b : buffers) EXPECT_EQ(b.data.size(), r.size()) << b.name;
    EXPECT_EQ(g.pp().allreduce(static_cast<std::uint64_t>(state.model.params().size()), MPI_SUM),
              layout.size());
    const int dp = g.data_parallel(), d = g.dp_rank();
    for (std::int64_t step = 0; step < s.steps; ++step) {
      const Rows rows =
          g.stage() == 0 ? rows_of(s, step, d * s.batch / dp, (d + 1) * s.batch / dp) : Rows{};
      compute.forward_backward({rows.x, rows.rows, rows.labels, {}, rows.ids},
                               static_cast<std::uint64_t>(step), s.batch, {});
      compute.optimizer_step(lr_of(s), 0.0);
    }
    EXPECT_EQ(state.optimizer->steps(), s.steps);
    const auto p = state.model.params();
    std::vector<float> lo(p.begin(), p.end()), hi = lo;
    g.dp().allreduce_inplace(std::span<float>(lo), MPI_MIN);
    g.dp().allreduce_inplace(std::span<float>(hi), MPI_MAX);
    EXPECT_EQ(lo, hi) << "data-parallel replicas of stage " << g.stage() << " disagree";
    const RunResult serial = run_serial(s, r.begin, r.end);
    ASSERT_EQ(p.size(), serial.slice.size());
    for (std::size_t i = 0; i < p.size(); ++i) {
      ASSERT_NEAR(p[i], serial.slice[i], 1e-5 + 1e-4 * std::abs(serial.slice[i]))
          << "parameter " << r.begin + i;
    }
    TrainState whole(spec_of(s), s.opt);
    const std::string what = locus::test::agreed_error<ConfigError>(
        [&] { PipelineCompute wrong(g, whole, s.loss, po); });
    EXPECT_NE(what.find("holds layers [0, 4)"), std::string::npos) << what;
  }
}

}  // namespace
}  // namespace locus::train
