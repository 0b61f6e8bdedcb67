// The trainer's side of copying inputs ahead (train_loop.cpp, step() and
// drop_prefetched_epoch()), on the CPU at 1, 2 and 4 ranks: the cpu backend behind a model of a
// device's asynchronous input copies (async_input_compute.hpp). Every batch copied ahead is the
// one the next step gets, its memory untouched until then; an epoch's first batch is copied
// during the epoch before; stops and restores drop what was copied ahead before the loader
// reuses it; and the weights are bitwise those of the plain cpu backend, which reads each batch
// where the loader hands it out -- also when batches come as row indices into a cached or
// mapped block. The GPU tests (gpu/test_cuda_trainer.cpp) run the real copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "async_input_compute.hpp"
#include "test_trainer_util.hpp"

namespace locus::train::test {
namespace {

using namespace std::chrono_literals;

const mpi::Comm& world() {
  static const mpi::Comm w = mpi::Comm::world();
  return w;
}

class TrainerPrefetch : public WorldDataSuite {
 protected:
  // small_options() over 4 epochs: 15 steps each (600 rows, global batch 42).
  static TrainOptions options(Shuffle shuffle) {
    TrainOptions o = small_options(data());
    o.epochs = 4;
    o.data.shuffle = shuffle;
    o.model.dropout = 0.2f;  // masks keyed by the step and sample ids the copy carries
    return o;
  }
  // The options of a run through the model, which logs to `log`. A 5 ms step keeps the paced
  // producer ahead (it gathers these batches in microseconds), as it is ahead of a device.
  static TrainOptions through_model(TrainOptions o, const std::shared_ptr<InputLog>& log) {
    o.compute.factory = async_input_factory(world(), log, {.step_delay = 5ms});
    return o;
  }
};

std::vector<float> params_of(const Trainer& t) {
  const auto p = t.state().model.params();
  return {p.begin(), p.end()};
}

std::vector<float> plain_run(const TrainOptions& o) {
  const Grid grid(world(), 1);
  Trainer t(grid, o);
  const TrainSummary s = t.train();
  EXPECT_TRUE(s.finished);
  return params_of(t);
}

// Steps that found their inputs copied ahead at the start of an epoch (but the first).
std::int64_t used_at_epoch_starts(const InputLog& log, std::int64_t steps_per_epoch) {
  return std::count_if(log.used_at.begin(), log.used_at.end(), [&](std::uint64_t s) {
    return s > 0 && static_cast<std::int64_t>(s) % steps_per_epoch == 0;
  });
}

void expect_untorn(const InputLog& log) {
  EXPECT_TRUE(log.torn.empty()) << log.torn.size() << " torn copies, the first: "
                                << (log.torn.empty() ? "" : log.torn.front());
  EXPECT_EQ(log.live_blocks.load(), 0) << "the loaders did not return all their batch buffers";
}

class EveryShuffle : public TrainerPrefetch, public ::testing::WithParamInterface<Shuffle> {};

TEST_P(EveryShuffle, CopiesAheadAreTheBatchesTheStepsGet) {
  const TrainOptions o = options(GetParam());
  auto log = std::make_shared<InputLog>();
  std::vector<float> copied;
  std::int64_t steps_per_epoch = 0, planned = 0;
  {
    const Grid grid(world(), 1);
    Trainer t(grid, through_model(o, log));
    EXPECT_NE(t.compute_description().find("inputs copied ahead"), std::string::npos);
    steps_per_epoch = t.steps_per_epoch();
    planned = t.planned_steps();
    EXPECT_TRUE(t.train().finished);
    copied = params_of(t);
  }
  ASSERT_EQ(steps_per_epoch, 15);
  if (world().is_root()) {
    std::printf("    rank 0: %lld of %lld steps found their inputs copied ahead, %lld at an "
                "epoch's start\n",
                static_cast<long long>(log->used), static_cast<long long>(planned),
                static_cast<long long>(used_at_epoch_starts(*log, steps_per_epoch)));
  }
  expect_untorn(*log);
  EXPECT_EQ(log->steps, planned);
  // An uninterrupted run copies nothing it does not use: nothing replaced, nothing dropped.
  EXPECT_EQ(log->wasted, 0);
  EXPECT_EQ(log->dropped, 0);
  EXPECT_EQ(log->used, log->prefetched);
  // The producer is ahead of each 5 ms step: most steps find their inputs there, and some
  // epochs' first batches were copied during the epoch before (all 3 unless a busy machine
  // kept the producer from running for a whole step).
  EXPECT_GE(log->used, planned / 2) << "of " << planned << " steps";
  EXPECT_GE(used_at_epoch_starts(*log, steps_per_epoch), 1)
      << "no epoch's first batch was copied during the epoch before";
  EXPECT_EQ(copied, plain_run(o)) << "computing on the copies changed the weights";
}

INSTANTIATE_TEST_SUITE_P(Trainer, EveryShuffle,
                         ::testing::Values(Shuffle::global, Shuffle::local, Shuffle::none),
                         [](const auto& p) { return std::string(to_string(p.param)); });

// loader.device_cache_mb and loader.gather = device through the model: batches come as row
// indices (the loader gathers no features), copied ahead as such, their rows gathered from the
// model's copy of the block or from the loader's block in place -- bitwise the streamed run.
TEST_F(TrainerPrefetch, ResidentSamplesTrainBitwiseAsStreamedBatches) {
  for (const Shuffle shuffle : {Shuffle::global, Shuffle::local}) {
    const TrainOptions o = options(shuffle);
    const std::vector<float> streamed = plain_run(o);
    for (const bool cache : {true, false}) {
      SCOPED_TRACE(::testing::Message() << to_string(shuffle) << (cache ? ", cached" : ", mapped"));
      auto log = std::make_shared<InputLog>();
      TrainOptions r = through_model(o, log);
      if (cache) {
        r.device_cache_bytes = 1ULL << 30;
      } else {
        r.device_gather = true;
      }
      std::vector<float> got;
      std::int64_t planned = 0;
      {
        const Grid grid(world(), 1);
        Trainer t(grid, r);
        planned = t.planned_steps();
        EXPECT_TRUE(t.train().finished);
        got = params_of(t);
      }
      expect_untorn(*log);
      EXPECT_EQ(log->index_batches, planned) << "every step's batch must come as row indices";
      EXPECT_EQ(log->wasted, 0);
      EXPECT_EQ(log->dropped, 0);
      EXPECT_GE(log->used, 1) << "no batch of row indices was copied ahead";
      EXPECT_EQ(got, streamed) << "the gathered rows trained other weights";
    }
  }
}

// train() stopped at an epoch's end (its last step copied the next epoch's first batch), then
// mid-epoch, then rewound to an earlier state (what a restore does) and run to the end: each
// stop drops what was copied ahead, and the weights are those of one uninterrupted run.
TEST_F(TrainerPrefetch, StopsAndRestoresDropWhatWasCopiedAhead) {
  const TrainOptions o = options(Shuffle::global);
  auto log = std::make_shared<InputLog>();
  std::vector<float> resumed;
  {
    const Grid grid(world(), 1);
    Trainer t(grid, through_model(o, log));
    Trainer keeper(grid, o);  // holds the state at step 15
    EXPECT_FALSE(t.train(nullptr, 15).finished);
    keeper.state().assign(t.state());
    EXPECT_FALSE(t.train(nullptr, 22).finished);
    EXPECT_FALSE(t.train(nullptr, 37).finished);
    t.state().assign(keeper.state());  // back to the end of epoch 0
    EXPECT_TRUE(t.train().finished);
    resumed = params_of(t);
  }
  if (world().is_root()) {
    std::printf("    rank 0: %lld copies used, %lld dropped by the stops\n",
                static_cast<long long>(log->used), static_cast<long long>(log->dropped));
  }
  expect_untorn(*log);
  EXPECT_EQ(log->wasted, 0);
  // At most one copy per stop is left unused (the next step's, or the next epoch's first).
  EXPECT_LE(log->dropped, 3);
  EXPECT_EQ(log->used + log->dropped, log->prefetched);
  EXPECT_EQ(log->steps, 15 + 7 + 15 + 45);
  EXPECT_EQ(resumed, plain_run(o)) << "a stop or a restore fed a step the wrong inputs";
}

}  // namespace
}  // namespace locus::train::test
