// Node topology: the node-local communicators, the leaders and the node numbering, from the
// test-only rank-count override and from shared memory (one host: one node).
#include <gtest/gtest.h>

#include <cstdlib>
#include <numeric>

#include "locus/comm/topology.hpp"
#include "scoped_env.hpp"

using locus::test_support::ScopedEnv;

using namespace locus;

TEST(Topology, OneHostIsOneNode) {
  ScopedEnv test("LOCUS_TEST_RANKS_PER_NODE", nullptr);
  ScopedEnv slurm("SLURMD_NODENAME", nullptr);
  mpi::Comm world = mpi::Comm::world();
  comm::Topology t(world);
  EXPECT_EQ(t.nodes(), 1);
  EXPECT_EQ(t.node_index(), 0);
  EXPECT_EQ(t.node().size(), world.size());
  EXPECT_EQ(t.node().rank(), world.rank());
  EXPECT_EQ(t.is_leader(), world.rank() == 0);
  EXPECT_EQ(t.leaders().get() != MPI_COMM_NULL, world.rank() == 0);
  EXPECT_TRUE(t.uniform_blocks());
  EXPECT_EQ(t.source(), "shared memory");
}

TEST(Topology, TestOverrideCutsConsecutiveRanks) {
  ScopedEnv test("LOCUS_TEST_RANKS_PER_NODE", "2");
  mpi::Comm world = mpi::Comm::world();
  comm::Topology t(world);
  const int expected_nodes = (world.size() + 1) / 2;
  EXPECT_EQ(t.nodes(), expected_nodes);
  EXPECT_EQ(t.node_index(), world.rank() / 2);
  EXPECT_EQ(t.node().rank(), world.rank() % 2);
  EXPECT_EQ(t.node().size(), std::min(2, world.size() - 2 * (world.rank() / 2)));
  ASSERT_EQ(t.leaders().get() != MPI_COMM_NULL, world.rank() % 2 == 0);
  if (t.is_leader()) {
    EXPECT_EQ(t.leaders().size(), expected_nodes);
    EXPECT_EQ(t.leaders().rank(), t.node_index());
  }
  ASSERT_EQ(static_cast<int>(t.node_of_rank().size()), world.size());
  for (int r = 0; r < world.size(); ++r) EXPECT_EQ(t.node_of_rank()[static_cast<std::size_t>(r)], r / 2);
  EXPECT_EQ(std::accumulate(t.node_sizes().begin(), t.node_sizes().end(), 0), world.size());
  EXPECT_EQ(t.uniform_blocks(), world.size() % 2 == 0 || world.size() == 1);
  EXPECT_NE(t.describe().find("LOCUS_TEST_RANKS_PER_NODE=2"), std::string::npos) << t.describe();
}

TEST(Topology, SlurmNodeNamesSplitOneHost) {
  // Two emulated Slurm nodes on one host: even ranks on "a", odd ranks on "b".
  ScopedEnv test("LOCUS_TEST_RANKS_PER_NODE", nullptr);
  mpi::Comm world = mpi::Comm::world();
  ScopedEnv slurm("SLURMD_NODENAME", world.rank() % 2 == 0 ? "node-a" : "node-b");
  comm::Topology t(world);
  EXPECT_EQ(t.nodes(), std::min(2, world.size()));
  EXPECT_EQ(t.node_index(), world.rank() % 2);
  EXPECT_EQ(t.node().size(), (world.size() + 1 - world.rank() % 2) / 2);
  EXPECT_EQ(t.uniform_blocks(), world.size() <= 2);  // interleaved, not consecutive
  EXPECT_EQ(t.source(), "shared memory and Slurm node names");
}

TEST(Topology, MalformedOverrideIsAnAgreedConfigError) {
  ScopedEnv test("LOCUS_TEST_RANKS_PER_NODE", "two");
  mpi::Comm world = mpi::Comm::world();
  try {
    comm::Topology t(world);
    FAIL() << "a malformed LOCUS_TEST_RANKS_PER_NODE must be refused";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("LOCUS_TEST_RANKS_PER_NODE = 'two'"), std::string::npos)
        << e.what();
  }
}

// The override counts world ranks: a sub-communicator (here the even and the odd ranks, as a
// pipeline stage's data-parallel group) sees the nodes its ranks sit on, not blocks of its own
// ranks.
TEST(Topology, TestOverrideCountsWorldRanksInSubCommunicators) {
  ScopedEnv test("LOCUS_TEST_RANKS_PER_NODE", "2");
  mpi::Comm world = mpi::Comm::world();
  mpi::Comm half = world.split(world.rank() % 2, world.rank());
  comm::Topology t(half);
  // World ranks 2k and 2k+1 share node k, so every rank of `half` is alone on its node.
  EXPECT_EQ(t.nodes(), half.size());
  EXPECT_EQ(t.node().size(), 1);
  EXPECT_EQ(t.node_index(), half.rank());
  EXPECT_TRUE(t.is_leader());
}
