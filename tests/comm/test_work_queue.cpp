// The one-sided work queue: every unit is won and written exactly once at every world size,
// ranks that finish early re-run a straggler's unit, and with speculation off nobody does.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <thread>

#include "locus/comm/work_queue.hpp"

using namespace locus;

namespace {

struct Tally {
  std::int64_t fresh = 0, speculative = 0, won = 0, lost = 0;
};

// Drains the queue like the scoring loop does (without the data): claim, "compute", try to win,
// record the write.
Tally drain(comm::WorkQueue& q, int slow_rank = -1) {
  Tally t;
  const int rank = mpi::world_rank();
  while (true) {
    const auto c = q.claim({});
    if (c.unit < 0) break;
    ++(c.speculative ? t.speculative : t.fresh);
    if (rank == slow_rank) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    if (q.try_win(c.unit)) {
      q.wrote(c.unit);
      ++t.won;
    } else {
      ++t.lost;
    }
  }
  return t;
}

// The balanced block of units rank r owns under the static schedule: the first n % size ranks
// get one more.
std::pair<std::int64_t, std::int64_t> static_block(std::int64_t n, int r, int size) {
  const std::int64_t base = n / size, extra = n % size;
  const std::int64_t begin = r * base + std::min<std::int64_t>(r, extra);
  return {begin, begin + base + (r < extra ? 1 : 0)};
}

}  // namespace

TEST(WorkQueue, EveryUnitIsWrittenExactlyOnce) {
  mpi::Comm world = mpi::Comm::world();
  for (bool speculate : {false, true}) {
    for (std::int64_t units : {0, 1, 7, 500}) {
      comm::WorkQueue q(world, units, speculate);
      const Tally t = drain(q, world.size() - 1);
      const auto s = q.finish();
      EXPECT_EQ(s.units, units);
      EXPECT_EQ(s.written_once, units);
      EXPECT_EQ(s.unwritten, 0);
      EXPECT_EQ(s.written_twice, 0);
      EXPECT_EQ(world.allreduce(t.fresh, MPI_SUM), units) << "each unit is handed out once";
      EXPECT_EQ(world.allreduce(t.won, MPI_SUM), units);
      EXPECT_EQ(world.allreduce(t.speculative, MPI_SUM), s.extra_runs);
      if (!speculate) {
        EXPECT_EQ(s.extra_runs, 0);
      }
      for (std::int64_t u = 0; u < units; ++u) {
        ASSERT_GE(s.winner[static_cast<std::size_t>(u)], 0);
        ASSERT_LT(s.winner[static_cast<std::size_t>(u)], world.size());
      }
    }
  }
}

TEST(WorkQueue, IdleRanksRerunAStragglersUnitAndWin) {
  mpi::Comm world = mpi::Comm::world();
  if (world.size() < 2) GTEST_SKIP() << "needs a straggler and a faster rank";
  const int straggler = world.size() - 1;
  comm::WorkQueue q(world, 20, /*speculate=*/true);
  std::int64_t mine = -1;
  if (world.rank() == straggler) {
    const auto c = q.claim({});
    ASSERT_FALSE(c.speculative);
    mine = c.unit;
  }
  world.barrier();  // the straggler holds its unit before anyone else starts
  Tally t;
  if (world.rank() == straggler) {
    // Never finishes on its own: waits until some other rank won its unit.
    while (!q.finished(mine)) {
      q.progress();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_FALSE(q.try_win(mine)) << "the re-run finished first and must win";
  } else {
    t = drain(q);
  }
  const auto s = q.finish();
  EXPECT_EQ(s.written_once, 20);
  // At least the straggler's unit was re-run (units other ranks still held when the counter ran
  // out may have been re-run too).
  EXPECT_GE(s.extra_runs, 1);
  world.bcast(std::span<std::int64_t>(&mine, 1), straggler);
  EXPECT_NE(s.winner[static_cast<std::size_t>(mine)], straggler);
  EXPECT_EQ(world.allreduce(t.speculative, MPI_SUM), s.extra_runs);
}

TEST(WorkQueue, WithoutSpeculationTheStragglerKeepsItsUnit) {
  mpi::Comm world = mpi::Comm::world();
  const int straggler = world.size() - 1;
  comm::WorkQueue q(world, 9, /*speculate=*/false);
  std::int64_t mine = -1;
  if (world.rank() == straggler) mine = q.claim({}).unit;
  world.barrier();
  Tally t;
  if (world.rank() != straggler) t = drain(q);
  world.barrier();  // everyone else has given up: nothing was re-run
  if (world.rank() == straggler) {
    EXPECT_FALSE(q.finished(mine));
    EXPECT_TRUE(q.try_win(mine));
    q.wrote(mine);
    const Tally rest = drain(q);
    t.won += rest.won + 1;
  }
  const auto s = q.finish();
  EXPECT_EQ(s.written_once, 9);
  EXPECT_EQ(s.extra_runs, 0);
  EXPECT_EQ(world.allreduce(t.won, MPI_SUM), 9);
}

TEST(WorkQueue, StaticBlocksGiveEveryRankItsOwnBlockAndNoReruns) {
  mpi::Comm world = mpi::Comm::world();
  for (std::int64_t units : {0, 3, 50}) {
    comm::WorkQueue q(world, units, /*speculate=*/true, 2, comm::Schedule::static_blocks);
    EXPECT_FALSE(q.speculating()) << "the static schedule never speculates";
    const Tally t = drain(q, world.size() - 1);  // a slow rank keeps its whole block
    const auto s = q.finish();
    EXPECT_EQ(s.written_once, units);
    EXPECT_EQ(s.extra_runs, 0);
    EXPECT_EQ(t.speculative, 0);
    for (std::int64_t u = 0; u < units; ++u) {
      const auto [begin, end] =
          static_block(units, s.winner[static_cast<std::size_t>(u)], world.size());
      EXPECT_TRUE(u >= begin && u < end)
          << "unit " << u << " was scored outside its owner's block";
    }
  }
}
