// Counter-based dropout masks: each keep/drop decision is a hash of its coordinates, so masks
// need no RNG state and do not depend on batch partitioning, thread count or rank count.
#pragma once

#include <cstdint>

namespace locus::train {

// 64-bit mix of all coordinates (SplitMix64 finaliser chained over the inputs).
std::uint64_t dropout_hash(std::uint64_t seed, std::uint64_t step, int layer,
                           std::uint64_t sample_id, int unit) noexcept;

// True when unit `unit` of hidden layer `layer` (0-based layer index) is kept for sample
// `sample_id` at training step `step`; the drop probability is p (kept units are scaled by
// 1 / (1 - p), as torch.nn.Dropout does).
bool dropout_keep(std::uint64_t seed, std::uint64_t step, int layer, std::uint64_t sample_id,
                  int unit, float p) noexcept;

}  // namespace locus::train
