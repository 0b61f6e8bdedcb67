// The loader's batch geometry and permutations (private): pure functions of the dataset size,
// world size, options and (seed, epoch), so any step of any epoch can be recomputed from
// nothing else. No MPI, no HDF5: the rules documented in loader.hpp live here.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "locus/io/dataset.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train::detail {

// Bounded uniform draw in [0, n) from a 64-bit engine (Lemire's multiply-shift with rejection):
// unbiased and, unlike std::uniform_int_distribution, identical on every standard library.
std::uint64_t uniform_below(std::mt19937_64& g, std::uint64_t n);

// An engine whose stream is a pure function of the key words (hashed, SplitMix64 finaliser).
std::mt19937_64 keyed_engine(std::uint64_t seed, std::uint64_t epoch, std::uint64_t domain,
                             std::uint64_t a = 0, std::uint64_t b = 0);

// Fisher-Yates (Durstenfeld): for i = n-1 .. 1, swap v[i] with v[uniform_below(i + 1)].
void fisher_yates(std::span<std::uint64_t> v, std::mt19937_64& g);

// The identity [0, n) shuffled by fisher_yates with the given engine.
std::vector<std::uint64_t> permutation(std::uint64_t n, std::mt19937_64 g);

// permutation(n, g) in pieces, so that a thread with other work (the loader's producer) never
// spends long on it: advance(budget) does at most `budget` elements of work -- first writing
// the identity (which also touches the memory), then Fisher-Yates' swaps -- and returns true
// once the permutation is complete; take() then hands it over, equal to permutation(n, g).
class PermutationBuilder {
 public:
  PermutationBuilder(std::uint64_t n, std::mt19937_64 g);
  bool advance(std::uint64_t budget);
  std::vector<std::uint64_t> take() { return std::move(v_); }

 private:
  std::uint64_t n_;
  std::mt19937_64 g_;
  std::vector<std::uint64_t> v_;  // the identity's first v_.size() elements, then shuffled
  std::uint64_t i_;               // Fisher-Yates: the next swap is v[i_ - 1] with v[j < i_]
};

// Key domains, so the global, local and streamed permutations never share a stream.
constexpr std::uint64_t kGlobalDomain = 0x6c6f637573676c62ull;  // "locusglb"
constexpr std::uint64_t kLocalDomain = 0x6c6f6375736c6f63ull;   // "locusloc"
constexpr std::uint64_t kWindowDomain = 0x6c6f63757377696eull;  // "locuswin"
constexpr std::uint64_t kGroupDomain = 0x6c6f63757367727full;   // "locusgro"

// Number of i in [0, c) with i mod p == r: the rows of the first c epoch positions that the
// round-robin deal of local mode gives to rank r.
inline std::uint64_t round_robin_count(std::uint64_t c, int r, int p) {
  const auto ur = static_cast<std::uint64_t>(r), up = static_cast<std::uint64_t>(p);
  return c / up + (ur < c % up ? 1 : 0);
}

// Where this rank's rows of one step lie in the epoch order.
struct StepSlice {
  std::uint64_t first = 0;     // first position (global mode: in the global permutation;
                               // local/none: in this rank's own partition order)
  std::uint64_t count = 0;     // this rank's rows in the step
  std::uint64_t global_rows = 0;
};

// Steps per epoch and the rows of every rank in every step (see loader.hpp for the rule).
class Geometry {
 public:
  Geometry(std::uint64_t rows, std::uint64_t global_batch, bool drop_last, Shuffle shuffle,
           int rank, int ranks);

  std::uint64_t steps() const { return steps_; }
  std::uint64_t rows() const { return rows_; }
  // This rank's contiguous partition of the file (local and none modes).
  const h5::RowRange& partition() const { return partition_; }
  // The largest partition of any rank (for memory decisions every rank makes alike).
  std::uint64_t max_partition_rows() const;
  StepSlice slice(std::uint64_t step) const;
  // An upper bound of this rank's rows in any step: ceil(global_batch / ranks).
  std::uint64_t max_step_rows() const {
    const auto p = static_cast<std::uint64_t>(ranks_);
    return (batch_ + p - 1) / p;
  }

 private:
  std::uint64_t rows_, batch_, steps_;
  Shuffle shuffle_;
  int rank_, ranks_;
  h5::RowRange partition_;
};

// The out-of-core local order: the partition cut into windows of `window_rows`, the windows
// permuted, then taken `windows_per_group` at a time; each group's rows (in ascending file
// order) are permuted among themselves. For Shuffle::none windows and rows keep file order.
class StreamPlan {
 public:
  // group_rows: the most rows one group may hold.
  StreamPlan(h5::RowRange partition, std::uint64_t group_rows, bool shuffled);

  // Builds the order of `epoch`; groups are then addressed by index.
  void begin_epoch(std::uint64_t seed, std::uint64_t epoch);
  std::uint64_t groups() const { return group_start_.size() - 1; }
  // First partition position of group q (q = groups() gives the partition size).
  std::uint64_t group_start(std::uint64_t q) const { return group_start_[q]; }
  // The group containing partition position p.
  std::uint64_t group_of(std::uint64_t p) const;
  // The file row ranges of group q's windows, ascending.
  std::vector<h5::RowRange> group_windows(std::uint64_t q) const;
  // The order of group q's rows: entry i is an index into its rows in ascending file order.
  std::vector<std::uint64_t> group_order(std::uint64_t q) const;
  std::uint64_t window_rows() const { return window_rows_; }
  std::uint64_t windows_per_group() const { return per_group_; }

 private:
  h5::RowRange partition_;
  bool shuffled_;
  std::uint64_t window_rows_ = 1, per_group_ = 1, windows_ = 0;
  std::uint64_t seed_ = 0, epoch_ = 0;
  std::vector<std::uint64_t> window_order_;
  std::vector<std::uint64_t> group_start_;
};

// Sorted, de-duplicated row ids → maximal runs of consecutive rows.
std::vector<h5::RowRange> coalesce(std::span<const std::uint64_t> sorted_ids);

}  // namespace locus::train::detail
