// Public entry points of the counter-based dropout masks (the kernels inline hash.hpp).
#include "locus/train/model/dropout.hpp"

#include "model/hash.hpp"

namespace locus::train {

std::uint64_t dropout_hash(std::uint64_t seed, std::uint64_t step, int layer,
                           std::uint64_t sample_id, int unit) noexcept {
  return detail::unit_hash(detail::dropout_row_key(seed, step, layer, sample_id), unit);
}

bool dropout_keep(std::uint64_t seed, std::uint64_t step, int layer, std::uint64_t sample_id,
                  int unit, float p) noexcept {
  return (dropout_hash(seed, step, layer, sample_id, unit) >> 32) >= detail::drop_threshold(p);
}

}  // namespace locus::train
