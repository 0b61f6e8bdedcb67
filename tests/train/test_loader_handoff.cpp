// The loader's hand-off and device hooks at 1, 2 and 4 ranks: batches next() gathers itself
// (ring empty, samples in memory) equal the producer's and the synchronous loader's in every
// shuffle mode, across epoch boundaries and resumes, also with a paced producer (which must
// refill the ring unwoken); batch buffers come from host_memory and are all returned;
// resident() gathered by resident_rows reproduces x, also without the host feature copy
// (gather_features = false), which is refused out of core.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "loader_test_util.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;
using train::LoadedBatch;
using train::Loader;
using train::LoaderOptions;
using train::LoaderTestAccess;
using train::Residency;
using train::Shuffle;

namespace {

constexpr std::uint64_t kRows = 53, kCols = 5;
constexpr std::uint64_t kRowBytes = kCols * 4 + 4;
constexpr std::uint64_t kTiny = 6 * kRowBytes;  // out of core: streamed / per-batch
constexpr std::uint64_t kLarge = 1 << 20;

struct Mode {
  Shuffle shuffle;
  std::uint64_t budget;
};
const Mode kInMemory[] = {{Shuffle::global, kLarge}, {Shuffle::local, kLarge},
                          {Shuffle::none, kLarge}};
const Mode kAll[] = {{Shuffle::global, kLarge}, {Shuffle::global, kTiny},
                     {Shuffle::local, kLarge},  {Shuffle::local, kTiny},
                     {Shuffle::none, kLarge},   {Shuffle::none, kTiny}};

template <class T>
bool same(std::span<const T> a, std::span<const T> b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

void expect_same_batch(const LoadedBatch& a, const LoadedBatch& b) {
  EXPECT_EQ(a.epoch, b.epoch);
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.global_rows, b.global_rows);
  EXPECT_TRUE(same(a.sample_ids, b.sample_ids)) << "epoch " << a.epoch << " step " << a.step;
  EXPECT_TRUE(same(a.x, b.x)) << "epoch " << a.epoch << " step " << a.step;
  EXPECT_TRUE(same(a.y, b.y));
  EXPECT_TRUE(same(a.resident_rows, b.resident_rows));
}

class LoaderHandoffTest : public testing::Test {
 protected:
  LoaderHandoffTest() : world_(mpi::Comm::world()), dir_(world_) {
    test::write_file(world_, path(), {.rows = kRows, .cols = kCols, .committed = kRows,
                                      .label_rows = kRows});
  }
  std::string path() const { return dir_.file("data.h5"); }
  LoaderOptions opts(Shuffle s, std::int64_t batch, std::uint64_t budget) const {
    LoaderOptions o;
    o.path = path();
    o.shuffle = s;
    o.global_batch = batch;
    o.memory_budget = budget;
    o.seed = 77;
    return o;
  }

  mpi::Comm world_;
  test::SharedTmpDir dir_;
};

TEST_F(LoaderHandoffTest, ConsumerGatheredBatchesEqualTheProducers) {
  for (const Mode& m : kInMemory) {
    for (std::int64_t batch : {7, 20}) {
      for (bool drop_last : {false, true}) {
        for (bool paced : {false, true}) {
          SCOPED_TRACE(testing::Message() << train::to_string(m.shuffle) << " batch " << batch
                                          << " drop_last " << drop_last << " paced " << paced);
          LoaderOptions o = opts(m.shuffle, batch, m.budget);
          o.drop_last = drop_last;
          o.prefetch_depth = 2;
          o.paced_producer = paced;
          Loader mixed(world_, o);
          o.background = false;
          Loader sync(world_, o);
          ASSERT_TRUE(mixed.threaded());
          const std::int64_t steps = mixed.steps_per_epoch();
          // (epoch, first step, batches): whole epochs, an abandoned one, resumes, a repeat.
          const std::int64_t plan[][3] = {{0, 0, steps}, {1, 0, steps}, {2, 0, 2},
                                          {2, 1, steps}, {5, 0, steps}, {6, steps - 1, steps},
                                          {7, 0, steps}, {0, 2, steps}};
          std::uint64_t k = 0;
          for (const auto& [epoch, first, batches] : plan) {
            mixed.start_epoch(epoch, first);
            sync.start_epoch(epoch, first);
            for (std::int64_t j = 0; j < batches; ++j, ++k) {
              // Alternate runs of held and free producer (3 of every 5 steps held), so batches
              // of both origins meet at epoch ends and around resumes.
              LoaderTestAccess::hold_producer(mixed, k % 5 < 3);
              if (k % 5 == 3) std::this_thread::sleep_for(std::chrono::milliseconds(1));
              const LoadedBatch* a = mixed.next();
              const LoadedBatch* b = sync.next();
              ASSERT_EQ(a == nullptr, b == nullptr) << "epoch " << epoch << " batch " << j;
              if (a == nullptr) break;
              EXPECT_EQ(a->epoch, epoch);
              EXPECT_EQ(a->step, first + j);
              expect_same_batch(*a, *b);
            }
          }
          LoaderTestAccess::hold_producer(mixed, false);
          EXPECT_GT(mixed.consumer_batches(), 0);
          EXPECT_EQ(sync.consumer_batches(), 0);
        }
      }
    }
  }
}

// paced_producer: next() does not wake the producer while the ring holds a batch (counted),
// so the producer must come back by itself and refill the ring; a producer that slept until
// woken would leave it with one batch. While the consumer pauses, the producer's sleeps double
// (to 100 ms): a few dozen in 50 ms, not a spin. The batches, in every mode (out of core
// next() cannot gather them itself), are the synchronous loader's.
TEST_F(LoaderHandoffTest, PacedProducerRefillsTheRingUnwoken) {
  const auto wait_for_ring = [](Loader& l, std::size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (LoaderTestAccess::ready_batches(l) < n) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
  };
  for (const Mode& m : kAll) {
    SCOPED_TRACE(testing::Message() << train::to_string(m.shuffle) << " budget " << m.budget);
    LoaderOptions o = opts(m.shuffle, 5, m.budget);  // 11 steps
    o.prefetch_depth = 4;
    o.paced_producer = true;
    Loader paced(world_, o);
    o.background = false;
    Loader sync(world_, o);
    ASSERT_TRUE(paced.threaded());
    ASSERT_EQ(paced.steps_per_epoch(), 11);
    for (std::int64_t epoch : {0, 1}) {
      paced.start_epoch(epoch);
      sync.start_epoch(epoch);
      const std::int64_t woken = LoaderTestAccess::consumer_wakeups(paced);
      for (std::int64_t step = 0; step < paced.steps_per_epoch(); ++step) {
        // Bursts of 3 next() calls, each from a full ring (the producer goes on into the next
        // epoch, so 4 batches are always there to make): it must be refilled without a
        // next(), and the bursts take it down to 1, never empty, so next() never wakes the
        // producer. Woken at half the ring's depth, as without paced_producer, it would be
        // at every burst's third call.
        if (step % 3 == 0) {
          ASSERT_TRUE(wait_for_ring(paced, 4)) << "epoch " << epoch << " step " << step << ": "
                                               << LoaderTestAccess::ready_batches(paced)
                                               << " batches in the ring after 3 s";
        }
        const LoadedBatch* a = paced.next();
        const LoadedBatch* b = sync.next();
        ASSERT_NE(a, nullptr);
        ASSERT_NE(b, nullptr);
        expect_same_batch(*a, *b);
      }
      EXPECT_EQ(paced.next(), nullptr);
      EXPECT_EQ(sync.next(), nullptr);
      EXPECT_EQ(LoaderTestAccess::consumer_wakeups(paced), woken) << "epoch " << epoch;
    }
    // A pause with the ring full: 20 us, 40 us, ... 100 ms sleeps; 50 ms hold about a dozen.
    ASSERT_TRUE(wait_for_ring(paced, 4));
    const std::int64_t before = LoaderTestAccess::paced_sleeps(paced);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_LE(LoaderTestAccess::paced_sleeps(paced) - before, 40);
  }
}

// More rows than the idle producer's piece of a permutation (16384 elements of work): the next
// epoch's order is prepared over several looks, across epochs read whole, abandoned, skipped
// and gone back to; with 40000 rows and 2 ms steps the producer finishes it ahead, with
// 200000 rows and 0.2 ms steps the epoch's first batch comes before it has, and the producer's
// fill() completes the permutation in progress. The batches are the synchronous loader's.
TEST_F(LoaderHandoffTest, PermutationsPreparedInPiecesGiveTheSameBatches) {
  for (const auto& [rows, step_us] : {std::pair<std::uint64_t, int>{40000, 2000}, {200000, 200}}) {
    const std::string file = dir_.file("long" + std::to_string(rows) + ".h5");
    test::write_file(world_, file,
                     {.rows = rows, .cols = 2, .committed = static_cast<std::int64_t>(rows),
                      .label_rows = rows, .chunk_rows = 4096});
    // In memory (per-batch reads prepare the same way, through the same order(), but reading
    // thousands of random rows a batch from the file takes seconds).
    for (const Mode& m : {Mode{Shuffle::global, kLarge}, Mode{Shuffle::local, kLarge}}) {
      for (const bool paced : {false, true}) {
        SCOPED_TRACE(testing::Message() << rows << " rows, " << train::to_string(m.shuffle)
                                        << ", paced " << paced);
        LoaderOptions o = opts(m.shuffle, static_cast<std::int64_t>(rows / 10), m.budget);
        o.path = file;
        o.memory_budget = std::uint64_t{64} << 20;
        o.prefetch_depth = 2;
        o.paced_producer = paced;
        Loader ahead(world_, o);
        o.background = false;
        Loader sync(world_, o);
        ASSERT_EQ(ahead.steps_per_epoch(), 10);
        // (epoch, batches read)
        const std::int64_t plan[][2] = {{0, 10}, {1, 4}, {2, 10}, {4, 10}, {1, 10}, {2, 3}};
        for (const auto& [epoch, batches] : plan) {
          ahead.start_epoch(epoch);
          sync.start_epoch(epoch);
          for (std::int64_t k = 0; k < batches; ++k) {
            // Room for the idle producer to work on the next order between batches.
            std::this_thread::sleep_for(std::chrono::microseconds(step_us));
            const LoadedBatch* a = ahead.next();
            const LoadedBatch* b = sync.next();
            ASSERT_NE(a, nullptr);
            ASSERT_NE(b, nullptr);
            expect_same_batch(*a, *b);
          }
        }
      }
    }
  }
}

TEST_F(LoaderHandoffTest, HeldProducerLeavesEveryBatchToNext) {
  // Resuming at step 1 discards whatever the producer prepared early, so with the producer
  // held every batch of the epoch is gathered by next(), and they are those of record().
  for (const Mode& m : kInMemory) {
    SCOPED_TRACE(train::to_string(m.shuffle));
    Loader reference(world_, opts(m.shuffle, 7, m.budget));
    const test::Epoch want = test::record(reference, 3, 1);
    Loader l(world_, opts(m.shuffle, 7, m.budget));
    LoaderTestAccess::hold_producer(l, true);
    const test::Epoch got = test::record(l, 3, 1);
    EXPECT_EQ(got.ids, want.ids);
    EXPECT_EQ(got.x, want.x);
    EXPECT_EQ(got.global_rows, want.global_rows);
    EXPECT_EQ(l.consumer_batches(), l.steps_per_epoch() - 1);
    // Released, the producer serves the next epoch again, in order.
    LoaderTestAccess::hold_producer(l, false);
    EXPECT_EQ(test::record(l, 4).ids, test::record(reference, 4).ids);
  }
}

// Counts what it hands out, and on which thread.
struct CountingMemory : train::HostMemory {
  void* allocate(std::size_t bytes) override {
    std::lock_guard<std::mutex> lk(m);
    void* p = std::malloc(bytes);
    if (p == nullptr) throw std::bad_alloc();
    blocks[static_cast<const char*>(p)] = bytes;
    ++allocations;
    if (std::this_thread::get_id() != owner) ++foreign_thread;
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    std::lock_guard<std::mutex> lk(m);
    const auto it = blocks.find(static_cast<const char*>(p));
    if (it == blocks.end() || it->second != bytes) ++bad_frees;
    if (it != blocks.end()) blocks.erase(it);
    std::free(p);
  }
  // Whether [p, p + bytes) lies inside one block handed out.
  bool owns(const void* p, std::size_t bytes) {
    std::lock_guard<std::mutex> lk(m);
    const char* c = static_cast<const char*>(p);
    auto it = blocks.upper_bound(c);
    if (it == blocks.begin()) return false;
    --it;
    return c >= it->first && c + bytes <= it->first + it->second;
  }
  std::mutex m;
  std::map<const char*, std::size_t> blocks;
  int allocations = 0, foreign_thread = 0, bad_frees = 0;
  std::thread::id owner = std::this_thread::get_id();
};

template <class T>
bool inside(CountingMemory& mem, std::span<const T> s) {
  return s.empty() || mem.owns(s.data(), s.size_bytes());
}

TEST_F(LoaderHandoffTest, BatchBuffersComeFromHostMemoryAndAreReturned) {
  for (const Mode& m : kAll) {
    for (bool background : {true, false}) {
      SCOPED_TRACE(testing::Message() << train::to_string(m.shuffle) << " budget " << m.budget
                                      << " background " << background);
      auto mem = std::make_shared<CountingMemory>();
      {
        LoaderOptions o = opts(m.shuffle, 13, m.budget);
        o.background = background;
        o.host_memory = mem;
        Loader l(world_, o);
        int batches = 0;
        for (std::int64_t epoch : {0, 1}) {
          l.start_epoch(epoch);
          if (epoch == 1 && l.residency() == Residency::partition) {
            LoaderTestAccess::hold_producer(l, true);  // next() gathers: same buffers
          }
          while (const LoadedBatch* b = l.next()) {
            ++batches;
            EXPECT_TRUE(inside(*mem, b->x)) << "step " << b->step;
            EXPECT_TRUE(inside(*mem, b->y)) << "step " << b->step;
            EXPECT_TRUE(inside(*mem, b->sample_ids)) << "step " << b->step;
            EXPECT_TRUE(inside(*mem, b->resident_rows)) << "step " << b->step;
          }
          LoaderTestAccess::hold_producer(l, false);
        }
        EXPECT_GT(batches, 0);
        EXPECT_GT(mem->allocations, 0);
      }
      EXPECT_TRUE(mem->blocks.empty()) << mem->blocks.size() << " blocks not returned";
      EXPECT_EQ(mem->bad_frees, 0);
      EXPECT_EQ(mem->foreign_thread, 0) << "allocated off the constructing thread";
    }
  }
}

TEST_F(LoaderHandoffTest, ResidentRowsGatherTheFeaturesOfTheBatch) {
  for (const Mode& m : kAll) {
    SCOPED_TRACE(testing::Message() << train::to_string(m.shuffle) << " budget " << m.budget);
    Loader full(world_, opts(m.shuffle, 7, m.budget));
    const train::ResidentData res = full.resident();
    const bool in_memory = full.residency() == Residency::partition ||
                           full.residency() == Residency::dataset;
    if (!in_memory) {
      EXPECT_EQ(res.rows, 0);
      EXPECT_TRUE(res.x.empty());
      const test::Epoch e = test::record(full, 0);  // checks resident_rows stay empty
      EXPECT_FALSE(e.ids.empty());
      continue;
    }
    const h5::RowRange part = h5::partition_rows(kRows, world_.rank(), world_.size());
    EXPECT_EQ(res.rows, static_cast<std::int64_t>(
                            full.residency() == Residency::dataset ? kRows : part.count));
    EXPECT_EQ(res.cols, static_cast<std::int64_t>(kCols));
    EXPECT_EQ(res.x.size(), static_cast<std::size_t>(res.rows) * kCols);
    EXPECT_EQ(res.y.size(), static_cast<std::size_t>(res.rows));
    for (bool background : {true, false}) {
      LoaderOptions o = opts(m.shuffle, 7, m.budget);
      o.gather_features = false;
      o.background = background;
      Loader lean(world_, o);
      const train::ResidentData lr = lean.resident();
      ASSERT_EQ(lr.x.size(), res.x.size());
      EXPECT_TRUE(same(lr.x, res.x));
      for (std::int64_t epoch : {2, 3}) {
        full.start_epoch(epoch, 1);
        lean.start_epoch(epoch, 1);
        if (epoch == 3) LoaderTestAccess::hold_producer(lean, true);
        while (const LoadedBatch* a = full.next()) {
          const LoadedBatch* b = lean.next();
          ASSERT_NE(b, nullptr);
          EXPECT_TRUE(b->x.empty());
          EXPECT_TRUE(same(a->sample_ids, b->sample_ids));
          EXPECT_TRUE(same(a->y, b->y));
          ASSERT_EQ(b->resident_rows.size(), static_cast<std::size_t>(b->rows));
          std::vector<float> x;  // what a device gathers by index from its copy of resident()
          for (const std::int64_t r : b->resident_rows) {
            const auto at = lr.x.begin() + r * static_cast<std::int64_t>(kCols);
            x.insert(x.end(), at, at + static_cast<std::ptrdiff_t>(kCols));
          }
          EXPECT_TRUE(same<float>(x, a->x)) << "epoch " << epoch << " step " << a->step;
        }
        EXPECT_EQ(lean.next(), nullptr);
        LoaderTestAccess::hold_producer(lean, false);
      }
    }
  }
}

TEST_F(LoaderHandoffTest, GatherFeaturesOffOutOfCoreIsAConfigError) {
  for (Shuffle s : {Shuffle::global, Shuffle::local, Shuffle::none}) {
    LoaderOptions o = opts(s, 7, kTiny);
    o.gather_features = false;
    const std::string what = test::error_of<ConfigError>([&] { Loader l(world_, o); });
    EXPECT_NE(what.find("loader.device_cache_mb"), std::string::npos) << what;
    EXPECT_NE(what.find("loader.memory_budget_mb"), std::string::npos) << what;
    EXPECT_NE(what.find(path()), std::string::npos) << what;
  }
  // The same file is still usable afterwards (it was closed on every rank).
  Loader ok(world_, opts(Shuffle::global, 7, kTiny));
  EXPECT_EQ(ok.residency(), Residency::per_batch);
}

}  // namespace
