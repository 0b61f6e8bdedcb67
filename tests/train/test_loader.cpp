// The data loader at 1, 2 and 4 ranks: every row exactly once per epoch in every mode and
// residency, the documented per-rank batch sizes, global mode equal to a 1-rank run, rows
// matching the file, prefetch depth/threading invariance, resume, and per-epoch permutations.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <vector>

#include "data/loader_plan.hpp"
#include "loader_test_util.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;
using train::Loader;
using train::LoaderOptions;
using train::Residency;
using train::Shuffle;

namespace {

constexpr std::uint64_t kRows = 53, kCols = 5;
// Sample bytes of one row (5 features + label) and budgets below/above the data size.
constexpr std::uint64_t kRowBytes = kCols * 4 + 4;
constexpr std::uint64_t kTiny = 6 * kRowBytes;  // 6 rows: streamed / per-batch reads
constexpr std::uint64_t kLarge = 1 << 20;

struct Mode {
  Shuffle shuffle;
  std::uint64_t budget;
  Residency expected;
};
const Mode kModes[] = {
    {Shuffle::global, kLarge, Residency::dataset}, {Shuffle::global, kTiny, Residency::per_batch},
    {Shuffle::local, kLarge, Residency::partition}, {Shuffle::local, kTiny, Residency::streamed},
    {Shuffle::none, kLarge, Residency::partition},  {Shuffle::none, kTiny, Residency::streamed},
};

class LoaderTest : public testing::Test {
 protected:
  LoaderTest() : world_(mpi::Comm::world()), dir_(world_) {
    test::write_file(world_, path(), {.rows = kRows, .cols = kCols, .committed = kRows,
                                      .label_rows = kRows});
  }
  std::string path() const { return dir_.file("data.h5"); }
  LoaderOptions opts(Shuffle s, std::int64_t batch, std::uint64_t budget = kLarge) const {
    LoaderOptions o;
    o.path = path();
    o.shuffle = s;
    o.global_batch = batch;
    o.memory_budget = budget;
    o.seed = 1234;
    return o;
  }
  std::uint64_t rank() const { return static_cast<std::uint64_t>(world_.rank()); }
  std::uint64_t ranks() const { return static_cast<std::uint64_t>(world_.size()); }

  // This rank's rows in a step, as documented in loader.hpp.
  std::uint64_t expected_rows(Shuffle s, std::uint64_t batch, std::uint64_t step) const {
    const std::uint64_t begin = step * batch, end = std::min(kRows, begin + batch);
    if (s == Shuffle::global) {
      return h5::partition_rows(end - begin, world_.rank(), world_.size()).count;
    }
    std::uint64_t n = 0;
    for (std::uint64_t i = begin; i < end; ++i) n += (i % ranks() == rank()) ? 1 : 0;
    return n;
  }

  mpi::Comm world_;
  test::SharedTmpDir dir_;
};

TEST_F(LoaderTest, EveryRowExactlyOncePerEpochInEveryMode) {
  // 1 and 7 rows per step, a batch not dividing 53, one with 53 < B·P at 4 ranks, all rows.
  for (const Mode& m : kModes) {
    for (std::int64_t batch : {1, 7, 13, 20, 53}) {
      for (bool drop_last : {false, true}) {
        SCOPED_TRACE(testing::Message() << "shuffle " << train::to_string(m.shuffle) << " budget "
                                        << m.budget << " batch " << batch << " drop_last "
                                        << drop_last);
        LoaderOptions o = opts(m.shuffle, batch, m.budget);
        o.drop_last = drop_last;
        Loader l(world_, o);
        EXPECT_EQ(l.residency(), m.expected);
        EXPECT_EQ(l.rows(), static_cast<std::int64_t>(kRows));
        EXPECT_EQ(l.cols(), static_cast<std::int64_t>(kCols));
        EXPECT_TRUE(l.has_labels());
        const std::uint64_t b = static_cast<std::uint64_t>(batch);
        const std::uint64_t steps = drop_last ? kRows / b : (kRows + b - 1) / b;
        ASSERT_EQ(l.steps_per_epoch(), static_cast<std::int64_t>(steps));
        for (std::int64_t epoch : {0, 3}) {
          const test::Epoch e = test::record(l, epoch);
          ASSERT_EQ(e.ids.size(), steps);
          std::vector<std::int64_t> seen(kRows, 0);
          for (std::uint64_t k = 0; k < steps; ++k) {
            EXPECT_EQ(e.ids[k].size(), expected_rows(m.shuffle, b, k)) << "step " << k;
            EXPECT_EQ(e.global_rows[k], static_cast<int>(std::min(b, kRows - k * b)));
            const auto total =
                world_.allreduce(static_cast<std::int64_t>(e.ids[k].size()), MPI_SUM);
            EXPECT_EQ(total, e.global_rows[k]) << "step " << k;
            for (auto id : e.ids[k]) ++seen[id];
            if (m.shuffle != Shuffle::global) {
              const h5::RowRange part = h5::partition_rows(kRows, world_.rank(), world_.size());
              for (auto id : e.ids[k]) EXPECT_TRUE(id >= part.begin && id < part.end()) << id;
            }
          }
          world_.allreduce_inplace(std::span<std::int64_t>(seen), MPI_SUM);
          const auto once = std::count(seen.begin(), seen.end(), 1);
          EXPECT_EQ(std::count(seen.begin(), seen.end(), 0) + once, static_cast<long>(kRows));
          EXPECT_EQ(once, static_cast<long>(drop_last ? steps * b : kRows));
        }
      }
    }
  }
}

TEST_F(LoaderTest, NoneModeIsFileOrderWithinEachPartition) {
  for (std::uint64_t budget : {kLarge, kTiny}) {
    Loader l(world_, opts(Shuffle::none, 7, budget));
    std::vector<std::uint64_t> all;
    for (const auto& ids : test::record(l, 5).ids) all.insert(all.end(), ids.begin(), ids.end());
    const h5::RowRange part = h5::partition_rows(kRows, world_.rank(), world_.size());
    ASSERT_EQ(all.size(), part.count);
    for (std::uint64_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i], part.begin + i);
  }
}

TEST_F(LoaderTest, GlobalModeConcatenatesToTheOneRankBatches) {
  mpi::Comm self = world_.split(world_.rank(), 0);  // a 1-rank run on every rank
  for (std::int64_t batch : {3, 16, 20, 53}) {
    for (std::uint64_t budget : {kLarge, kTiny}) {
      SCOPED_TRACE(testing::Message() << "batch " << batch << " budget " << budget);
      Loader dist(world_, opts(Shuffle::global, batch, budget));
      Loader one(self, opts(Shuffle::global, batch, kLarge));
      for (std::int64_t epoch : {0, 1}) {
        const test::Epoch d = test::record(dist, epoch);
        const test::Epoch s = test::record(one, epoch);
        ASSERT_EQ(d.ids.size(), s.ids.size());
        for (std::size_t k = 0; k < d.ids.size(); ++k) {
          EXPECT_EQ(test::gather_concat(world_, d.ids[k]), s.ids[k]) << "step " << k;
          EXPECT_EQ(d.global_rows[k], s.global_rows[k]);
        }
      }
    }
  }
}

TEST_F(LoaderTest, PrefetchDepthAndThreadingDoNotChangeBatches) {
  for (const Mode& m : kModes) {
    SCOPED_TRACE(train::to_string(m.shuffle));
    LoaderOptions o = opts(m.shuffle, 13, m.budget);
    o.prefetch_depth = 1;
    Loader shallow(world_, o);
    o.prefetch_depth = 8;
    Loader deep(world_, o);
    o.prefetch_depth = 4;
    o.paced_producer = true;
    Loader paced(world_, o);
    o.background = false;
    Loader sync(world_, o);
    EXPECT_TRUE(shallow.threaded());  // the test main asks for MPI_THREAD_MULTIPLE
    EXPECT_FALSE(sync.threaded());
    for (std::int64_t epoch : {0, 1}) {
      const test::Epoch a = test::record(shallow, epoch);
      const test::Epoch b = test::record(deep, epoch);
      const test::Epoch c = test::record(sync, epoch);
      const test::Epoch d = test::record(paced, epoch);
      EXPECT_EQ(a.ids, b.ids);
      EXPECT_EQ(a.ids, c.ids);
      EXPECT_EQ(a.ids, d.ids);
      EXPECT_EQ(a.x, b.x);
      EXPECT_EQ(a.x, c.x);
      EXPECT_EQ(a.x, d.x);
    }
  }
}

// Batches of at least 1 MiB in memory are copied by several threads (loader.gather_threads,
// copy_pool.hpp): the same bytes as one thread's, both from the producer and from next()'s own
// gather (background off), in both in-memory residencies.
TEST(LoaderGatherThreads, ManyCopyingThreadsGiveTheSameBatches) {
  const mpi::Comm world = mpi::Comm::world();
  const test::SharedTmpDir dir(world);
  constexpr std::uint64_t rows = 4000, cols = 512;  // 2 KiB a row
  test::write_file(world, dir.file("wide.h5"),
                   {.rows = rows, .cols = cols, .committed = rows, .label_rows = rows});
  for (const Shuffle shuffle : {Shuffle::global, Shuffle::local}) {
    for (const bool background : {true, false}) {
      SCOPED_TRACE(testing::Message() << train::to_string(shuffle) << " background "
                                      << background);
      LoaderOptions o;
      o.path = dir.file("wide.h5");
      o.shuffle = shuffle;
      o.global_batch = 600 * world.size() + 7;  // >= 600 rows = 1.2 MiB on every rank
      o.memory_budget = std::uint64_t{64} << 20;
      o.seed = 99;
      o.background = background;
      o.gather_threads = 1;
      Loader one(world, o);
      o.gather_threads = 4;
      Loader four(world, o);
      EXPECT_NE(one.residency(), Residency::streamed);
      EXPECT_NE(one.residency(), Residency::per_batch);
      for (std::int64_t epoch : {0, 1}) {
        const test::Epoch a = test::record(one, epoch);
        const test::Epoch b = test::record(four, epoch);
        EXPECT_EQ(a.ids, b.ids);
        EXPECT_EQ(a.x, b.x);
      }
    }
  }
}

TEST_F(LoaderTest, BatchesPreparedAheadForTheNextEpochAreTheRightOnes) {
  // After an epoch the producer prepares the next one (epoch + 1; for none any epoch): the
  // batches must equal those of a synchronous loader, whether the epoch was read to the end,
  // abandoned part-way, or followed by a different epoch.
  for (const Mode& m : kModes) {
    SCOPED_TRACE(train::to_string(m.shuffle));
    for (const bool paced : {false, true}) {
      SCOPED_TRACE(testing::Message() << "paced " << paced);
      LoaderOptions o = opts(m.shuffle, 7, m.budget);
      o.prefetch_depth = 3;
      o.paced_producer = paced;
      Loader ahead(world_, o);
      o.background = false;
      Loader sync(world_, o);
      // (epoch, batches read): 8 is the whole epoch; reading 6 of 8 with depth 3 leaves the
      // ring holding old batches ahead of prepared ones.
      const std::int64_t plan[][2] = {{0, 8}, {1, 6}, {2, 8}, {3, 0}, {5, 8},
                                      {5, 8}, {6, 7}, {7, 2}, {0, 6}};
      for (const auto& [epoch, batches] : plan) {
        // Give the producer time to run ahead into the next epoch (coverage, not correctness).
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        ahead.start_epoch(epoch);
        sync.start_epoch(epoch);
        for (std::int64_t k = 0; k < batches; ++k) {
          const train::LoadedBatch* a = ahead.next();
          const train::LoadedBatch* b = sync.next();
          ASSERT_EQ(a == nullptr, b == nullptr);
          if (a == nullptr) break;
          EXPECT_EQ(a->epoch, epoch);
          EXPECT_EQ(a->step, k);
          EXPECT_TRUE(std::equal(a->sample_ids.begin(), a->sample_ids.end(), b->sample_ids.begin(),
                                 b->sample_ids.end()))
              << "epoch " << epoch << " step " << k;
          EXPECT_TRUE(std::equal(a->x.begin(), a->x.end(), b->x.begin(), b->x.end()));
        }
      }
    }
  }
}

// What peek() and peek_next_epoch() show is what next() hands out next, in the same memory and
// unchanged meanwhile (a device copies it from there ahead of its step): the next batch of the
// epoch, and after the epoch's last, the first of epoch + 1 -- kept by start_epoch(epoch + 1),
// released by any other start, whose batches must then be the right ones. Against a synchronous
// loader, with and without the paced producer, at depths 1 and 3 (not depth 1 unpaced: there
// only a next() that finds the ring empty wakes the producer, so a peek may wait for nothing).
TEST_F(LoaderTest, PeekedBatchesAreTheOnesNextHandsOutInPlace) {
  // The producer fills the ring in the background: wait for it (bounded).
  const auto wait_for = [](auto&& peek) -> const train::LoadedBatch* {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    for (;;) {
      if (const train::LoadedBatch* b = peek()) return b;
      if (std::chrono::steady_clock::now() > until) return nullptr;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  };
  struct Bytes {
    std::vector<std::uint64_t> ids;
    std::vector<float> x;
    std::vector<std::int32_t> y;
    bool operator==(const Bytes&) const = default;
  };
  const auto bytes = [](const train::LoadedBatch& b) {
    return Bytes{{b.sample_ids.begin(), b.sample_ids.end()}, {b.x.begin(), b.x.end()},
                 {b.y.begin(), b.y.end()}};
  };
  // (epoch, first step): 0 -> 1 kept; 1 -> 3 released (another epoch); 3 -> 4 at step 2
  // released; 4 -> 4 released (the same epoch again); 4 -> 5 kept.
  const std::int64_t plan[][2] = {{0, 0}, {1, 0}, {3, 0}, {4, 2}, {4, 0}, {5, 0}};
  for (const Mode& m : kModes) {
    for (const bool paced : {false, true}) {
      for (const int depth : {1, 3}) {
        if (depth == 1 && !paced) continue;
        SCOPED_TRACE(testing::Message() << train::to_string(m.shuffle) << ", budget " << m.budget
                                        << ", paced " << paced << ", depth " << depth);
        LoaderOptions o = opts(m.shuffle, 7, m.budget);
        o.prefetch_depth = depth;
        o.paced_producer = paced;
        Loader ahead(world_, o);
        o.background = false;
        Loader sync(world_, o);
        const std::int64_t steps = ahead.steps_per_epoch();
        const train::LoadedBatch* first_ahead = nullptr;  // peek_next_epoch() before this epoch
        Bytes first_bytes;
        for (std::size_t i = 0; i < std::size(plan); ++i) {
          const auto [epoch, from] = plan[i];
          SCOPED_TRACE(testing::Message() << "epoch " << epoch << " from step " << from);
          const bool kept = i > 0 && from == 0 &&
                            (epoch == plan[i - 1][0] + 1 || m.shuffle == Shuffle::none);
          ahead.start_epoch(epoch, from);
          sync.start_epoch(epoch, from);
          EXPECT_EQ(ahead.peek_next_epoch(), nullptr) << "before the epoch's last batch";
          for (std::int64_t k = from; k < steps; ++k) {
            const train::LoadedBatch* p = wait_for([&] { return ahead.peek(); });
            ASSERT_NE(p, nullptr) << "step " << k << ": the producer never had it ready";
            EXPECT_EQ(p->step, k);
            const Bytes seen = bytes(*p);
            const train::LoadedBatch* a = ahead.next();
            const train::LoadedBatch* b = sync.next();
            ASSERT_NE(b, nullptr);
            EXPECT_EQ(a, p) << "step " << k << ": next() handed out other memory than peek()";
            EXPECT_TRUE(bytes(*a) == seen) << "step " << k << ": the peeked batch changed";
            // (A released buffer may come back for another batch: only a kept one is checked.)
            if (k == from && kept) {
              EXPECT_EQ(a, first_ahead) << "the next epoch's first batch, peeked ahead, not kept";
              EXPECT_TRUE(bytes(*a) == first_bytes) << "the batch peeked ahead changed";
            }
            EXPECT_EQ(a->epoch, epoch);
            EXPECT_EQ(a->step, k);
            EXPECT_TRUE(bytes(*a) == bytes(*b)) << "step " << k;
            if (k + 1 < steps) {
              EXPECT_EQ(ahead.peek_next_epoch(), nullptr) << "step " << k;
            }
          }
          first_ahead = wait_for([&] { return ahead.peek_next_epoch(); });
          ASSERT_NE(first_ahead, nullptr) << "the next epoch's first batch was never ready ahead";
          EXPECT_EQ(first_ahead->step, 0);
          first_bytes = bytes(*first_ahead);
          EXPECT_EQ(ahead.peek(), nullptr) << "nothing is left of the epoch";
        }
      }
    }
  }
}

TEST_F(LoaderTest, ResumeYieldsTheRestOfTheUninterruptedEpoch) {
  for (const Mode& m : kModes) {
    SCOPED_TRACE(train::to_string(m.shuffle));
    Loader l(world_, opts(m.shuffle, 7, m.budget));
    const test::Epoch full = test::record(l, 2);
    const auto steps = l.steps_per_epoch();
    for (std::int64_t k : {std::int64_t{0}, std::int64_t{1}, steps / 2, steps - 1, steps}) {
      // Leave another epoch half-read first: nothing of it may leak into the resumed one.
      l.start_epoch(4);
      static_cast<void>(l.next());
      static_cast<void>(l.next());
      const test::Epoch rest = test::record(l, 2, k);
      ASSERT_EQ(rest.ids.size(), static_cast<std::size_t>(steps - k));
      for (std::int64_t j = k; j < steps; ++j) {
        EXPECT_EQ(rest.ids[static_cast<std::size_t>(j - k)], full.ids[static_cast<std::size_t>(j)]);
      }
    }
    // A fresh loader resumes alike: the position is all the state there is.
    Loader fresh(world_, opts(m.shuffle, 7, m.budget));
    const test::Epoch rest = test::record(fresh, 2, 3);
    for (std::int64_t j = 3; j < steps; ++j) {
      EXPECT_EQ(rest.ids[static_cast<std::size_t>(j - 3)], full.ids[static_cast<std::size_t>(j)]);
    }
  }
}

TEST_F(LoaderTest, PermutationsDependOnSeedAndEpochOnly) {
  for (const Mode& m : kModes) {
    if (m.shuffle == Shuffle::none) continue;
    SCOPED_TRACE(train::to_string(m.shuffle));
    Loader a(world_, opts(m.shuffle, 53, m.budget));
    Loader b(world_, opts(m.shuffle, 53, m.budget));
    LoaderOptions o = opts(m.shuffle, 53, m.budget);
    o.seed = 99;
    Loader c(world_, o);
    // One batch of all rows: its order is the epoch's whole (per-rank) permutation.
    const auto e0 = test::record(a, 0).ids, e1 = test::record(a, 1).ids;
    const auto again = test::record(b, 0).ids, other_seed = test::record(c, 0).ids;
    EXPECT_EQ(e0, again);
    // 53 rows: distinct permutations unless astronomically unlucky; compared on all ranks.
    const auto all0 = test::gather_concat(world_, e0[0]);
    EXPECT_NE(all0, test::gather_concat(world_, e1[0]));
    EXPECT_NE(all0, test::gather_concat(world_, other_seed[0]));
    std::vector<std::uint64_t> sorted = all0;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_NE(all0, sorted) << "epoch 0 is not shuffled";
  }
}

// The idle producer computes the next epoch's permutation in pieces (PermutationBuilder): the
// same permutation as in one go, at any piece size, for sizes around the pieces' edges.
TEST(LoaderPermutation, BuiltInPiecesEqualsBuiltAtOnce) {
  for (const std::uint64_t n : std::initializer_list<std::uint64_t>{0, 1, 2, 53, 16385, 100000}) {
    for (const std::uint64_t piece : std::initializer_list<std::uint64_t>{1, 7, 16384, n + 1}) {
      if (n > 20000 && piece < 1000) continue;  // a few million calls: slow, nothing new
      SCOPED_TRACE(testing::Message() << "n " << n << " piece " << piece);
      const auto engine = train::detail::keyed_engine(5, n, train::detail::kGlobalDomain);
      train::detail::PermutationBuilder b(n, engine);
      std::uint64_t calls = 1;
      while (!b.advance(piece)) ++calls;
      // The identity (n) and the swaps (n - 1) in pieces of `piece`: no call wasted.
      const std::uint64_t work = n + (n > 1 ? n - 1 : 0);
      EXPECT_EQ(calls, std::max<std::uint64_t>(1, (work + piece - 1) / piece));
      EXPECT_EQ(b.take(), train::detail::permutation(n, engine));
    }
  }
}

TEST_F(LoaderTest, RanksWithoutRowsInTheLastBatchStillGetABatch) {
  // 53 = 2·26 + 1: the last global batch has one row, which only rank 0 gets.
  for (const Mode& m : kModes) {
    Loader l(world_, opts(m.shuffle, 26, m.budget));
    l.start_epoch(0, 2);
    const train::LoadedBatch* b = l.next();
    ASSERT_NE(b, nullptr);
    EXPECT_EQ(b->global_rows, 1);
    EXPECT_EQ(b->rows, world_.rank() == 0 ? 1 : 0);
    EXPECT_EQ(b->x.size(), static_cast<std::size_t>(b->rows) * kCols);
    EXPECT_EQ(l.next(), nullptr);
  }
}

TEST_F(LoaderTest, RanksStoppingEarlyAndConcurrentCollectivesDoNotDeadlock) {
  for (const Mode& m : kModes) {
    Loader l(world_, opts(m.shuffle, 4, m.budget));
    // The trainer's all-reduce runs on the main thread while the producers read.
    l.start_epoch(0);
    for (int k = 0; k < 5; ++k) {
      const train::LoadedBatch* b = l.next();
      ASSERT_NE(b, nullptr);
      EXPECT_EQ(world_.allreduce(b->rows, MPI_SUM), b->global_rows);
    }
    // Rank r stops after r + 1 more batches, then everyone moves on.
    for (int k = 0; k <= world_.rank(); ++k) static_cast<void>(l.next());
    l.start_epoch(1, 5);
    static_cast<void>(l.next());
  }
  SUCCEED();
}

TEST(LoaderStreamed, MultiRowWindowsCoverThePartitionAndResume) {
  // 301 rows: ≥ 75 per rank at 4 ranks, above budgets of 40 and 60 rows, so every rank
  // streams groups of 20 (8 windows of 2 rows) or 30 rows (8 windows of 3 rows).
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::uint64_t n = 301;
  test::write_file(world, dir.file("big.h5"), {.rows = n, .cols = kCols, .label_rows = n});
  const h5::RowRange part = h5::partition_rows(n, world.rank(), world.size());
  for (Shuffle s : {Shuffle::local, Shuffle::none}) {
    for (std::uint64_t budget_rows : {40u, 60u}) {
      SCOPED_TRACE(testing::Message() << train::to_string(s) << " budget rows " << budget_rows);
      LoaderOptions o;
      o.path = dir.file("big.h5");
      o.shuffle = s;
      o.global_batch = 12;
      o.memory_budget = budget_rows * kRowBytes;
      Loader l(world, o);
      EXPECT_EQ(l.residency(), Residency::streamed);
      const test::Epoch e = test::record(l, 1);
      std::vector<std::uint64_t> order;
      for (const auto& ids : e.ids) order.insert(order.end(), ids.begin(), ids.end());
      std::vector<std::uint64_t> sorted = order;
      std::sort(sorted.begin(), sorted.end());
      ASSERT_EQ(sorted.size(), part.count);
      for (std::uint64_t i = 0; i < part.count; ++i) EXPECT_EQ(sorted[i], part.begin + i);
      EXPECT_EQ(order == sorted, s == Shuffle::none);
      const auto steps = l.steps_per_epoch();
      for (std::int64_t k : {std::int64_t{1}, steps / 2, steps - 1}) {
        const test::Epoch rest = test::record(l, 1, k);
        for (std::int64_t j = k; j < steps; ++j) {
          EXPECT_EQ(rest.ids[static_cast<std::size_t>(j - k)], e.ids[static_cast<std::size_t>(j)]);
        }
      }
    }
  }
}

TEST_F(LoaderTest, WaitTimeIsAccounted) {
  Loader l(world_, opts(Shuffle::global, 7, kTiny));
  l.start_epoch(0);
  double sum = 0;
  while (l.next()) {
    EXPECT_GE(l.last_wait_seconds(), 0.0);
    sum += l.last_wait_seconds();
  }
  sum += l.last_wait_seconds();
  EXPECT_NEAR(l.wait_seconds(), sum, 1e-9);
}

}  // namespace
