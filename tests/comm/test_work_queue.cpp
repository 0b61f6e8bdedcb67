// The one-sided work queue: every unit is won and written exactly once at every world size,
// ranks that finish early re-run a straggler's unit, and with speculation off nobody does.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <utility>
#include <thread>
#include <vector>

#include "locus/comm/queue_progress.hpp"
#include "locus/comm/work_queue.hpp"

using namespace locus;

namespace {

struct Tally {
  std::int64_t fresh = 0, speculative = 0, won = 0, lost = 0;
};

// The amount a won unit counts in WorkQueue::counts(): unit u weighs u + 1.
std::int64_t amount_of(std::int64_t unit) { return unit + 1; }

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
    if (q.try_win(c.unit, amount_of(c.unit))) {
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
      world.barrier();  // every unit won: the counters are final
      const comm::WorkQueue::Counts c = q.counts();
      const auto s = q.finish();
      EXPECT_EQ(c.units, units);
      EXPECT_EQ(c.won, units);
      EXPECT_EQ(c.amount, units * (units + 1) / 2) << "the sum of amount_of over the units";
      EXPECT_EQ(c.reruns, s.extra_runs);
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
    EXPECT_FALSE(q.try_win(mine, amount_of(mine))) << "the re-run finished first and must win";
  } else {
    t = drain(q);
  }
  world.barrier();
  const comm::WorkQueue::Counts c = q.counts();
  const auto s = q.finish();
  EXPECT_EQ(c.won, 20);
  EXPECT_EQ(c.reruns, s.extra_runs) << "every speculative start is counted";
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
    EXPECT_TRUE(q.try_win(mine, amount_of(mine)));
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

// Rank 0's progress reports while the ranks drain the queue (a ticker polled between units and
// in finish's wait): counters that only grow, never past the totals, and ticks no closer than
// the interval.
TEST(WorkQueue, ProgressReportsOnlyGrowAndStopAtTheTotals) {
  mpi::Comm world = mpi::Comm::world();
  constexpr std::int64_t kUnits = 120;
  constexpr double kInterval = 0.005;
  comm::WorkQueue q(world, kUnits, /*speculate=*/true);
  std::vector<comm::QueueProgress> seen;
  comm::ProgressTicker ticker(kInterval, kUnits * (kUnits + 1) / 2,
                              world.is_root() ? comm::ProgressTicker::Sink(
                                                    [&](const comm::QueueProgress& p) {
                                                      seen.push_back(p);
                                                    })
                                              : comm::ProgressTicker::Sink{});
  while (true) {
    ticker.poll(q);
    const auto c = q.claim({});
    if (c.unit < 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (q.try_win(c.unit, amount_of(c.unit))) q.wrote(c.unit);
  }
  const auto s = q.finish([&] { ticker.poll(q); });
  EXPECT_EQ(s.written_once, kUnits);
  if (!world.is_root()) return;
  // 120 units of at least 1 ms on at most 4 ranks take 30 ms or more, and rank 0 polls between
  // its units and while it waits for the others: about six reports, and one at the very least.
  ASSERT_GE(seen.size(), 1u);
  for (std::size_t i = 0; i < seen.size(); ++i) {
    const comm::QueueProgress& p = seen[i];
    EXPECT_EQ(p.counts.units, kUnits);
    EXPECT_EQ(p.total_amount, kUnits * (kUnits + 1) / 2);
    EXPECT_LE(p.counts.won, kUnits);
    EXPECT_LE(p.counts.amount, p.total_amount);
    EXPECT_GE(p.seconds, kInterval * static_cast<double>(i + 1) - 1e-9)
        << "report " << i << " came before its interval";
    if (i == 0) continue;
    EXPECT_GE(p.counts.won, seen[i - 1].counts.won);
    EXPECT_GE(p.counts.amount, seen[i - 1].counts.amount);
    EXPECT_GE(p.counts.reruns, seen[i - 1].counts.reruns);
    EXPECT_GE(p.seconds - seen[i - 1].seconds, kInterval - 1e-9);
  }
}

TEST(QueueProgress, DescribesWhatIsDoneTheRateAndTheTimeLeft) {
  comm::QueueProgress p;
  p.counts = {.units = 40, .won = 12, .amount = 98304, .reruns = 1};
  p.total_amount = 327680;
  p.seconds = 35;
  EXPECT_EQ(comm::describe(p, "scoring", "rows"),
            "scoring: 12 of 40 units, 98304 of 327680 rows (30%) in 35 s, 2809 rows/s, 1 re-run; "
            "about 82 s left");
  // Without a known total, the share and the time left come from the units.
  p.total_amount = 0;
  p.counts = {.units = 45, .won = 9, .amount = 12000, .reruns = 0};
  p.seconds = 120;
  EXPECT_EQ(comm::describe(p, "parsing", "rows"),
            "parsing: 9 of 45 units, 12000 rows (20% of the units) in 2.0 min, 100 rows/s; "
            "about 8.0 min left");
  p.counts = {.units = 45, .won = 0, .amount = 0, .reruns = 3};
  p.seconds = 4;
  EXPECT_EQ(comm::describe(p, "parsing", "rows"),
            "parsing: 0 of 45 units, 0 rows (0% of the units) in 4.0 s, 0 rows/s, 3 re-runs; no "
            "unit finished yet");
  p.counts = {.units = 45, .won = 45, .amount = 700, .reruns = 0};
  EXPECT_EQ(comm::describe(p, "parsing", "rows"),
            "parsing: 45 of 45 units, 700 rows (100% of the units) in 4.0 s, 175 rows/s");
  EXPECT_EQ(comm::human_seconds(0.42), "0.4 s");
  EXPECT_EQ(comm::human_seconds(99.4), "99 s");
  EXPECT_EQ(comm::human_seconds(5400), "90.0 min");
  EXPECT_EQ(comm::human_seconds(7200), "2.0 h");
}
