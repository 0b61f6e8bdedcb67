// The process grid's placement: pipeline stages inside a node and replicas across nodes when
// the stages divide every node's ranks (renumbering interleaved nodes), world order and a
// note when they do not; at 4 ranks through comm::Topology (LOCUS_TEST_RANKS_PER_NODE, Slurm
// node names), and as a pure function for layouts one host cannot play.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "locus/train/grid.hpp"
#include "scoped_env.hpp"

using locus::test_support::ScopedEnv;

namespace locus::train {
namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Every rank of pp (one replica) sits on this rank's node.
bool replica_on_one_node(const Grid& g, int my_node) {
  const std::vector<int> nodes = g.pp().allgather(my_node);
  for (const int n : nodes)
    if (n != my_node) return false;
  return true;
}

TEST(GridPlacement, BlocksKeepWorldOrder) {
  const GridPlacement p = place_grid({0, 0, 1, 1}, 2);
  EXPECT_TRUE(p.node_local);
  EXPECT_EQ(p.position, (std::vector<int>{0, 1, 2, 3}));
}

TEST(GridPlacement, InterleavedNodesAreRenumbered) {
  // Cyclic distribution: ranks 0,2,4 on node 0 and 1,3,5 on node 1; 3 stages fit a node, so
  // the replicas are {0,2,4} and {1,3,5}.
  const GridPlacement p = place_grid({0, 1, 0, 1, 0, 1}, 3);
  EXPECT_TRUE(p.node_local);
  EXPECT_EQ(p.position, (std::vector<int>{0, 3, 1, 4, 2, 5}));
  const GridPlacement q = place_grid({0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2}, 2);
  EXPECT_TRUE(q.node_local);
  for (std::size_t r = 0; r < q.position.size(); ++r) {
    // Replica = position / 2 must be on one node: its two ranks share r's node.
    for (std::size_t s = 0; s < q.position.size(); ++s) {
      if (q.position[s] / 2 == q.position[r] / 2) {
        EXPECT_EQ(r % 3, s % 3) << "ranks " << r << " and " << s;
      }
    }
  }
}

TEST(GridPlacement, StagesThatDoNotFitKeepWorldOrderWithANote) {
  const GridPlacement p = place_grid({0, 0, 1, 1}, 4);
  EXPECT_FALSE(p.node_local);
  EXPECT_EQ(p.position, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_NE(p.note.find("pipeline_stages = 4 does not divide the 2 ranks of node 0"),
            std::string::npos) << p.note;
  // 3 + 3 ranks, 2 stages: node 0 cannot hold whole replicas, one replica crosses.
  const GridPlacement q = place_grid({0, 0, 0, 1, 1, 1}, 2);
  EXPECT_FALSE(q.node_local);
  EXPECT_NE(q.note.find("the 3 ranks of node 0"), std::string::npos) << q.note;
  // One stage always fits.
  EXPECT_TRUE(place_grid({0, 1, 0, 1}, 1).node_local);
}

// 2 stages x 2 replicas on 2 nodes of 2 (4 ranks; 1 replica at 2 ranks, on one node).
TEST(Grid, TwoStagesInsideEachNode) {
  ScopedEnv nodes("LOCUS_TEST_RANKS_PER_NODE", "2");
  mpi::Comm world = mpi::Comm::world();
  if (world.size() % 2 != 0) GTEST_SKIP() << "needs an even rank count";
  const Grid g(world, 2);
  EXPECT_TRUE(g.node_local());
  EXPECT_EQ(g.world().rank(), world.rank());   // consecutive nodes: no renumbering
  EXPECT_TRUE(replica_on_one_node(g, world.rank() / 2));
  EXPECT_EQ(g.layout().rfind("pipeline stages inside nodes, replicas across nodes", 0), 0u)
      << g.layout();
  EXPECT_NE(g.layout().find("node 0: rank 0 = replica 0 stage 0, rank 1 = replica 0 stage 1"),
            std::string::npos) << g.layout();
  if (world.size() == 4) {
    EXPECT_NE(g.layout().find("node 1: rank 2 = replica 1 stage 0, rank 3 = replica 1 stage 1"),
              std::string::npos) << g.layout();
  }
}

// Interleaved nodes (Slurm node names alternate: ranks 0,2 and 1,3): ranks are renumbered so
// each replica still sits on one node.
TEST(Grid, InterleavedNodesAreRenumbered) {
  mpi::Comm world = mpi::Comm::world();
  if (world.size() != 4) GTEST_SKIP() << "needs 4 ranks";
  ScopedEnv test("LOCUS_TEST_RANKS_PER_NODE", nullptr);
  const std::string name = "node" + std::to_string(world_rank() % 2);
  ScopedEnv slurm("SLURMD_NODENAME", name.c_str());
  const Grid g(world, 2);
  EXPECT_TRUE(g.node_local());
  const int expected[] = {0, 2, 1, 3};   // world rank -> grid position
  EXPECT_EQ(g.world().rank(), expected[world.rank()]);
  EXPECT_EQ(g.world().rank(), g.dp_rank() * 2 + g.stage());
  EXPECT_TRUE(replica_on_one_node(g, world.rank() % 2));
  EXPECT_NE(g.layout().find("node 0: rank 0 = replica 0 stage 0, rank 2 = replica 0 stage 1"),
            std::string::npos) << g.layout();
}

// 4 stages on nodes of 2: a replica cannot fit a node; world order, and the layout says so.
TEST(Grid, StagesLargerThanANodeSpanNodes) {
  ScopedEnv nodes("LOCUS_TEST_RANKS_PER_NODE", "2");
  mpi::Comm world = mpi::Comm::world();
  if (world.size() != 4) GTEST_SKIP() << "needs 4 ranks";
  const Grid g(world, 4);
  EXPECT_FALSE(g.node_local());
  EXPECT_EQ(g.world().rank(), world.rank());
  EXPECT_EQ(g.stage(), world.rank());
  EXPECT_NE(g.layout().find("pipeline stages span nodes: pipeline_stages = 4 does not divide "
                            "the 2 ranks of node 0"),
            std::string::npos) << g.layout();
}

}  // namespace
}  // namespace locus::train
