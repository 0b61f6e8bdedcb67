// Counter-based hashing shared by initialisation and dropout (private): SplitMix64's
// finaliser chained over the coordinates, with a distinct domain constant per use.
#pragma once

#include <cstdint>

// The CUDA backend's dropout kernel includes this file too: the same functions, so GPU masks
// are bitwise the CPU's.
#if defined(__CUDACC__)
#define LOCUS_HD __host__ __device__
#else
#define LOCUS_HD
#endif

namespace locus::train::detail {

constexpr std::uint64_t kInitDomain = 0x6c6f637573696e69ull;     // "locusini"
constexpr std::uint64_t kDropoutDomain = 0x6c6f637573647270ull;  // "locusdrp"
constexpr std::uint64_t kGolden = 0x9e3779b97f4a7c15ull;

LOCUS_HD inline std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Key of one (seed, step, layer, sample) row of a dropout mask; a unit's hash derives from it.
LOCUS_HD inline std::uint64_t dropout_row_key(std::uint64_t seed, std::uint64_t step, int layer,
                                     std::uint64_t sample_id) noexcept {
  std::uint64_t k = mix64(seed ^ kDropoutDomain);
  k = mix64(k + step * kGolden);
  k = mix64(k + static_cast<std::uint64_t>(layer) * kGolden);
  return mix64(k + sample_id * kGolden);
}

LOCUS_HD inline std::uint64_t unit_hash(std::uint64_t row_key, int unit) noexcept {
  return mix64(row_key + (static_cast<std::uint64_t>(unit) + 1) * kGolden);
}

// A unit is dropped when the top 32 bits of its hash fall below this threshold (p * 2^32).
LOCUS_HD inline std::uint64_t drop_threshold(float p) noexcept {
  return static_cast<std::uint64_t>(static_cast<double>(p) * 4294967296.0);
}

LOCUS_HD inline bool keep_unit(std::uint64_t row_key, int unit, std::uint64_t threshold) noexcept {
  return (unit_hash(row_key, unit) >> 32) >= threshold;
}

}  // namespace locus::train::detail
