// Private to the CUDA backend: float -> bf16 on the host, bit for bit what the device's
// __float2bfloat16_rn (kernels.cu to_bf16, PTX cvt.rn.bf16.f32) gives for every number: round
// to nearest, ties to even, subnormals kept, overflow to infinity; a NaN becomes 0x7fff, as in
// cuda_bf16.h's host path (the device gives a NaN too; its payload is the hardware's). A block
// converted here once (the device cache and loader.gather = device, at bf16) feeds the first
// GEMM exactly the operand the device's own conversion of each batch would, in half the bytes.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>

namespace locus::train::cuda {

constexpr std::uint16_t bf16_bits(float f) noexcept {
  const auto u = std::bit_cast<std::uint32_t>(f);
  // The low half decides: above 0x8000 up, below down, exactly 0x8000 to the even upper half.
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fffu : rounded);
}

// dst[i] = bf16_bits(src[i]) for i < n (one pass; vectorised by the compiler).
void to_bf16_host(const float* src, std::uint16_t* dst, std::size_t n) noexcept;

}  // namespace locus::train::cuda
