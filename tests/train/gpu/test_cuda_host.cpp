// Host-side code of the CUDA backend that needs no device, run on every CUDA build (label
// train, not gpu): the host's float -> bf16 conversion (lib/train/src/cuda/host_bf16.hpp)
// against cuda_bf16.h's own __float2bfloat16_rn, whose host path implements the rounding the
// device's cvt.rn.bf16.f32 performs.
#include <cuda_bf16.h>
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/host_bf16.hpp"

namespace locus::train::cuda {
namespace {

std::uint16_t cuda_bits(float f) {
  const __nv_bfloat16 b = __float2bfloat16_rn(f);
  std::uint16_t bits = 0;
  std::memcpy(&bits, &b, sizeof(bits));
  return bits;
}

// Every one of the 2^32 float bit patterns (zeros, subnormals, ties of both parities, the
// largest finite, infinities, NaNs): about 5 s.
TEST(HostBf16, EqualsCudasConversionForEveryFloat) {
  std::uint64_t differ = 0, first = 0;
  for (std::uint64_t bits = 0; bits <= 0xffffffffu; ++bits) {
    const float f = std::bit_cast<float>(static_cast<std::uint32_t>(bits));
    if (bf16_bits(f) != cuda_bits(f) && differ++ == 0) first = bits;
  }
  EXPECT_EQ(differ, 0u) << std::hex << "first at float bits 0x" << first;
}

TEST(HostBf16, RoundsTiesToEvenAndOverflowsToInfinity) {
  EXPECT_EQ(bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bf16_bits(1.00390625f), 0x3f80);  // 1 + 2^-8, a tie: down to the even 1
  EXPECT_EQ(bf16_bits(1.01171875f), 0x3f82);  // 1 + 3 * 2^-8, a tie: up to the even 1 + 2^-6
  EXPECT_EQ(bf16_bits(3.4028235e38f), 0x7f80);  // the largest float rounds to infinity
  EXPECT_EQ(bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(bf16_bits(std::bit_cast<float>(0xffc00001u)), 0x7fff);  // every NaN: canonical
}

// The block conversion: every element written (a poisoned buffer), at any length and at an
// odd offset, equal to the conversion of each value.
TEST(HostBf16, BlockConversionWritesEveryElement) {
  std::mt19937_64 gen(7);
  std::uniform_real_distribution<float> uni(-1e3f, 1e3f);
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8},
                              std::size_t{1001}, std::size_t{(1u << 20) + 3}}) {
    std::vector<float> src(n + 1);
    for (float& v : src) v = uni(gen);
    std::vector<std::uint16_t> dst(n + 2, 0xdead);
    to_bf16_host(src.data() + 1, dst.data() + 1, n);
    EXPECT_EQ(dst.front(), 0xdead);
    EXPECT_EQ(dst.back(), 0xdead);
    for (std::size_t i = 0; i < n; ++i) {
      ASSERT_EQ(dst[i + 1], cuda_bits(src[i + 1])) << "element " << i << " of " << n;
    }
  }
}

}  // namespace
}  // namespace locus::train::cuda
