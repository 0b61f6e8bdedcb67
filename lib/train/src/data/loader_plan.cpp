// Batch geometry, permutations and the out-of-core window plan of the loader (pure functions).
#include "data/loader_plan.hpp"

#include <algorithm>
#include <numeric>

#include "model/hash.hpp"

namespace locus::train::detail {

__extension__ typedef unsigned __int128 Uint128;

std::uint64_t uniform_below(std::mt19937_64& g, std::uint64_t n) {
  Uint128 m = static_cast<Uint128>(g()) * n;
  auto low = static_cast<std::uint64_t>(m);
  if (low < n) {
    // Reject the (2^64 mod n) low values that would make some outcomes more likely.
    const std::uint64_t threshold = (0 - n) % n;
    while (low < threshold) {
      m = static_cast<Uint128>(g()) * n;
      low = static_cast<std::uint64_t>(m);
    }
  }
  return static_cast<std::uint64_t>(m >> 64);
}

std::mt19937_64 keyed_engine(std::uint64_t seed, std::uint64_t epoch, std::uint64_t domain,
                             std::uint64_t a, std::uint64_t b) {
  std::uint64_t k = mix64(seed ^ domain);
  k = mix64(k + epoch * kGolden);
  k = mix64(k + a * kGolden);
  k = mix64(k + b * kGolden);
  return std::mt19937_64(k);
}

void fisher_yates(std::span<std::uint64_t> v, std::mt19937_64& g) {
  for (std::size_t i = v.size(); i > 1; --i) {
    const std::uint64_t j = uniform_below(g, i);
    std::swap(v[i - 1], v[j]);
  }
}

std::vector<std::uint64_t> permutation(std::uint64_t n, std::mt19937_64 g) {
  std::vector<std::uint64_t> v(n);
  std::iota(v.begin(), v.end(), std::uint64_t{0});
  fisher_yates(v, g);
  return v;
}

PermutationBuilder::PermutationBuilder(std::uint64_t n, std::mt19937_64 g)
    : n_(n), g_(std::move(g)), i_(n) {
  v_.reserve(n);  // untouched until advance() writes it
}

bool PermutationBuilder::advance(std::uint64_t budget) {
  while (v_.size() < n_ && budget > 0) {
    const std::uint64_t k = std::min(budget, n_ - v_.size());
    for (std::uint64_t c = 0; c < k; ++c) v_.push_back(v_.size());
    budget -= k;
  }
  // The same swaps, in the same order and from the same draws, as fisher_yates().
  for (; i_ > 1 && budget > 0; --i_, --budget) {
    const std::uint64_t j = uniform_below(g_, i_);
    std::swap(v_[i_ - 1], v_[j]);
  }
  return v_.size() == n_ && i_ <= 1;
}

Geometry::Geometry(std::uint64_t rows, std::uint64_t global_batch, bool drop_last,
                   Shuffle shuffle, int rank, int ranks)
    : rows_(rows), batch_(global_batch),
      steps_(drop_last ? rows / global_batch : (rows + global_batch - 1) / global_batch),
      shuffle_(shuffle), rank_(rank), ranks_(ranks),
      partition_(h5::partition_rows(rows, rank, ranks)) {}

std::uint64_t Geometry::max_partition_rows() const {
  const auto p = static_cast<std::uint64_t>(ranks_);
  return (rows_ + p - 1) / p;
}

StepSlice Geometry::slice(std::uint64_t step) const {
  const std::uint64_t begin = step * batch_;
  const std::uint64_t end = std::min(rows_, begin + batch_);
  StepSlice s;
  s.global_rows = end - begin;
  if (shuffle_ == Shuffle::global) {
    // The balanced partition of the global batch: rank r's rows are contiguous in it.
    const h5::RowRange mine = h5::partition_rows(s.global_rows, rank_, ranks_);
    s.first = begin + mine.begin;
    s.count = mine.count;
  } else {
    // Epoch position i belongs to rank i mod P; rank r's j-th position is its partition's
    // j-th row in the epoch's local order.
    s.first = round_robin_count(begin, rank_, ranks_);
    s.count = round_robin_count(end, rank_, ranks_) - s.first;
  }
  return s;
}

StreamPlan::StreamPlan(h5::RowRange partition, std::uint64_t group_rows, bool shuffled)
    : partition_(partition), shuffled_(shuffled) {
  const std::uint64_t g = std::max<std::uint64_t>(1, group_rows);
  // Several windows per group mix rows from far-apart parts of the partition; one window per
  // group keeps reads sequential when nothing is shuffled.
  per_group_ = shuffled ? std::min<std::uint64_t>(8, g) : 1;
  window_rows_ = std::max<std::uint64_t>(1, g / per_group_);
  windows_ = (partition.count + window_rows_ - 1) / window_rows_;
  begin_epoch(0, 0);
}

void StreamPlan::begin_epoch(std::uint64_t seed, std::uint64_t epoch) {
  seed_ = seed;
  epoch_ = epoch;
  if (shuffled_) {
    window_order_ = permutation(windows_, keyed_engine(seed, epoch, kWindowDomain,
                                                       partition_.begin, partition_.count));
  } else {
    window_order_.resize(windows_);
    std::iota(window_order_.begin(), window_order_.end(), std::uint64_t{0});
  }
  group_start_.assign(1, 0);
  for (std::uint64_t w0 = 0; w0 < windows_; w0 += per_group_) {
    std::uint64_t size = 0;
    for (std::uint64_t i = w0; i < std::min(windows_, w0 + per_group_); ++i) {
      const std::uint64_t start = window_order_[i] * window_rows_;
      size += std::min(window_rows_, partition_.count - start);
    }
    group_start_.push_back(group_start_.back() + size);
  }
}

std::uint64_t StreamPlan::group_of(std::uint64_t p) const {
  const auto it = std::upper_bound(group_start_.begin(), group_start_.end(), p);
  return static_cast<std::uint64_t>(it - group_start_.begin()) - 1;
}

std::vector<h5::RowRange> StreamPlan::group_windows(std::uint64_t q) const {
  std::vector<h5::RowRange> windows;
  const std::uint64_t w0 = q * per_group_;
  for (std::uint64_t i = w0; i < std::min(windows_, w0 + per_group_); ++i) {
    const std::uint64_t start = window_order_[i] * window_rows_;
    windows.push_back({partition_.begin + start,
                       std::min(window_rows_, partition_.count - start)});
  }
  std::sort(windows.begin(), windows.end(),
            [](const h5::RowRange& a, const h5::RowRange& b) { return a.begin < b.begin; });
  return windows;
}

std::vector<std::uint64_t> StreamPlan::group_order(std::uint64_t q) const {
  const std::uint64_t n = group_start_[q + 1] - group_start_[q];
  if (!shuffled_) {
    std::vector<std::uint64_t> v(n);
    std::iota(v.begin(), v.end(), std::uint64_t{0});
    return v;
  }
  return permutation(n, keyed_engine(seed_, epoch_, kGroupDomain, partition_.begin, q));
}

std::vector<h5::RowRange> coalesce(std::span<const std::uint64_t> sorted_ids) {
  std::vector<h5::RowRange> runs;
  for (const std::uint64_t id : sorted_ids) {
    if (!runs.empty() && runs.back().end() == id) {
      ++runs.back().count;
    } else {
      runs.push_back({id, 1});
    }
  }
  return runs;
}

}  // namespace locus::train::detail
