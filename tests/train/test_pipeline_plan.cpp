// The pipeline's plan, checked without training: the balanced partition against brute force
// over every cut, explicit boundaries, the GPipe / 1F1B operation orders (every micro-batch
// once each way, deadlock-free across stages, 1F1B's bounded activations) and the ConfigErrors
// of invalid grids and options, agreed on every rank.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/train/grid.hpp"
#include "locus/train/pipeline/pipeline.hpp"
#include "agreed_error.hpp"

namespace locus::train {
namespace {

using locus::test::agreed_error;

// The balancer's objective, recomputed independently: the most expensive stage, where a stage
// costs its share of FLOPs (layer 0: 4 in*out, others 6 in*out) plus its share of parameters.
double worst_stage(const ParamLayout& layout, const std::vector<int>& cuts) {
  double flops = 0, params = 0;
  std::vector<double> f, p;
  for (int l = 0; l < layout.num_layers(); ++l) {
    const LayerLayout& ly = layout.layer(l);
    f.push_back((l == 0 ? 4.0 : 6.0) * ly.in * ly.out);
    p.push_back(static_cast<double>(ly.end() - ly.begin()));
    flops += f.back();
    params += p.back();
  }
  std::vector<int> ends = cuts;
  ends.push_back(layout.num_layers());
  double worst = 0;
  int first = 0;
  for (const int end : ends) {
    double c = 0;
    for (int l = first; l < end; ++l) c += f[l] / flops + p[l] / params;
    worst = std::max(worst, c);
    first = end;
  }
  return worst;
}

// Every way to cut `layers` into `stages` non-empty contiguous pieces.
void all_cuts(int layers, int stages, std::vector<int>& cur,
              const std::function<void(const std::vector<int>&)>& fn) {
  if (static_cast<int>(cur.size()) == stages - 1) {
    fn(cur);
    return;
  }
  const int from = cur.empty() ? 1 : cur.back() + 1;
  const int left = stages - 1 - static_cast<int>(cur.size());  // boundaries still to place
  for (int b = from; b <= layers - left; ++b) {
    cur.push_back(b);
    all_cuts(layers, stages, cur, fn);
    cur.pop_back();
  }
}

TEST(PipelinePartition, BalancedIsOptimalAgainstBruteForce) {
  const std::vector<std::vector<int>> models = {
      {2048, 2048, 2048, 2048, 2048, 2048, 2048, 2048, 2048},
      {784, 512, 512, 256, 128, 10},
      {10, 300, 20, 300, 20, 300, 4},
      {64, 8, 1024, 1024, 8, 4, 3}};
  for (const auto& widths : models) {
    const ParamLayout layout(widths);
    for (int stages = 1; stages <= layout.num_layers(); ++stages) {
      const StagePartition p(layout, stages);
      ASSERT_EQ(p.stages(), stages);
      EXPECT_TRUE(p.automatic());
      double best = 1e300;
      std::vector<int> cur;
      all_cuts(layout.num_layers(), stages, cur,
               [&](const std::vector<int>& c) { best = std::min(best, worst_stage(layout, c)); });
      EXPECT_NEAR(worst_stage(layout, p.boundaries()), best, 1e-12)
          << format_widths(widths) << " in " << stages << " stages: " << p.describe();
      // The ranges tile the layers and the parameter buffer.
      EXPECT_EQ(p.stage(0).first_layer, 0);
      EXPECT_EQ(p.stage(0).begin, 0u);
      EXPECT_EQ(p.stage(stages - 1).end_layer, layout.num_layers());
      EXPECT_EQ(p.stage(stages - 1).end, layout.size());
      for (int s = 1; s < stages; ++s) {
        EXPECT_EQ(p.stage(s).first_layer, p.stage(s - 1).end_layer);
        EXPECT_EQ(p.stage(s).begin, p.stage(s - 1).end);
        EXPECT_GE(p.stage(s).layers(), 1);
      }
    }
  }
}

TEST(PipelinePartition, DeepMlpSplitsInHalves) {
  // Eight equal layers: layer 0 is cheaper (it sends no input gradient), but a fifth layer
  // would make stage 0 the bottleneck; 4 + 4 is the balance.
  const ParamLayout layout(std::vector<int>(9, 2048));
  const StagePartition p(layout, 2);
  EXPECT_EQ(p.boundaries(), std::vector<int>{4});
  EXPECT_NE(p.describe().find("stage 1: layers 4-7"), std::string::npos) << p.describe();
}

TEST(PipelinePartition, ExplicitBoundaries) {
  const ParamLayout layout(std::vector<int>{10, 24, 16, 12, 4});
  const std::vector<int> b = parse_stage_boundaries(" 1, 3");
  const StagePartition p(layout, 3, b);
  EXPECT_FALSE(p.automatic());
  EXPECT_EQ(p.boundaries(), b);
  EXPECT_EQ(p.stage(1).first_layer, 1);
  EXPECT_EQ(p.stage(1).end_layer, 3);
  EXPECT_EQ(p.stage(1).begin, layout.layer(1).begin());
  EXPECT_EQ(p.stage(1).end, layout.layer(2).end());
  EXPECT_TRUE(parse_stage_boundaries("").empty());
  EXPECT_THROW(parse_stage_boundaries("1,x"), ConfigError);
  EXPECT_THROW(parse_stage_boundaries("1,,2"), ConfigError);
}

TEST(PipelinePartition, InvalidPartitionsAreConfigErrors) {
  const ParamLayout layout(std::vector<int>{10, 24, 16, 4});  // 3 layers
  const auto message = [&](int stages, std::vector<int> b) {
    try {
      StagePartition p(layout, stages, b);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message(4, {}).find("use at most 3 stages"), std::string::npos) << message(4, {});
  EXPECT_NE(message(0, {}).find("pipeline_stages = 0"), std::string::npos);
  EXPECT_NE(message(3, {1}).find("give 2 boundaries"), std::string::npos) << message(3, {1});
  EXPECT_NE(message(2, {0}).find("increase strictly"), std::string::npos);
  EXPECT_NE(message(2, {3}).find("increase strictly"), std::string::npos);
  EXPECT_NE(message(3, {2, 2}).find("increase strictly"), std::string::npos);
  EXPECT_NE(message(1, {1}).find("give 0 boundaries"), std::string::npos);
}

TEST(PipelineOptionsTest, Validation) {
  PipelineOptions o;
  EXPECT_NO_THROW(validate(o));
  o.micro_batches = 0;
  EXPECT_THROW(validate(o), ConfigError);
  EXPECT_EQ(parse_pipeline_schedule("gpipe"), PipelineSchedule::gpipe);
  EXPECT_EQ(parse_pipeline_schedule("1f1b"), PipelineSchedule::one_f_one_b);
  EXPECT_EQ(to_string(PipelineSchedule::one_f_one_b), "1f1b");
  EXPECT_THROW(parse_pipeline_schedule("zero-bubble"), ConfigError);
}

// Runs every stage's op list against the others, each stage blocking as the engine does: a
// forward waits for the previous stage's forward of that micro-batch, a backward for the next
// stage's backward. Returns false on a deadlock.
bool schedules_complete(PipelineSchedule sched, int stages, int micro) {
  std::vector<std::vector<PipelineOp>> ops;
  for (int s = 0; s < stages; ++s) ops.push_back(pipeline_ops(sched, stages, s, micro));
  std::vector<std::size_t> pc(static_cast<std::size_t>(stages), 0);
  std::vector<std::vector<char>> fwd(stages, std::vector<char>(micro, 0)), bwd = fwd;
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      auto& i = pc[static_cast<std::size_t>(s)];
      if (i == ops[s].size()) continue;
      const PipelineOp op = ops[s][i];
      const bool ready =
          op.kind == PipelineOp::forward
              ? s == 0 || fwd[s - 1][op.micro_batch]
              : fwd[s][op.micro_batch] && (s + 1 == stages || bwd[s + 1][op.micro_batch]);
      if (!ready) continue;
      (op.kind == PipelineOp::forward ? fwd : bwd)[s][op.micro_batch] = 1;
      ++i;
      progress = true;
    }
  }
  for (int s = 0; s < stages; ++s) {
    if (pc[static_cast<std::size_t>(s)] != ops[s].size()) return false;
  }
  return true;
}

TEST(PipelineSchedules, EveryMicroBatchOnceEachWayAndNoDeadlock) {
  for (const auto sched : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
    for (int stages = 1; stages <= 5; ++stages) {
      for (int micro = 1; micro <= 9; ++micro) {
        for (int s = 0; s < stages; ++s) {
          const auto ops = pipeline_ops(sched, stages, s, micro);
          ASSERT_EQ(ops.size(), 2u * static_cast<std::size_t>(micro));
          std::vector<int> f(micro, -1), b(micro, -1), border;
          for (std::size_t i = 0; i < ops.size(); ++i) {
            auto& slot = ops[i].kind == PipelineOp::forward ? f : b;
            ASSERT_EQ(slot[ops[i].micro_batch], -1) << "op repeated";
            slot[ops[i].micro_batch] = static_cast<int>(i);
            if (ops[i].kind == PipelineOp::backward) border.push_back(ops[i].micro_batch);
          }
          for (int m = 0; m < micro; ++m) EXPECT_LT(f[m], b[m]) << "backward before forward";
          // Gradients accumulate in micro-batch order under both schedules: same bits.
          EXPECT_TRUE(std::is_sorted(border.begin(), border.end()));
          const int peak = peak_live(ops);
          if (sched == PipelineSchedule::one_f_one_b) {
            EXPECT_LE(peak, std::min(stages - s, micro)) << "stage " << s << " of " << stages;
          } else {
            EXPECT_EQ(peak, micro);
          }
        }
        EXPECT_TRUE(schedules_complete(sched, stages, micro))
            << to_string(sched) << " deadlocks with " << stages << " stages, " << micro
            << " micro-batches";
      }
    }
  }
}

TEST(PipelineGrid, WorldNotDivisibleIsAConfigError) {
  const mpi::Comm world = mpi::Comm::world();
  try {
    Grid g(world, 3);  // 2 and 4 ranks: 3 divides neither
    ADD_FAILURE() << "a grid of 3 stages on " << world.size() << " ranks was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("pipeline_stages = 3 does not divide"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(Grid(world, 0), ConfigError);
}

TEST(PipelineGrid, MoreStagesThanLayersIsAnAgreedConfigError) {
  const mpi::Comm world = mpi::Comm::world();
  const Grid grid(world, world.size());
  ModelSpec spec;
  spec.widths.assign(static_cast<std::size_t>(world.size()), 6);  // world.size() - 1 layers
  std::vector<float> params(ParamLayout(spec.widths).size()), grads(params.size());
  const std::string msg = agreed_error<ConfigError>([&] {
    PipelineStage stage(grid, spec, Loss::softmax_cross_entropy, {}, {params, grads});
  });
  EXPECT_NE(msg.find(fmt::format("use at most {} stages", world.size() - 1)), std::string::npos)
      << msg;
}

TEST(PipelineGrid, MicroBatchesBelowOneIsAnAgreedConfigError) {
  const mpi::Comm world = mpi::Comm::world();
  const Grid grid(world, 2);
  ModelSpec spec;
  spec.widths = {6, 5, 4};
  PipelineOptions o;
  o.micro_batches = 0;
  const StagePartition p(ParamLayout(spec.widths), 2);
  std::vector<float> params(p.stage(grid.stage()).size()), grads(params.size());
  const std::string msg = agreed_error<ConfigError>([&] {
    PipelineStage stage(grid, spec, Loss::softmax_cross_entropy, o, {params, grads});
  });
  EXPECT_NE(msg.find("train.micro_batches = 0"), std::string::npos) << msg;
  o.micro_batches = 2;
  o.stage_boundaries = {0};
  const std::string bad = agreed_error<ConfigError>([&] {
    PipelineStage stage(grid, spec, Loss::softmax_cross_entropy, o, {params, grads});
  });
  EXPECT_NE(bad.find("train.stage_boundaries = 0"), std::string::npos) << bad;
}

}  // namespace
}  // namespace locus::train
