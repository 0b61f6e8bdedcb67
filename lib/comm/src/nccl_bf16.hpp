// Private to lib/comm (built with LOCUS_WITH_NCCL): the NCCL reducer's conversions for
// train.reducer_precision = bf16 -- a bucket of fp32 gradients rounded to bf16 before NCCL sums
// it, and the sum widened back. Bits of bf16 as std::uint16_t, so callers need no CUDA
// half-precision headers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace locus::comm::detail {

// out[i] = bf16(in[i]), rounded to nearest, ties to even (__float2bfloat16_rn), i < n; enqueued
// on s. A CudaError where the launch fails.
void round_to_bf16(const float* in, std::uint16_t* out, std::size_t n, cudaStream_t s);
// out[i] = float(in[i]) (exact), i < n; enqueued on s.
void widen_from_bf16(const std::uint16_t* in, float* out, std::size_t n, cudaStream_t s);

}  // namespace locus::comm::detail
