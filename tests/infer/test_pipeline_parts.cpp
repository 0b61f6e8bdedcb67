// The scoring loop's private parts: stripe sizing, the automatic read-thread count, the
// huge-page buffer allocator, and the quiet waits of the run's end (a barrier that sleeps;
// rank 0's fsync with its error agreed on every rank) at 1, 2 and 4 ranks.
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <vector>

#include "huge_pages.hpp"
#include "input.hpp"
#include "locus/comm/error.hpp"
#include "locus/comm/mpi.hpp"
#include "pipeline.hpp"
#include "quiet_wait.hpp"

using namespace locus;

TEST(PipelineParts, StripesHoldWholeBatchesAndAtMostAUnit) {
  using infer::detail::stripe_rows;
  EXPECT_EQ(stripe_rows(0, 256, 8684, 784), 768u);  // ~2 MiB of 784 floats, whole batches
  EXPECT_EQ(stripe_rows(50, 32, 150, 20), 64u);     // rounded up to whole batches
  EXPECT_EQ(stripe_rows(32, 32, 150, 20), 32u);
  EXPECT_EQ(stripe_rows(0, 32, 150, 20), 160u);     // no more than the unit (in batches)
  EXPECT_EQ(stripe_rows(1000, 256, 100, 784), 256u);
  EXPECT_EQ(stripe_rows(0, 1, 1, 1 << 24), 1u);     // rows wider than a stripe: one per read
}

TEST(PipelineParts, AutomaticReadThreads) {
  using locus::infer::detail::auto_read_threads;
  EXPECT_EQ(auto_read_threads(false, 16), 1);  // cpu: the cores are for the forward passes
  EXPECT_EQ(auto_read_threads(true, 16), 8);   // at most 8
  EXPECT_EQ(auto_read_threads(true, 8), 6);    // less the compute and main threads
  EXPECT_EQ(auto_read_threads(true, 4), 2);
  EXPECT_EQ(auto_read_threads(true, 2), 1);    // at least 1
  EXPECT_EQ(auto_read_threads(true, 0), 1);
}

// A rank's cpus: its share of the node's, counted once whether or not the ranks are bound.
TEST(PipelineParts, CpuShareDividesTheNodesCpusOnce) {
  using locus::infer::detail::cpu_share;
  EXPECT_EQ(cpu_share(16, 16, 4), 4);  // unbound: each sees the whole node
  EXPECT_EQ(cpu_share(4, 16, 4), 4);   // srun -c4: each bound to its own 4 (not 4 / 4)
  EXPECT_EQ(cpu_share(8, 16, 4), 4);   // bound by socket, two ranks a socket
  EXPECT_EQ(cpu_share(1, 2, 2), 1);    // one core each
  EXPECT_EQ(cpu_share(16, 16, 1), 16);
  EXPECT_EQ(cpu_share(2, 2, 4), 1);    // oversubscribed: at least 1
  EXPECT_EQ(cpu_share(16, 16, 0), 16);
}

TEST(PipelineParts, HugePageBuffersAreAlignedAndUsable) {
  std::vector<float, infer::detail::HugePageAllocator<float>> v(3 << 20);  // 12 MiB
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(v.data()) % (std::uintptr_t{2} << 20), 0u);
  std::iota(v.begin(), v.end(), 0.0f);
  EXPECT_EQ(v[12345], 12345.0f);
  v.resize(5 << 20);  // grows into a new mapping, keeping the values
  EXPECT_EQ(v[12345], 12345.0f);
  EXPECT_EQ(v.back(), 0.0f);
}

TEST(PipelineParts, QuietBarrierWaitsForEveryRank) {
  const mpi::Comm world = mpi::Comm::world();
  // A value set by each rank before the barrier is visible to all after it.
  std::vector<int> arrived(static_cast<std::size_t>(world.size()), 0);
  arrived[static_cast<std::size_t>(world.rank())] = 1;
  infer::detail::quiet_barrier(world);
  world.allreduce_inplace(std::span<int>(arrived), MPI_SUM);
  for (int a : arrived) EXPECT_EQ(a, 1);
}

TEST(PipelineParts, OnRootQuietlyRunsOnRootAndAgreesOnItsError) {
  const mpi::Comm world = mpi::Comm::world();
  int runs = 0;
  infer::detail::on_root_quietly(world, [&] { ++runs; });
  EXPECT_EQ(runs, world.is_root() ? 1 : 0);
  try {
    infer::detail::on_root_quietly(world, [] { throw IoError("fsync failed for 'x'"); });
    ADD_FAILURE() << "rank 0's error must reach every rank";
  } catch (const IoError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("fsync failed for 'x'"), std::string::npos) << e.what();
  }
}
