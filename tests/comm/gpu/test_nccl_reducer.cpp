// The NCCL gradient reducer (lib/comm/src/nccl_reducer.cpp) on real devices: the streaming
// protocol (ready_from per layer, then finish) against MPI's sum of the same host values,
// ordered after the work its producer stream had queued, bitwise repeatable; the average mode
// against MPI's sum divided by the size. Where the ranks share a GPU (2 ranks on a 1-GPU host)
// NCCL cannot form one communicator: then the refusal itself is checked, with the reason
// train.reducer = auto prints before it falls back to the host-staged reducer. A reduction a
// peer never joins ends in an NcclError within the timeout, the communicator aborted. The
// reducer's communication time and the part of it waited for are timed on the device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "comm_gpu_util.hpp"
#include "locus/comm/error.hpp"
#include "locus/comm/reducer.hpp"

namespace locus::comm {
namespace {

using test::no_device;

class NcclReducer : public ::testing::Test {
 protected:
  void SetUp() override {
    // Agreed over the world: either every rank skips or none does.
    const int missing = mpi::Comm::world().allreduce(no_device() ? 1 : 0, MPI_MAX);
    if (missing != 0) GTEST_SKIP() << (no_device() ? *no_device() : "a peer rank has no device");
    int count = 0;
    CU(cudaGetDeviceCount(&count));
    CU(cudaSetDevice(mpi::Comm::world().rank() % count));
    CU(cudaStreamCreateWithFlags(&producer_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (producer_ != nullptr) cudaStreamDestroy(producer_);
  }
  // Collective: whether the world's ranks can share one NCCL communicator; else the reason.
  std::string reason(const GradientBuffer& g) {
    return nccl_unusable_reason(mpi::Comm::world(), g);
  }
  cudaStream_t producer_ = nullptr;
};

// Values of element i on rank r: exact in float, different per rank and element.
float value(int r, std::size_t i) {
  return static_cast<float>(static_cast<int>((i * 2654435761u + 97u * static_cast<unsigned>(r)) %
                                             2001u) - 1000) / 64.0f;
}

TEST_F(NcclReducer, StreamsBucketsAfterTheProducerAndMatchesMpi) {
  const mpi::Comm world = mpi::Comm::world();
  constexpr std::size_t n = (std::size_t{1} << 20) + 3;  // buckets of 64 KiB, a short first one
  float* d = nullptr;
  CU(cudaMalloc(&d, n * sizeof(float)));
  GradientBuffer g{d, n, MemorySpace::cuda, producer_};
  const std::string why = reason(g);
  if (!why.empty()) {
    // The ranks share a device: make_nccl_reducer refuses on every rank, naming why.
    ReducerOptions o;
    o.backend = ReducerBackend::nccl;
    try {
      make_nccl_reducer(world, g, o);
      ADD_FAILURE() << "NCCL accepted ranks that " << why;
    } catch (const ConfigError& e) {
      EXPECT_TRUE(e.agreed());
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
    cudaFree(d);
    if (test::nccl_required()) FAIL() << "LOCUS_REQUIRE_NCCL=1, but NCCL refused: " << why;
    GTEST_SKIP() << "the NCCL path needs a GPU per rank here: " << why;
  }
  std::vector<float> mine(n), want(n);
  for (std::size_t i = 0; i < n; ++i) mine[i] = value(world.rank(), i);
  want = mine;
  world.allreduce_inplace(std::span<float>(want), MPI_SUM);

  float* pinned = nullptr;
  CU(cudaMallocHost(&pinned, n * sizeof(float)));
  float* slow = nullptr;  // 256 MiB the producer copies first: a reducer that did not wait for
  constexpr std::size_t kSlow = std::size_t{64} << 20;  // its stream would read stale values
  CU(cudaMalloc(&slow, 2 * kSlow * sizeof(float)));

  for (const ReduceMode mode : {ReduceMode::presummed_average, ReduceMode::average}) {
    ReducerOptions o;
    o.backend = ReducerBackend::nccl;
    o.mode = mode;
    o.bucket_bytes = std::size_t{64} << 10;
    o.timeout_s = 30;  // a hang ends as an NcclError naming it, within the run's limit
    auto reducer = make_nccl_reducer(world, g, o);
    EXPECT_EQ(reducer->name(), "nccl");
    std::vector<float> first;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE(::testing::Message() << "mode " << static_cast<int>(mode) << " step " << step);
      CU(cudaMemsetAsync(d, 0xFF, n * sizeof(float), producer_));  // NaN until the copy lands
      CU(cudaMemcpyAsync(slow + kSlow, slow, kSlow * sizeof(float), cudaMemcpyDeviceToDevice,
                         producer_));
      std::memcpy(pinned, mine.data(), n * sizeof(float));
      CU(cudaMemcpyAsync(d, pinned, n * sizeof(float), cudaMemcpyHostToDevice, producer_));
      // "Layers" become ready from the end, at uneven offsets, as a backward pass makes them.
      for (const std::size_t off : {n - 10, n - 70000, std::size_t{500000}, std::size_t{3}}) {
        reducer->ready_from(off);
      }
      reducer->finish();
      // settle(): the step just finished has its reduction done, so the producer's stream --
      // its work before it, then a wait for it -- is complete (or is within moments).
      reducer->settle(producer_);
      const auto settled = std::chrono::steady_clock::now();
      cudaError_t q = cudaStreamQuery(producer_);
      while (q == cudaErrorNotReady &&
             std::chrono::steady_clock::now() - settled < std::chrono::seconds(1)) {
        q = cudaStreamQuery(producer_);
      }
      EXPECT_EQ(q, cudaSuccess) << "the producer's stream still busy 1 s after settle()";
      std::vector<float> got(n);
      CU(cudaMemcpyAsync(got.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, producer_));
      CU(cudaStreamSynchronize(producer_));
      const float scale = mode == ReduceMode::average ? 1.0f / static_cast<float>(world.size())
                                                      : 1.0f;
      std::size_t bad = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float w = want[i] * scale;
        // Up to 2 ranks a sum of two floats is order-free: exact; beyond, NCCL's ring order
        // may differ from MPI's, within a few ulps of the magnitudes.
        const float tol = world.size() <= 2 ? 0.0f : 1e-5f * (std::abs(w) + 1.0f);
        bad += !(std::abs(got[i] - w) <= tol) ? 1 : 0;
      }
      EXPECT_EQ(bad, 0u) << "elements differing from MPI's sum";
      if (step == 0) {
        first = got;
      } else {
        EXPECT_EQ(std::memcmp(first.data(), got.data(), n * sizeof(float)), 0)
            << "not bitwise repeatable";
      }
    }
    EXPECT_EQ(reducer->stats().steps, 3);
  }
  cudaFree(slow);
  cudaFreeHost(pinned);
  cudaFree(d);
}

// The reducer's times come from the device: a step's communication from where its first
// bucket may start to the end of its last, and the part the producer's stream waited for after
// its backward. Buckets all ready before the producer's long last "layer" (copies of 256 MiB,
// about 80 ms on an H200) are hidden behind it; buckets made ready only by finish(), after it,
// are waited for whole. Each step's figures are in the totals once its reduction is done, the
// hidden ones too. bf16 sums, so that the reducer's own kernels (rounding, widening) give a
// communication time to measure at 1 rank too; at 2 ranks (sockets between two ranks of one
// GPU: milliseconds a bucket) a smaller buffer, so the reduction stays shorter than the layer.
TEST_F(NcclReducer, ReductionTimesAndTheirHiddenShareComeFromTheDevice) {
  const mpi::Comm world = mpi::Comm::world();
  const std::size_t n = world.size() == 1 ? std::size_t{1} << 24 : std::size_t{1} << 20;
  float* d = nullptr;
  CU(cudaMalloc(&d, n * sizeof(float)));
  CU(cudaMemset(d, 0, n * sizeof(float)));
  GradientBuffer g{d, n, MemorySpace::cuda, producer_};
  if (const std::string why = reason(g); !why.empty()) {
    cudaFree(d);
    if (test::nccl_required()) FAIL() << "LOCUS_REQUIRE_NCCL=1, but NCCL refused: " << why;
    GTEST_SKIP() << "the NCCL path needs a GPU per rank here: " << why;
  }
  constexpr std::size_t kSlow = std::size_t{64} << 20;  // floats: 256 MiB a copy
  float* slow = nullptr;
  CU(cudaMalloc(&slow, 2 * kSlow * sizeof(float)));
  auto long_layer = [&] {
    for (int i = 0; i < 640; ++i) {
      CU(cudaMemcpyAsync(slow + kSlow, slow, kSlow * sizeof(float), cudaMemcpyDeviceToDevice,
                         producer_));
    }
  };
  ReducerOptions o;
  o.backend = ReducerBackend::nccl;
  o.precision = ReducePrecision::bf16;
  o.bucket_bytes = std::size_t{1} << 20;
  o.timeout_s = 30;
  auto reducer = make_nccl_reducer(world, g, o);
  struct Times {
    double comm = 0, blocked = 0;
  };
  auto run = [&](bool ready_first) {
    const ReduceTimes before = reducer->stats().total;
    for (int step = 0; step < 4; ++step) {
      if (ready_first) reducer->ready_from(0);
      long_layer();
      reducer->finish();
    }
    reducer->settle(producer_);
    const ReduceTimes after = reducer->stats().total;
    return Times{after.comm_s - before.comm_s, after.blocked_s - before.blocked_s};
  };
  const Times hidden = run(true), exposed = run(false);
  EXPECT_EQ(reducer->stats().steps, 8);
  for (const Times& t : {hidden, exposed}) {
    EXPECT_GE(t.blocked, 0.0);
    EXPECT_LE(t.blocked, t.comm) << "a wait longer than the communication";
  }
  EXPECT_GT(exposed.comm, 0.0);
  // Every hidden step counted: about the exposed run's communication (more where the layer's
  // copies slow it), not a share of it.
  EXPECT_GE(hidden.comm, 0.5 * exposed.comm)
      << "hidden steps' times missing: " << hidden.comm << " s against " << exposed.comm << " s";
  // Hidden: the producer's stream reached its wait long after the reduction ended.
  EXPECT_LE(hidden.blocked, 0.2 * hidden.comm)
      << "comm " << hidden.comm << " s, blocked " << hidden.blocked << " s";
  // Exposed: the reduction started where the producer began to wait for it.
  EXPECT_GE(exposed.blocked, 0.5 * exposed.comm)
      << "comm " << exposed.comm << " s, blocked " << exposed.blocked << " s";
  reducer.reset();
  cudaFree(slow);
  cudaFree(d);
}

// train.reducer_precision = bf16: each rank's gradients are rounded to bf16 (nearest, ties to
// even), NCCL sums them in bf16, and the sum comes back widened: every result is a bf16 value
// (its low 16 bits zero), at 1 rank exactly the rounded gradient, at 2 within one bf16 unit
// of the float sum of the ranks' rounded gradients; bitwise repeatable, sum and average.
float bf16_round(float x) {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

TEST_F(NcclReducer, Bf16SumsRoundEachRanksGradientsAndRepeat) {
  const mpi::Comm world = mpi::Comm::world();
  constexpr std::size_t n = (std::size_t{1} << 18) + 5;
  float* d = nullptr;
  CU(cudaMalloc(&d, n * sizeof(float)));
  GradientBuffer g{d, n, MemorySpace::cuda, producer_};
  if (const std::string why = reason(g); !why.empty()) {
    cudaFree(d);
    if (test::nccl_required()) FAIL() << "LOCUS_REQUIRE_NCCL=1, but NCCL refused: " << why;
    GTEST_SKIP() << "the NCCL path needs a GPU per rank here: " << why;
  }
  // Values with more than bf16's 8 significant bits, different on every rank.
  std::vector<float> mine(n), rounded(n);
  std::mt19937 gen(static_cast<unsigned>(17 + world.rank()));
  std::uniform_real_distribution<float> uniform(-4.0f, 4.0f);
  for (std::size_t i = 0; i < n; ++i) {
    mine[i] = uniform(gen);
    rounded[i] = bf16_round(mine[i]);
  }
  std::vector<float> want = rounded;
  world.allreduce_inplace(std::span<float>(want), MPI_SUM);
  for (const ReduceMode mode : {ReduceMode::presummed_average, ReduceMode::average}) {
    ReducerOptions o;
    o.backend = ReducerBackend::nccl;
    o.mode = mode;
    o.precision = ReducePrecision::bf16;
    o.bucket_bytes = std::size_t{64} << 10;
    o.timeout_s = 30;
    auto reducer = make_nccl_reducer(world, g, o);
    EXPECT_NE(reducer->reduction().find("summed in bf16"), std::string::npos)
        << reducer->reduction();
    const float scale = mode == ReduceMode::average ? 1.0f / static_cast<float>(world.size())
                                                    : 1.0f;
    std::vector<float> first;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE(::testing::Message() << "mode " << static_cast<int>(mode) << " step " << step);
      CU(cudaMemcpyAsync(d, mine.data(), n * sizeof(float), cudaMemcpyHostToDevice, producer_));
      reducer->ready_from(n / 2);
      reducer->finish();
      reducer->settle(producer_);
      std::vector<float> got(n);
      CU(cudaMemcpyAsync(got.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost, producer_));
      CU(cudaStreamSynchronize(producer_));
      std::size_t not_bf16 = 0, off = 0;
      for (std::size_t i = 0; i < n; ++i) {
        std::uint32_t u = 0;
        std::memcpy(&u, &got[i], sizeof(u));
        not_bf16 += (u & 0xFFFFu) != 0 ? 1 : 0;
        const float w = want[i] * scale;
        // 2 ranks: one rounding of their sum; more: one per partial sum of the ring.
        const float tol = world.size() == 1 ? 0.0f
                                            : static_cast<float>(world.size() - 1) *
                                                  (std::abs(w) / 128.0f + 1e-30f);
        off += !(std::abs(got[i] - w) <= tol) ? 1 : 0;
      }
      EXPECT_EQ(not_bf16, 0u) << "results that are not bf16 values";
      EXPECT_EQ(off, 0u) << "results off the sum of the rounded gradients";
      if (step == 0) {
        first = got;
      } else {
        EXPECT_EQ(std::memcmp(first.data(), got.data(), n * sizeof(float)), 0)
            << "not bitwise repeatable";
      }
    }
  }
  cudaFree(d);
}

// A reduction one rank never joins: after `steps` whole steps on every rank, rank 0 reduces
// n floats alone and its wait gives up (test::give_up: an NcclError within the timeout, then
// the reducer goes); the others, told over MPI, leave by unwinding as a rank does on an error,
// which aborts too. `gave_up` is rank 0's. Skips (or fails under LOCUS_REQUIRE_NCCL=1) where
// NCCL cannot join the ranks.
struct Unwind {};
void abandon_a_reduction(cudaStream_t producer, std::size_t n, int steps, test::GaveUp& gave_up) {
  const mpi::Comm world = mpi::Comm::world();
  if (world.size() < 2) GTEST_SKIP() << "a peer that never joins needs 2 ranks or more";
  float* d = nullptr;
  CU(cudaMalloc(&d, n * sizeof(float)));
  CU(cudaMemset(d, 0, n * sizeof(float)));
  GradientBuffer g{d, n, MemorySpace::cuda, producer};
  if (const std::string why = nccl_unusable_reason(world, g); !why.empty()) {
    cudaFree(d);
    if (test::nccl_required()) FAIL() << "LOCUS_REQUIRE_NCCL=1, but NCCL refused: " << why;
    GTEST_SKIP() << "the NCCL path needs a GPU per rank here: " << why;
  }
  ReducerOptions o;
  o.backend = ReducerBackend::nccl;
  o.timeout_s = 3;
  const int r = world.rank();
  try {
    auto reducer = make_nccl_reducer(world, g, o);
    for (int step = 0; step < steps; ++step) {
      reducer->finish();
      reducer->settle(producer);
    }
    if (r == 0) {
      gave_up = test::give_up(
          [&] {
            reducer->finish();
            reducer->settle(producer);
          },
          [&] { reducer.reset(); });
    }
    world.barrier();  // the peers keep their reducers until rank 0 has given up
    if (r != 0) throw Unwind{};
  } catch (const Unwind&) {
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << "the aborted reduction's kernel must end";
  cudaFree(d);
  world.barrier();
}

// After a first step, which made the communicator's connections: rank 0's wait for the
// reduction (8 Mi floats, past what NCCL buffers) names the all-reduce and the timeout, within
// the timeout plus the polling tick; the communicator is aborted (its kernel ends: the device
// stays usable) and the reducer then goes at once.
TEST_F(NcclReducer, AReductionAPeerNeverJoinsEndsInAnNcclErrorWithinTheTimeout) {
  test::GaveUp gave_up;
  abandon_a_reduction(producer_, std::size_t{8} << 20, 1, gave_up);
  if (IsSkipped() || HasFatalFailure()) return;
  if (mpi::Comm::world().rank() == 0) test::expect_gave_up_in_time(gave_up, "gradient all-reduce");
}

// The communicator's very first reduction: its connections are still to be made (NCCL makes
// them at the first collective, on a non-blocking communicator in a thread of its own), so
// rank 0 gives up while NCCL may still be connecting -- inside ncclAllReduce's enqueue (the
// error names the call) or in the wait after it -- and the abort must end that too. Last in
// this file: were the abort to hang, the tests above have reported already.
TEST_F(NcclReducer, AFirstReductionAPeerNeverJoinsEndsInAnNcclErrorWithinTheTimeout) {
  test::GaveUp gave_up;
  abandon_a_reduction(producer_, std::size_t{1} << 20, 0, gave_up);
  if (IsSkipped() || HasFatalFailure()) return;
  if (mpi::Comm::world().rank() == 0) {
    EXPECT_TRUE(gave_up.error.find("ncclAllReduce") != std::string::npos ||
                gave_up.error.find("gradient all-reduce") != std::string::npos)
        << gave_up.error;
    test::expect_gave_up_in_time(gave_up, "");
  }
}

}  // namespace
}  // namespace locus::comm
