// The gradient reducer against a serial reference: every rank gathers every rank's input, sums
// it in rank order in float (bitwise reference) and in double (tolerance reference), and
// checks that all ranks hold the same bits, for the one-shot path and the ready_from protocol.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <random>
#include <vector>

#include "agreed_error.hpp"
#include "locus/comm/reducer.hpp"

// Counts C++ allocations so a test can show the step path allocates nothing (MPI's own
// buffers come from malloc and are not counted).
namespace {
std::atomic<long> g_allocations{0};
}
// GCC pairs the inlined malloc/free below with new/delete and warns; they do match.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
#pragma GCC diagnostic pop

using namespace locus;
using comm::ReduceMode;
using comm::ReducerOptions;

namespace {

// Rank-dependent values spanning 2^-12..2^12 with both signs, so the summation order shows in
// the low bits and a wrong order or a missing contribution cannot pass the bitwise check.
float input_value(int rank, std::size_t i, std::uint32_t seed) {
  std::uint64_t z = (static_cast<std::uint64_t>(seed) << 40) ^
                    (static_cast<std::uint64_t>(rank) << 32) ^ i;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  const double unit = static_cast<double>(z >> 11) / 9007199254740992.0;   // [0, 1)
  const int exponent = static_cast<int>(z % 25) - 12;
  return static_cast<float>((2.0 * unit - 1.0) * std::ldexp(1.0, exponent));
}

struct Reference {
  std::vector<float> in_order;   // ((x0 + x1) + x2) ... in float, then / size
  std::vector<double> exact;     // the same in double
  std::vector<double> bound;     // rounding bound of any float summation order
};

// This rank's input and the reference computed from every rank's gathered input.
struct Case {
  std::vector<float> input;
  Reference ref;
};

Reference reference(const std::vector<float>& all, std::size_t n, int size, ReduceMode mode) {
  Reference ref{std::vector<float>(n), std::vector<double>(n), std::vector<double>(n)};
  for (std::size_t i = 0; i < n; ++i) {
    float acc = all[i];
    double exact = acc;
    double magnitude = std::fabs(acc);
    for (int r = 1; r < size; ++r) {
      const float x = all[static_cast<std::size_t>(r) * n + i];
      acc += x;
      exact += x;
      magnitude += std::fabs(x);
    }
    if (mode == ReduceMode::average) {
      acc /= static_cast<float>(size);
      exact /= size;
      magnitude /= size;
    }
    ref.in_order[i] = acc;
    ref.exact[i] = exact;
    ref.bound[i] = (size + 1) * std::numeric_limits<float>::epsilon() * magnitude;
  }
  return ref;
}

// Collective over world. In presummed mode each rank pre-scales its input by 1/size, as a
// trainer folding the average into its loss would.
Case make_case(const mpi::Comm& world, std::size_t n, std::uint32_t seed,
               ReduceMode mode = ReduceMode::average) {
  const float scale =
      mode == ReduceMode::average ? 1.0f : 1.0f / static_cast<float>(world.size());
  Case c;
  c.input.resize(n);
  for (std::size_t i = 0; i < n; ++i) c.input[i] = input_value(world.rank(), i, seed) * scale;
  std::vector<float> all(n * static_cast<std::size_t>(world.size()));
  MPI_Allgather(c.input.data(), static_cast<int>(n), MPI_FLOAT, all.data(),
                static_cast<int>(n), MPI_FLOAT, world.get());
  c.ref = reference(all, n, world.size(), mode);
  return c;
}

// Checks got against the reference; returns the number of mismatching elements.
std::size_t expect_matches(std::span<const float> got, const Reference& ref, const char* what) {
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const bool same_bits = std::memcmp(&got[i], &ref.in_order[i], sizeof(float)) == 0;
    if (!same_bits || std::fabs(got[i] - ref.exact[i]) > ref.bound[i]) {
      if (bad++ < 5)
        ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", reference "
                      << ref.in_order[i] << " (exact " << ref.exact[i] << ")";
    }
  }
  return bad;
}

// Collective over world: every rank must hold rank 0's bits.
void expect_same_on_all_ranks(const mpi::Comm& world, std::span<const float> v) {
  std::vector<float> root(v.begin(), v.end());
  world.bcast(std::span<float>(root));
  EXPECT_TRUE(v.empty() || std::memcmp(root.data(), v.data(), v.size_bytes()) == 0)
      << "rank " << world.rank() << " differs from rank 0";
}

ReducerOptions make_options(std::size_t bucket, std::size_t chunk, std::size_t small,
                            int in_flight) {
  ReducerOptions o;
  o.bucket_bytes = bucket;
  o.chunk_bytes = chunk;
  o.small_bytes = small;
  o.max_in_flight = in_flight;
  return o;
}

// Random layer sizes (weight + bias) covering [0, n), listed from the first layer.
std::vector<std::size_t> layer_starts(std::size_t n, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<std::size_t> starts;
  std::size_t at = 0;
  while (at < n) {
    starts.push_back(at);
    const std::size_t fan_in = 1 + gen() % 300;
    const std::size_t fan_out = 1 + gen() % 40;
    at += fan_in * fan_out + fan_out;
  }
  return starts;
}

// One streaming step the way the trainer drives it: the buffer starts as NaN (so a bucket
// launched before it is ready poisons the result), then layers are copied in from the last
// one and each is followed by ready_from(its start).
void streaming_step(comm::GradientReducer& r, std::span<float> grads,
                    std::span<const float> input, const std::vector<std::size_t>& starts) {
  std::fill(grads.begin(), grads.end(), std::numeric_limits<float>::quiet_NaN());
  std::size_t end = grads.size();
  for (auto it = starts.rbegin(); it != starts.rend(); ++it) {
    std::copy(input.begin() + static_cast<long>(*it), input.begin() + static_cast<long>(end),
              grads.begin() + static_cast<long>(*it));
    r.ready_from(*it);
    end = *it;
  }
  r.finish();
}

}  // namespace

TEST(Reducer, OneShotMatchesSerialReference) {
  mpi::Comm world = mpi::Comm::world();
  std::vector<float> grads(1);
  // Exchange and scatter/gather chunks, whole and fragmented messages.
  const std::vector<ReducerOptions> configs = {
      ReducerOptions{}, make_options(4096, 1024, 0, 1), make_options(4096, 1024, 1024, 3),
      make_options(1 << 20, 8192, 2048, 2), make_options(1 << 20, 65536, 32768, 3)};
  for (const ReducerOptions& o : configs) {
    auto r = comm::make_gradient_reducer(world, grads, o);
    for (std::size_t n : {0, 1, 3, 7, 255, 256, 257, 1000, 4099, 70001}) {
      const Case c = make_case(world, n, static_cast<std::uint32_t>(n));
      std::vector<float> v = c.input;
      r->allreduce_average(v);
      EXPECT_EQ(expect_matches(v, c.ref, "one-shot"), 0u)
          << "n=" << n << " chunk_bytes=" << o.chunk_bytes << " small_bytes=" << o.small_bytes;
      expect_same_on_all_ranks(world, v);
    }
    EXPECT_EQ(r->stats().oneshot_calls, 10);
  }
}

TEST(Reducer, StreamingBucketSizesAndRandomLayers) {
  mpi::Comm world = mpi::Comm::world();
  const std::size_t n = 100003;
  const Case c = make_case(world, n, 7);
  // Bucket sizes that do and do not divide the buffer, and one larger than the buffer.
  const std::vector<ReducerOptions> configs = {
      make_options(4096, 1024, 1024, 2),     make_options(12340, 4096, 2048, 3),
      make_options(65536, 8192, 0, 4),       make_options(40004, 65536, 16384, 2),
      make_options(100000, 65536, 32768, 3), make_options(1 << 22, 1 << 20, 16384, 4)};
  std::vector<float> grads(n);
  for (const ReducerOptions& o : configs) {
    auto r = comm::make_gradient_reducer(world, grads, o);
    // Layer sizes differ per rank on purpose: only the bucket layout must agree.
    streaming_step(*r, grads, c.input, layer_starts(n, 100 + world.rank()));
    EXPECT_EQ(expect_matches(grads, c.ref, "streaming"), 0u)
        << "bucket_bytes=" << o.bucket_bytes << " chunk_bytes=" << o.chunk_bytes;
    expect_same_on_all_ranks(world, grads);
  }
}

TEST(Reducer, OneElementBuckets) {
  mpi::Comm world = mpi::Comm::world();
  const std::size_t n = 2001;
  std::vector<float> grads(n);
  auto r = comm::make_gradient_reducer(world, grads, make_options(4, 1024, 0, 3));
  const Case c = make_case(world, n, 13);
  streaming_step(*r, grads, c.input, layer_starts(n, 200 + world.rank()));
  EXPECT_EQ(expect_matches(grads, c.ref, "one-element buckets"), 0u);
}

TEST(Reducer, BufferSmallerThanOneBucket) {
  mpi::Comm world = mpi::Comm::world();
  for (std::size_t n : {1, 5, 300}) {
    std::vector<float> grads(n);
    auto r = comm::make_gradient_reducer(world, grads, make_options(1 << 20, 4096, 0, 2));
    const Case c = make_case(world, n, 11);
    streaming_step(*r, grads, c.input, {0, n / 2});
    EXPECT_EQ(expect_matches(grads, c.ref, "small buffer"), 0u) << "n=" << n;
  }
}

TEST(Reducer, RepeatedStepsReuseBuffersAndAllocateNothing) {
  mpi::Comm world = mpi::Comm::world();
  const std::size_t n = 50000;
  std::vector<float> grads(n);
  auto r = comm::make_gradient_reducer(world, grads, make_options(16384, 4096, 1024, 3));
  const auto starts = layer_starts(n, 5);
  std::vector<float> oneshot(n);
  for (std::uint32_t step = 0; step < 5; ++step) {
    const Case c = make_case(world, n, step);
    std::copy(c.input.begin(), c.input.end(), oneshot.begin());
    const long before = g_allocations.load();
    streaming_step(*r, grads, c.input, starts);
    r->allreduce_average(oneshot);
    EXPECT_EQ(g_allocations.load() - before, 0) << "step " << step << " allocated";
    EXPECT_EQ(expect_matches(grads, c.ref, "repeated step"), 0u) << "step " << step;
    // The streaming and one-shot paths agree bit for bit.
    EXPECT_EQ(std::memcmp(grads.data(), oneshot.data(), n * sizeof(float)), 0);
  }
  const comm::ReducerStats& s = r->stats();
  EXPECT_EQ(s.steps, 5);
  EXPECT_GE(s.last.comm_s, 0.0);
  EXPECT_GE(s.total.blocked_s, s.last.blocked_s);
  EXPECT_GE(s.last.hidden_fraction(), 0.0);
  EXPECT_LE(s.last.hidden_fraction(), 1.0);
}

TEST(Reducer, PresummedAverageOnlySums) {
  mpi::Comm world = mpi::Comm::world();
  const std::size_t n = 20000;
  std::vector<float> grads(n);
  ReducerOptions o = make_options(8192, 2048, 1024, 2);
  o.mode = ReduceMode::presummed_average;
  auto r = comm::make_gradient_reducer(world, grads, o);
  const Case c = make_case(world, n, 3, ReduceMode::presummed_average);
  streaming_step(*r, grads, c.input, layer_starts(n, 9));
  EXPECT_EQ(expect_matches(grads, c.ref, "presummed"), 0u);
}

TEST(Reducer, DeterministicAcrossRepeats) {
  mpi::Comm world = mpi::Comm::world();
  const std::size_t n = 30001;
  std::vector<float> first(n);
  std::vector<float> grads(n);
  auto r = comm::make_gradient_reducer(world, grads, make_options(8192, 1024, 0, 4));
  const Case c = make_case(world, n, 21);
  for (int repeat = 0; repeat < 3; ++repeat) {
    streaming_step(*r, grads, c.input, layer_starts(n, 1 + repeat));
    if (repeat == 0) first = grads;
    EXPECT_EQ(std::memcmp(first.data(), grads.data(), n * sizeof(float)), 0)
        << "repeat " << repeat;
  }
}

TEST(Reducer, ReadyFromMustNotGoBackwards) {
  mpi::Comm world = mpi::Comm::world();
  const std::size_t n = 10000;
  std::vector<float> grads(n);
  auto r = comm::make_gradient_reducer(world, grads, make_options(4096, 1024, 0, 2));
  const Case c = make_case(world, n, 4);
  grads = c.input;
  r->ready_from(n / 2);
  EXPECT_THROW(r->ready_from(n), InternalError);
  EXPECT_THROW(r->ready_from(n + 1), InternalError);
  r->finish();   // the step still completes correctly
  EXPECT_EQ(expect_matches(grads, c.ref, "after misuse"), 0u);
}

TEST(Reducer, MessagesStayOnTheDuplicatedCommunicator) {
  mpi::Comm world = mpi::Comm::world();
  const Case c = make_case(world, 5000, 1);
  // A wildcard receive on the caller's communicator must not catch reducer traffic.
  int sink = 0;
  MPI_Request pending = MPI_REQUEST_NULL;
  MPI_Irecv(&sink, 1, MPI_INT, MPI_ANY_SOURCE, MPI_ANY_TAG, world.get(), &pending);
  std::vector<float> grads = c.input;
  auto r = comm::make_gradient_reducer(world, grads, make_options(4096, 1024, 0, 2));
  r->allreduce_average(grads);
  streaming_step(*r, grads, c.input, {0, 1000, 3000});
  int caught = 0;
  MPI_Test(&pending, &caught, MPI_STATUS_IGNORE);
  EXPECT_EQ(caught, 0) << "the reducer's messages leaked onto the caller's communicator";
  const int mine = 42;
  MPI_Send(&mine, 1, MPI_INT, world.rank(), 0, world.get());
  MPI_Wait(&pending, MPI_STATUS_IGNORE);
  EXPECT_EQ(sink, 42);
}

TEST(Reducer, BadOptionsAreConfigErrorsOnEveryRank) {
  mpi::Comm world = mpi::Comm::world();
  std::vector<float> grads(100);
  ReducerOptions bad;
  bad.chunk_bytes = 16;
  EXPECT_THROW(comm::make_gradient_reducer(world, grads, bad), ConfigError);
  bad = ReducerOptions{};
  bad.max_in_flight = 0;
  EXPECT_THROW(comm::make_gradient_reducer(world, grads, bad), ConfigError);
  bad = ReducerOptions{};
  bad.backend = comm::ReducerBackend::nccl;
  EXPECT_THROW(comm::make_gradient_reducer(world, grads, bad), ConfigError);
  // One rank with a bad option: every rank throws the agreed error.
  ReducerOptions one_bad;
  if (world.rank() == world.size() - 1) one_bad.bucket_bytes = 0;
  const std::string one = test::agreed_error<ConfigError>(
      [&] { comm::make_gradient_reducer(world, grads, one_bad); });
  EXPECT_NE(one.find("bucket_bytes=0"), std::string::npos) << one;
}

TEST(Reducer, MismatchedBufferLengthsAreRejectedEverywhere) {
  mpi::Comm world = mpi::Comm::world();
  if (world.size() == 1) GTEST_SKIP() << "needs two ranks";
  std::vector<float> grads(world.rank() == 0 ? 100 : 101);
  const std::string what =
      test::agreed_error<ConfigError>([&] { comm::make_gradient_reducer(world, grads); });
  EXPECT_NE(what.find("from 100 to 101"), std::string::npos) << what;
}

// train.reducer = nccl on host gradients, and nccl where NCCL cannot reduce them, are agreed
// ConfigErrors naming the setting and the way out; the reason is the same on every rank.
TEST(Reducer, NcclIsRefusedWhereItCannotRun) {
  mpi::Comm world = mpi::Comm::world();
  std::vector<float> grads(64);
  ReducerOptions o;
  o.backend = comm::ReducerBackend::nccl;
  {
    const std::string what =
        test::agreed_error<ConfigError>([&] { comm::make_gradient_reducer(world, grads, o); });
    EXPECT_NE(what.find("train.reducer = nccl"), std::string::npos) << what;
    EXPECT_NE(what.find("train.reducer = auto or mpi"), std::string::npos) << what;
  }
  const comm::GradientBuffer host{grads.data(), grads.size(), comm::MemorySpace::host, nullptr};
  const std::string why = comm::nccl_unusable_reason(world, host);
  EXPECT_FALSE(why.empty());
  EXPECT_TRUE(why == "the gradients are in host memory" ||
              why == "this build has no NCCL (LOCUS_WITH_NCCL=0)") << why;
  try {
    comm::make_nccl_reducer(world, host, o);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
  EXPECT_EQ(comm::parse_reducer_backend("auto"), comm::ReducerBackend::automatic);
  EXPECT_EQ(comm::to_string(comm::parse_reducer_backend("nccl")), "nccl");
  EXPECT_THROW(comm::parse_reducer_backend("gloo"), ConfigError);
  ReducerOptions bad;
  bad.timeout_s = -1;
  EXPECT_THROW(comm::make_gradient_reducer(world, grads, bad), ConfigError);
}

// train.reducer_precision = bf16 is the NCCL reducer's: the MPI reducer, which sums host
// gradients in fp32, refuses it (agreed) naming the key and the way out.
TEST(Reducer, Bf16SumsAreRefusedByTheMpiReducer) {
  mpi::Comm world = mpi::Comm::world();
  std::vector<float> grads(64);
  ReducerOptions o;
  o.precision = comm::ReducePrecision::bf16;
  try {
    comm::make_gradient_reducer(world, grads, o);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(e.agreed());
    const std::string what = e.what();
    EXPECT_NE(what.find("train.reducer_precision = bf16 sums in bf16 on the NCCL reducer only"),
              std::string::npos)
        << what;
    EXPECT_NE(what.find("the MPI reducer"), std::string::npos) << what;
    EXPECT_NE(what.find("set train.reducer_precision = fp32"), std::string::npos) << what;
  }
  EXPECT_EQ(comm::parse_reduce_precision("bf16"), comm::ReducePrecision::bf16);
  EXPECT_EQ(comm::to_string(comm::parse_reduce_precision("fp32")), "fp32");
  try {
    comm::parse_reduce_precision("fp16");
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.reducer_precision = fp16"), std::string::npos)
        << e.what();
  }
}
