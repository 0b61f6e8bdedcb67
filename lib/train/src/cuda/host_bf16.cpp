// The host's float -> bf16 conversion (host_bf16.hpp).
#include "cuda/host_bf16.hpp"

namespace locus::train::cuda {

void to_bf16_host(const float* src, std::uint16_t* dst, std::size_t n) noexcept {
  for (std::size_t i = 0; i < n; ++i) dst[i] = bf16_bits(src[i]);
}

}  // namespace locus::train::cuda
