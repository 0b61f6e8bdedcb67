// Feature statistics of a distributed Table (moments, extrema, histograms), the normalization
// derived from them, and the handling of non-finite rows. Every collective here is a map-side
// reduction: each rank summarises its own rows, then one all-reduce merges the summaries.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/io/table.hpp"

namespace locus::io {

// Per-feature moments over all ranks' rows, accumulated in double.
// With count == 0 the members hold the identity of merge(): mean 0, m2 0, min +inf, max -inf.
// Values are assumed finite (run handle_nonfinite first): a NaN or Inf propagates into the
// mean and m2 of its feature.
struct FeatureStats {
  std::int64_t count = 0;                  // rows
  std::vector<double> mean, m2, min, max;  // one entry per feature; m2 = Σ (x - mean)²

  std::size_t cols() const noexcept { return mean.size(); }
  // Population standard deviation sqrt(m2 / count) (ddof = 0, like numpy's default);
  // all zeros when count == 0.
  std::vector<double> stddev() const;
};

// Collective over comm. Each rank computes the moments of its rows with a two-pass algorithm
// in double, then one MPI_Allreduce with a non-commutative user-defined MPI_Op merges them in
// rank order with the parallel-variance formulas of Chan, Golub & LeVeque. Because the op is
// declared non-commutative the merge order is fixed by the ranks, so the result does not depend
// on timing and is bit-identical on every rank (the tests check both at 1, 2 and 4 ranks).
// Matches a serial two-pass reference to ~1e-11 relative in the tests, also for large offsets.
// Ranks may hold 0 rows (and then may report local.cols == 0); ranks with rows must agree on
// cols, else every rank throws the same DataError.
FeatureStats compute_stats(const mpi::Comm& comm, const Table& local);

// Local: the two-pass moments (in double) of the rows in x, d features each, row-major -- what
// compute_stats computes per rank, here for one unit of work.
FeatureStats row_stats(std::span<const float> x, std::size_t d);

// One unit's statistics, held by the rank that won the unit.
struct UnitStats {
  std::int64_t unit = 0;
  FeatureStats stats;  // d features (count 0 for a unit without rows)
};

// Collective over comm: the statistics of units 0..units-1 merged in unit order, a left fold of
// the Chan et al. merge, each unit's statistics coming from the one rank that holds it (`mine`:
// this rank's units, ascending). The merge order is the units', so the result has the same
// bits whatever rank held which unit, on every rank and at every rank count (compute_stats
// merges in rank order instead). Exchanged in blocks of about 16 MiB of unit records with a
// commutative "take the holder's record" all-reduce. InternalError when no rank holds a unit.
FeatureStats merge_in_unit_order(const mpi::Comm& comm, std::int64_t units, std::size_t d,
                                 std::span<const UnitStats> mine);

// Statistics of the concatenation of the rows behind a and b (used by --append). Either may be
// empty (count == 0); otherwise their feature counts must match (DataError).
FeatureStats merge(const FeatureStats& a, const FeatureStats& b);

// Per-feature counts over `bins` equal-width bins spanning [lo[f], hi[f]].
struct Histogram {
  std::vector<double> lo, hi;         // one entry per feature
  int bins = 0;
  std::vector<std::int64_t> counts;   // cols() × bins, row-major: counts[f * bins + b]

  std::size_t cols() const noexcept { return lo.size(); }
  std::int64_t at(std::size_t f, int b) const {
    return counts[f * static_cast<std::size_t>(bins) + static_cast<std::size_t>(b)];
  }
};

// Bin of x in `bins` equal-width bins over [lo, hi], as numpy.histogram(range=(lo, hi)) bins
// it: bin b holds [lo + b·step, lo + (b+1)·step) with step = (hi - lo) / bins, the last bin
// also holds hi; values below lo go to bin 0, values above hi to the last bin (numpy would drop
// them; drift must count them). A constant feature (hi == lo) puts x == lo in the middle bin
// bins / 2, smaller values in bin 0 and larger ones in the last bin, so drift in either
// direction shows up when bins >= 3 (numpy would widen the range instead). NaN returns -1
// (not counted).
int histogram_bin(double x, double lo, double hi, int bins) noexcept;

// Collective over comm: counts of this rank's rows per feature and bin (histogram_bin),
// summed over ranks with one all-reduce. lo and hi need one finite entry per feature with
// lo <= hi (DataError otherwise), bins >= 1 (ConfigError), and the same arguments on every rank.
Histogram compute_histogram(const mpi::Comm& comm, const Table& local, std::vector<double> lo,
                            std::vector<double> hi, int bins);

enum class Normalization { none, standardize, minmax };

// x' = (x - offset) * scale per feature.
struct NormalizationParams {
  Normalization mode = Normalization::none;
  std::vector<double> offset, scale;
};

// none: offset 0, scale 1. standardize: offset mean, scale 1/stddev. minmax: offset min,
// scale 1/(max - min). A feature whose spread is 0 (or non-finite, or count == 0) keeps scale 1,
// and an offset that is not finite becomes 0, so normalization never produces NaN or Inf.
NormalizationParams make_normalization(Normalization mode, const FeatureStats& raw);

// Local (no communication): normalizes this rank's features in place, computing in double and
// storing float. DataError when p has a different feature count than the table.
void apply_normalization(Table& local, const NormalizationParams& p);

// "none", "standardize" or "minmax"; ConfigError naming the allowed values otherwise.
Normalization parse_normalization(const std::string& s);
std::string_view to_string(Normalization n) noexcept;

// Collective over comm: the number of rows, over all ranks, with at least one NaN or Inf
// feature. With drop == true those rows (and their labels) are also removed from `local`.
std::int64_t handle_nonfinite(const mpi::Comm& comm, Table& local, bool drop);

// Local: the same for the rows of t from `from_row` on (one unit appended to a rank's table):
// the number of them with a NaN or Inf, removed when drop is true.
std::int64_t nonfinite_rows(Table& t, std::int64_t from_row, bool drop);

// Collective over comm: the feature count every rank with rows agrees on (ranks without rows
// may report 0). Every rank throws the same DataError when two ranks with rows disagree.
std::int64_t global_cols(const mpi::Comm& comm, const Table& local);

}  // namespace locus::io
