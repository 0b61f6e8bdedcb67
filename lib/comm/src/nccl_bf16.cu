// The NCCL reducer's bf16 conversions (nccl_bf16.hpp): one grid-stride pass each, memory-bound
// (6 bytes an element), a few microseconds per MiB-sized bucket on an H100.
#include "nccl_bf16.hpp"

#include <cuda_bf16.h>

#include <algorithm>

#include "nccl_comm.hpp"

namespace locus::comm::detail {

namespace {

constexpr int kThreads = 256;

__global__ void round_kernel(const float* __restrict__ in, std::uint16_t* __restrict__ out,
                             std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
  }
}

__global__ void widen_kernel(const std::uint16_t* __restrict__ in, float* __restrict__ out,
                             std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = __bfloat162float(__ushort_as_bfloat16(in[i]));
  }
}

// Enough blocks for every element of a bucket up to 2^16 x 256 of them, then a stride.
unsigned blocks_for(std::size_t n) {
  return static_cast<unsigned>(std::clamp<std::size_t>((n + kThreads - 1) / kThreads, 1, 65535));
}

}  // namespace

void round_to_bf16(const float* in, std::uint16_t* out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  round_kernel<<<blocks_for(n), kThreads, 0, s>>>(in, out, n);
  LOCUS_NCCL_CUDA(cudaGetLastError());
}

void widen_from_bf16(const std::uint16_t* in, float* out, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  widen_kernel<<<blocks_for(n), kThreads, 0, s>>>(in, out, n);
  LOCUS_NCCL_CUDA(cudaGetLastError());
}

}  // namespace locus::comm::detail
