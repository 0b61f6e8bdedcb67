// The hierarchical gradient reducer (train.reduction = hierarchical) against the flat one and
// against a serial reference summed in the order it claims: with nodes of consecutive ranks
// (LOCUS_TEST_RANKS_PER_NODE) bitwise equal to flat; with interleaved nodes (Slurm node names
// alternating by rank) summed node by node, bitwise repeatable and the same on every rank.
// train.reduction = auto picks hierarchical only for several nodes with more than one rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "agreed_error.hpp"
#include "locus/comm/reducer.hpp"
#include "scoped_env.hpp"

using locus::test_support::ScopedEnv;

using namespace locus;
using comm::Reduction;
using comm::ReducerOptions;

namespace {

// Rank-dependent values over 2^-12..2^12 with both signs: the summation order shows in the
// low bits.
float input_value(int rank, std::size_t i, std::uint32_t seed) {
  std::uint64_t z = (static_cast<std::uint64_t>(seed) << 40) ^
                    (static_cast<std::uint64_t>(rank) << 32) ^ i;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  const double unit = static_cast<double>(z >> 11) / 9007199254740992.0;
  const int exponent = static_cast<int>(z % 25) - 12;
  return static_cast<float>((2.0 * unit - 1.0) * std::ldexp(1.0, exponent));
}

std::vector<float> input(int rank, std::size_t n, std::uint32_t seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = input_value(rank, i, seed);
  return v;
}

// The average summed in float in the given rank order, then divided by the rank count.
std::vector<float> in_order(const std::vector<int>& order, std::size_t n, std::uint32_t seed) {
  std::vector<float> acc = input(order[0], n, seed);
  for (std::size_t k = 1; k < order.size(); ++k) {
    const std::vector<float> x = input(order[k], n, seed);
    for (std::size_t i = 0; i < n; ++i) acc[i] += x[i];
  }
  for (float& a : acc) a /= static_cast<float>(order.size());
  return acc;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Collective over world: every rank must hold rank 0's bits.
void expect_same_on_all_ranks(const mpi::Comm& world, const std::vector<float>& v) {
  std::vector<float> root = v;
  world.bcast(std::span<float>(root));
  EXPECT_TRUE(same_bits(root, v)) << "rank " << world.rank() << " differs from rank 0";
}

ReducerOptions options(Reduction r, std::size_t bucket, std::size_t chunk, int in_flight) {
  ReducerOptions o;
  o.reduction = r;
  o.bucket_bytes = bucket;
  o.chunk_bytes = chunk;
  o.max_in_flight = in_flight;
  return o;
}

// One streaming step as the trainer drives it: layers become ready from the last one.
void streaming_step(comm::GradientReducer& r, std::vector<float>& grads,
                    const std::vector<float>& in, std::size_t layers) {
  std::fill(grads.begin(), grads.end(), std::numeric_limits<float>::quiet_NaN());
  for (std::size_t l = layers; l-- > 0;) {
    const std::size_t a = grads.size() * l / layers;
    const std::size_t b = grads.size() * (l + 1) / layers;
    std::copy(in.begin() + static_cast<long>(a), in.begin() + static_cast<long>(b),
              grads.begin() + static_cast<long>(a));
    r.ready_from(a);
  }
  r.finish();
}

std::vector<int> rank_order(int size) {
  std::vector<int> v(static_cast<std::size_t>(size));
  for (int r = 0; r < size; ++r) v[static_cast<std::size_t>(r)] = r;
  return v;
}

}  // namespace

// Nodes of 1, 2, 3 ranks and one node of all (at 4 ranks: 1+1+1+1, 2+2, 3+1, 4): streaming and
// one-shot results bitwise equal to the flat reducer's and to the rank-order reference.
TEST(HierReducer, ConsecutiveNodesAreBitwiseFlat) {
  mpi::Comm world = mpi::Comm::world();
  const std::size_t n = 70001;
  const std::vector<float> in = input(world.rank(), n, 5);
  const std::vector<float> ref = in_order(rank_order(world.size()), n, 5);
  for (const char* per_node : {"1", "2", "3", "4"}) {
    ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", per_node);
    // Chunks both smaller and larger than the small-message threshold, 1 and 4 in flight.
    for (const auto& [chunk, in_flight] : {std::pair<std::size_t, int>{4096, 1},
                                           {4096, 4}, {65536, 3}}) {
      std::vector<float> flat_grads(n);
      std::vector<float> hier_grads(n);
      auto flat = comm::make_gradient_reducer(world, flat_grads,
                                              options(Reduction::flat, 16384, chunk, in_flight));
      auto hier = comm::make_gradient_reducer(
          world, hier_grads, options(Reduction::hierarchical, 16384, chunk, in_flight));
      EXPECT_NE(hier->reduction().find("bitwise equal to flat"), std::string::npos)
          << hier->reduction();
      streaming_step(*flat, flat_grads, in, 7);
      streaming_step(*hier, hier_grads, in, 5);
      EXPECT_TRUE(same_bits(hier_grads, flat_grads))
          << "per node " << per_node << " chunk " << chunk << " in flight " << in_flight;
      EXPECT_TRUE(same_bits(hier_grads, ref)) << "per node " << per_node;
      for (std::size_t len : {std::size_t{1}, std::size_t{3}, std::size_t{1025}, n}) {
        std::vector<float> one(in.begin(), in.begin() + static_cast<long>(len));
        hier->allreduce_average(one);
        EXPECT_TRUE(std::memcmp(one.data(), ref.data(), len * sizeof(float)) == 0)
            << "one-shot of " << len << ", per node " << per_node;
      }
      expect_same_on_all_ranks(world, hier_grads);
    }
  }
}

// Chunks of 64 KiB, more of them than are in flight, streamed twice and one-shot: one rank a
// node, and nodes of unequal sizes named by Slurm (at 4 ranks: a, b, b, c -- a leader in the
// middle of the chain with a peer). Bitwise flat's and the reference.
TEST(HierReducer, UnequalNodesAndLargeChunksAreBitwiseFlat) {
  mpi::Comm world = mpi::Comm::world();
  const std::size_t n = 200003;  // 13 chunks of 64 KiB
  const std::vector<float> in = input(world.rank(), n, 13);
  const std::vector<float> ref = in_order(rank_order(world.size()), n, 13);
  for (const bool by_name : {false, true}) {
    ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", by_name ? nullptr : "1");
    const int r = world.rank();
    const std::string name = r == 0 ? "a" : r == world.size() - 1 && r > 1 ? "c" : "b";
    ScopedEnv slurm("SLURMD_NODENAME", by_name ? name.c_str() : nullptr);
    std::vector<float> flat_grads(n);
    std::vector<float> hier_grads(n);
    auto flat = comm::make_gradient_reducer(world, flat_grads,
                                            options(Reduction::flat, 262144, 65536, 2));
    auto hier = comm::make_gradient_reducer(world, hier_grads,
                                            options(Reduction::hierarchical, 262144, 65536, 2));
    EXPECT_NE(hier->reduction().find("bitwise equal to flat"), std::string::npos)
        << hier->reduction();
    for (int repeat = 0; repeat < 2; ++repeat) {
      streaming_step(*flat, flat_grads, in, 7);
      streaming_step(*hier, hier_grads, in, 3);
      EXPECT_TRUE(same_bits(hier_grads, flat_grads)) << hier->reduction();
      EXPECT_TRUE(same_bits(hier_grads, ref)) << hier->reduction();
    }
    std::vector<float> one = in;
    hier->allreduce_average(one);
    EXPECT_TRUE(same_bits(one, ref)) << "one-shot, " << hier->reduction();
    expect_same_on_all_ranks(world, hier_grads);
  }
}

// Presummed mode (no division): the last leader must not divide either.
TEST(HierReducer, PresummedOnlySums) {
  mpi::Comm world = mpi::Comm::world();
  ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", "2");
  const std::size_t n = 10007;
  std::vector<float> a = input(world.rank(), n, 9);
  std::vector<float> b = a;
  ReducerOptions o = options(Reduction::flat, 8192, 4096, 2);
  o.mode = comm::ReduceMode::presummed_average;
  auto flat = comm::make_gradient_reducer(world, a, o);
  o.reduction = Reduction::hierarchical;
  auto hier = comm::make_gradient_reducer(world, b, o);
  flat->allreduce_average(a);
  hier->allreduce_average(b);
  EXPECT_TRUE(same_bits(a, b));
}

// Nodes interleaved (Slurm node names alternate by rank: nodes {0,2,..} and {1,3,..}): summed
// node by node, which is not rank order; bitwise the reference in that order, repeatable, the
// same on every rank, and within float rounding of the exact average.
TEST(HierReducer, InterleavedNodesSumNodeByNode) {
  mpi::Comm world = mpi::Comm::world();
  if (world.size() < 3) GTEST_SKIP() << "needs 3 ranks for interleaved nodes";
  ScopedEnv test("LOCUS_TEST_RANKS_PER_NODE", nullptr);
  const std::string name = "node" + std::to_string(world.rank() % 2);
  ScopedEnv slurm("SLURMD_NODENAME", name.c_str());
  const std::size_t n = 30011;
  const std::vector<float> in = input(world.rank(), n, 17);
  std::vector<int> order;
  for (int parity : {0, 1})
    for (int r = parity; r < world.size(); r += 2) order.push_back(r);
  const std::vector<float> ref = in_order(order, n, 17);
  std::vector<float> grads(n);
  auto hier = comm::make_gradient_reducer(world, grads,
                                          options(Reduction::hierarchical, 8192, 4096, 3));
  EXPECT_NE(hier->reduction().find("not bitwise equal to flat"), std::string::npos)
      << hier->reduction();
  std::vector<float> first;
  for (int repeat = 0; repeat < 3; ++repeat) {
    streaming_step(*hier, grads, in, 3 + static_cast<std::size_t>(repeat));
    if (repeat == 0) first = grads;
    EXPECT_TRUE(same_bits(grads, first)) << "repeat " << repeat;
  }
  EXPECT_TRUE(same_bits(grads, ref));
  expect_same_on_all_ranks(world, grads);
  // Against the exact average: float rounding of any order is at most (size+1) eps |x|.
  const std::vector<float> flat_ref = in_order(rank_order(world.size()), n, 17);
  std::size_t differ = 0;
  for (std::size_t i = 0; i < n; ++i) {
    double exact = 0;
    double magnitude = 0;
    for (int r = 0; r < world.size(); ++r) {
      exact += input_value(r, i, 17);
      magnitude += std::fabs(input_value(r, i, 17));
    }
    const double bound = (world.size() + 1) * std::numeric_limits<float>::epsilon() *
                         magnitude / world.size();
    EXPECT_LE(std::fabs(grads[i] - exact / world.size()), bound) << "element " << i;
    differ += grads[i] != flat_ref[i] ? 1 : 0;
  }
  // The order really differs from flat (else this test would not test the order).
  EXPECT_GT(differ, 0u);
}

// auto: hierarchical only where the ranks span several nodes and some node has more than one
// rank; the description says which and why.
TEST(HierReducer, AutoChoosesByTopology) {
  mpi::Comm world = mpi::Comm::world();
  std::vector<float> grads(100);
  const ReducerOptions o = options(Reduction::automatic, 4096, 4096, 2);
  {
    ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", nullptr);
    ScopedEnv slurm("SLURMD_NODENAME", nullptr);
    auto r = comm::make_gradient_reducer(world, grads, o);
    EXPECT_EQ(r->reduction().rfind("flat (train.reduction = auto:", 0), 0u) << r->reduction();
    EXPECT_NE(r->reduction().find("one node"), std::string::npos) << r->reduction();
  }
  {
    ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", "1");
    auto r = comm::make_gradient_reducer(world, grads, o);
    const bool several = world.size() > 1;
    EXPECT_NE(r->reduction().find(several ? "one rank per node" : "one node"),
              std::string::npos) << r->reduction();
  }
  {
    ScopedEnv env("LOCUS_TEST_RANKS_PER_NODE", "2");
    auto r = comm::make_gradient_reducer(world, grads, o);
    const bool hierarchical = world.size() > 2;
    EXPECT_EQ(r->reduction().rfind(hierarchical ? "hierarchical (train.reduction = auto:"
                                                : "flat (train.reduction = auto:", 0),
              0u) << r->reduction();
  }
  auto f = comm::make_gradient_reducer(world, grads, options(Reduction::flat, 4096, 4096, 2));
  EXPECT_EQ(f->reduction(), "flat (train.reduction = flat)");
}

TEST(HierReducer, OptionsAndNccl) {
  mpi::Comm world = mpi::Comm::world();
  EXPECT_EQ(comm::parse_reduction("auto"), Reduction::automatic);
  EXPECT_EQ(comm::parse_reduction("flat"), Reduction::flat);
  EXPECT_EQ(comm::to_string(comm::parse_reduction("hierarchical")), "hierarchical");
  try {
    comm::parse_reduction("tree");
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.reduction = tree"), std::string::npos);
  }
  // A reduction order that differs across ranks is refused on every rank.
  std::vector<float> grads(64);
  ReducerOptions mixed;
  mixed.reduction = world.rank() == 0 ? Reduction::flat : Reduction::hierarchical;
  if (world.size() > 1) {
    const std::string what = test::agreed_error<ConfigError>(
        [&] { comm::make_gradient_reducer(world, grads, mixed); });
    EXPECT_NE(what.find("reduction"), std::string::npos) << what;
  }
  // NCCL chooses its own algorithms: an explicit reduction is refused, naming the way out
  // (checked before whether NCCL can run, so it shows without a GPU too).
  const comm::GradientBuffer host{grads.data(), grads.size(), comm::MemorySpace::host, nullptr};
  for (Reduction r : {Reduction::flat, Reduction::hierarchical}) {
    ReducerOptions o;
    o.backend = comm::ReducerBackend::nccl;
    o.reduction = r;
    const std::string what =
        test::agreed_error<ConfigError>([&] { comm::make_nccl_reducer(world, host, o); });
    EXPECT_NE(what.find("train.reduction = " + std::string(comm::to_string(r))),
              std::string::npos) << what;
    EXPECT_NE(what.find("train.reducer = mpi"), std::string::npos) << what;
  }
}
