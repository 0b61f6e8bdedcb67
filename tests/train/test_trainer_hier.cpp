// The trainer with train.reduction = hierarchical at 1, 2 and 4 ranks: with nodes of
// consecutive ranks (LOCUS_TEST_RANKS_PER_NODE=2) bitwise the flat run's weights and metrics;
// with interleaved nodes (Slurm node names alternating by rank) too, as the grid renumbers the
// ranks node by node; a run stopped and restored continues bit for bit; the start-up
// description says which reduction runs and why. (The reducer's node-by-node order for
// interleaved nodes is tested in tests/comm/test_hier_reducer.cpp.)
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "test_trainer_util.hpp"
#include "scoped_env.hpp"

using locus::test_support::ScopedEnv;

namespace locus::train::test {
namespace {

const mpi::Comm& world() {
  static const mpi::Comm w = mpi::Comm::world();
  return w;
}


class TrainerHier : public WorldDataSuite {};

struct HierRun {
  std::vector<float> params;
  Recorder rec;
  std::string reduction;
};

HierRun train_with(comm::Reduction reduction, TrainOptions o) {
  o.reducer.reduction = reduction;
  const Grid grid(world(), 1);
  Trainer t(grid, o);
  HierRun r;
  r.reduction = t.reduction_description();
  t.train(&r.rec);
  const auto p = t.state().model.params();
  r.params.assign(p.begin(), p.end());
  return r;
}

void expect_same_metrics(const HierRun& a, const HierRun& b) {
  ASSERT_EQ(a.rec.steps.size(), b.rec.steps.size());
  ASSERT_FALSE(a.rec.steps.empty());
  for (std::size_t i = 0; i < a.rec.steps.size(); ++i) {
    EXPECT_EQ(a.rec.steps[i].loss, b.rec.steps[i].loss) << "interval " << i;   // bitwise
    EXPECT_EQ(a.rec.steps[i].grad_norm, b.rec.steps[i].grad_norm) << "interval " << i;
  }
}

// Stops at `stop`, restores the state into a new trainer and finishes: the weights must equal
// the uninterrupted run's bit for bit.
void expect_resumes(TrainOptions o, const HierRun& straight, std::int64_t stop) {
  o.reducer.reduction = comm::Reduction::hierarchical;
  const Grid grid(world(), 1);
  Trainer first(grid, o);
  first.train(nullptr, stop);
  Trainer second(grid, o);
  second.state().assign(first.state());
  EXPECT_TRUE(second.train().finished);
  const auto p = second.state().model.params();
  EXPECT_EQ(std::vector<float>(p.begin(), p.end()), straight.params)
      << "resumed at step " << stop << " but ended elsewhere";
}

TEST_F(TrainerHier, ConsecutiveNodesTrainBitwiseAsFlat) {
  ScopedEnv nodes("LOCUS_TEST_RANKS_PER_NODE", "2");
  TrainOptions o = small_options(data());
  o.model.dropout = 0.2f;
  o.clip_max_norm = 0.5;   // the global norm of the reduced gradient
  const HierRun flat = train_with(comm::Reduction::flat, o);
  const HierRun hier = train_with(comm::Reduction::hierarchical, o);
  EXPECT_EQ(hier.reduction.rfind("hierarchical (train.reduction = hierarchical:", 0), 0u)
      << hier.reduction;
  EXPECT_NE(hier.reduction.find("bitwise equal to flat"), std::string::npos) << hier.reduction;
  EXPECT_EQ(hier.params, flat.params) << "hierarchical and flat weights differ";
  EXPECT_TRUE(same_on_all_ranks(world(), hier.params));
  expect_same_metrics(hier, flat);
  // auto picks hierarchical here at 4 ranks (2 nodes of 2), flat at 1 and 2 (one node).
  const HierRun automatic = train_with(comm::Reduction::automatic, o);
  EXPECT_EQ(automatic.reduction.rfind(world().size() > 2 ? "hierarchical" : "flat", 0), 0u)
      << automatic.reduction;
  EXPECT_EQ(automatic.params, flat.params);
  expect_resumes(o, hier, 9);   // mid-epoch 0
}

// Interleaved nodes (Slurm node names alternate by rank: ranks 0,2 and 1,3). The grid numbers
// the ranks node by node (0,2,1,3), so the data-parallel group's nodes are consecutive again:
// hierarchical is bitwise flat here too (flat sums in the grid's order), and deterministic.
TEST_F(TrainerHier, InterleavedNodesAreRenumberedAndStayBitwiseFlat) {
  if (world().size() < 4) GTEST_SKIP() << "needs 4 ranks for 2 interleaved nodes of 2";
  ScopedEnv test("LOCUS_TEST_RANKS_PER_NODE", nullptr);
  const std::string name = "node" + std::to_string(world().rank() % 2);
  ScopedEnv slurm("SLURMD_NODENAME", name.c_str());
  {
    const Grid grid(world(), 1);
    const int expected[] = {0, 2, 1, 3};   // world rank -> grid rank
    EXPECT_EQ(grid.world().rank(), expected[world().rank()]);
  }
  TrainOptions o = small_options(data());
  o.optimizer = {};
  o.optimizer.kind = OptimizerKind::adamw;
  o.schedule.base_lr = 0.01;
  const HierRun a = train_with(comm::Reduction::hierarchical, o);
  const HierRun b = train_with(comm::Reduction::hierarchical, o);
  EXPECT_NE(a.reduction.find("bitwise equal to flat"), std::string::npos) << a.reduction;
  EXPECT_EQ(a.params, b.params) << "two hierarchical runs differ";
  EXPECT_TRUE(same_on_all_ranks(world(), a.params));
  expect_same_metrics(a, b);
  const HierRun flat = train_with(comm::Reduction::flat, o);
  EXPECT_EQ(a.params, flat.params);
  expect_resumes(o, a, 15);   // at the epoch boundary
}

}  // namespace
}  // namespace locus::train::test
