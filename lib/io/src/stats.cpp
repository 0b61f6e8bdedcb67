// Feature statistics: per-rank two-pass moments merged in rank order by one all-reduce with a
// user-defined MPI_Op (Chan et al.), histograms, normalization and non-finite row handling.
#include "locus/io/stats.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"
#include "locus/comm/handle.hpp"

namespace locus::io {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The packed form of FeatureStats sent through MPI: [count, mean[d], m2[d], min[d], max[d]].
// The count travels as a double, exact up to 2^53 rows.
std::size_t packed_size(std::size_t d) { return 1 + 4 * d; }

std::vector<double> pack(const FeatureStats& s) {
  const std::size_t d = s.cols();
  std::vector<double> p(packed_size(d));
  p[0] = static_cast<double>(s.count);
  std::copy(s.mean.begin(), s.mean.end(), p.begin() + 1);
  std::copy(s.m2.begin(), s.m2.end(), p.begin() + 1 + static_cast<std::ptrdiff_t>(d));
  std::copy(s.min.begin(), s.min.end(), p.begin() + 1 + 2 * static_cast<std::ptrdiff_t>(d));
  std::copy(s.max.begin(), s.max.end(), p.begin() + 1 + 3 * static_cast<std::ptrdiff_t>(d));
  return p;
}

FeatureStats unpack(std::span<const double> p, std::size_t d) {
  FeatureStats s;
  s.count = static_cast<std::int64_t>(p[0]);
  const auto part = [&](std::size_t k) {
    const auto first = p.begin() + 1 + static_cast<std::ptrdiff_t>(k * d);
    return std::vector<double>(first, first + static_cast<std::ptrdiff_t>(d));
  };
  s.mean = part(0);
  s.m2 = part(1);
  s.min = part(2);
  s.max = part(3);
  return s;
}

// out = a ∘ b for packed stats (a holds the earlier rows); out may alias b. Chan, Golub &
// LeVeque: the mean moves by delta·nb/n and m2 gains delta²·na·nb/n.
void merge_packed(const double* a, const double* b, double* out, std::size_t d) {
  const double na = a[0], nb = b[0];
  if (na == 0) {
    if (out != b) std::copy(b, b + packed_size(d), out);
    return;
  }
  if (nb == 0) {
    std::copy(a, a + packed_size(d), out);
    return;
  }
  const double n = na + nb;
  const double wb = nb / n, wab = na * nb / n;
  for (std::size_t f = 0; f < d; ++f) {
    const double delta = b[1 + f] - a[1 + f];
    out[1 + f] = a[1 + f] + delta * wb;
    out[1 + d + f] = a[1 + d + f] + b[1 + d + f] + delta * delta * wab;
    out[1 + 2 * d + f] = std::min(a[1 + 2 * d + f], b[1 + 2 * d + f]);
    out[1 + 3 * d + f] = std::max(a[1 + 3 * d + f], b[1 + 3 * d + f]);
  }
  out[0] = n;
}

// MPI_User_function: inout[i] = in[i] ∘ inout[i], where MPI guarantees `in` comes from lower
// ranks for a non-commutative op. The feature count is recovered from the datatype's size.
void merge_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  int bytes = 0;
  MPI_Type_size(*type, &bytes);
  const std::size_t n = static_cast<std::size_t>(bytes) / sizeof(double);
  const std::size_t d = (n - 1) / 4;
  auto* a = static_cast<const double*>(in);
  auto* b = static_cast<double*>(inout);
  for (int i = 0; i < *len; ++i) merge_packed(a + i * n, b + i * n, b + i * n, d);
}

struct TypeTraits {
  using value_type = MPI_Datatype;
  static MPI_Datatype invalid() noexcept { return MPI_DATATYPE_NULL; }
  static void close(MPI_Datatype t) noexcept { MPI_Type_free(&t); }
};
struct OpTraits {
  using value_type = MPI_Op;
  static MPI_Op invalid() noexcept { return MPI_OP_NULL; }
  static void close(MPI_Op op) noexcept { MPI_Op_free(&op); }
};

// Two-pass moments of rows x[0 .. rows*d): the mean first, then squared deviations from it, which
// stays accurate for features with a large offset and a small spread.
FeatureStats moments(const float* x, std::size_t rows, std::size_t d) {
  FeatureStats s;
  s.count = static_cast<std::int64_t>(rows);
  s.mean.assign(d, 0.0);
  s.m2.assign(d, 0.0);
  s.min.assign(d, kInf);
  s.max.assign(d, -kInf);
  if (s.count == 0) return s;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t f = 0; f < d; ++f) {
      const double v = x[r * d + f];
      s.mean[f] += v;
      s.min[f] = std::min(s.min[f], v);
      s.max[f] = std::max(s.max[f], v);
    }
  for (double& m : s.mean) m /= static_cast<double>(rows);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t f = 0; f < d; ++f) {
      const double dev = x[r * d + f] - s.mean[f];
      s.m2[f] += dev * dev;
    }
  return s;
}

}  // namespace

std::vector<double> FeatureStats::stddev() const {
  std::vector<double> sd(cols(), 0.0);
  if (count == 0) return sd;
  for (std::size_t f = 0; f < cols(); ++f)
    sd[f] = std::sqrt(std::max(m2[f], 0.0) / static_cast<double>(count));
  return sd;
}

std::int64_t global_cols(const mpi::Comm& comm, const Table& local) {
  // MIN-reduce of (-cols, cols or +max) yields the largest and the smallest non-zero count.
  constexpr std::int64_t none = std::numeric_limits<std::int64_t>::max();
  std::int64_t v[2] = {-local.cols, local.cols > 0 ? local.cols : none};
  comm.allreduce_inplace(std::span<std::int64_t>(v, 2), MPI_MIN);
  const std::int64_t hi = -v[0], lo = v[1];
  if (lo != none && lo != hi)
    throw_error(ErrorKind::data,
                fmt::format("ranks disagree on the feature count (between {} and {}): the input "
                            "was split inconsistently; check that every input file has the "
                            "same columns",
                            lo, hi),
                /*agreed=*/true);
  return hi;
}

FeatureStats compute_stats(const mpi::Comm& comm, const Table& local) {
  // A rank without rows contributes the identity for all d features (local.cols may be 0).
  const auto d = static_cast<std::size_t>(global_cols(comm, local));
  std::vector<double> packed =
      pack(moments(local.features.data(), static_cast<std::size_t>(local.rows()), d));

  // One contiguous element per rank, so the op sees whole records and d travels in the type.
  MPI_Datatype t = MPI_DATATYPE_NULL;
  LOCUS_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(packed.size()), MPI_DOUBLE, &t));
  Handle<TypeTraits> type(t);
  LOCUS_MPI_CHECK(MPI_Type_commit(&t));
  MPI_Op o = MPI_OP_NULL;
  LOCUS_MPI_CHECK(MPI_Op_create(&merge_op, /*commute=*/0, &o));
  Handle<OpTraits> op(o);
  LOCUS_MPI_CHECK(
      MPI_Allreduce(MPI_IN_PLACE, packed.data(), 1, type.get(), op.get(), comm.get()));
  return unpack(packed, d);
}

FeatureStats merge(const FeatureStats& a, const FeatureStats& b) {
  if (a.count == 0 && a.cols() == 0) return b;
  if (b.count == 0 && b.cols() == 0) return a;
  if (a.cols() != b.cols())
    throw DataError(fmt::format("cannot merge statistics of {} features with statistics of {} "
                                "features: appended data must have the dataset's columns",
                                a.cols(), b.cols()));
  const std::vector<double> pa = pack(a), pb = pack(b);
  std::vector<double> out(pa.size());
  merge_packed(pa.data(), pb.data(), out.data(), a.cols());
  return unpack(out, a.cols());
}

FeatureStats row_stats(std::span<const float> x, std::size_t d) {
  LOCUS_ASSERT(d > 0 || x.empty(), "row_stats of features without columns");
  return moments(x.data(), d == 0 ? 0 : x.size() / d, d);
}

namespace {

// A unit's record in the per-unit exchange: [present, count, mean[d], m2[d], min[d], max[d]].
// Exactly one rank marks a unit present; pick_op keeps that rank's record.
void pick_op(void* in, void* inout, int* len, MPI_Datatype* type) {
  int bytes = 0;
  MPI_Type_size(*type, &bytes);
  const std::size_t n = static_cast<std::size_t>(bytes) / sizeof(double);
  auto* a = static_cast<const double*>(in);
  auto* b = static_cast<double*>(inout);
  for (int i = 0; i < *len; ++i, a += n, b += n)
    if (a[0] != 0) std::copy(a, a + n, b);
}

}  // namespace

FeatureStats merge_in_unit_order(const mpi::Comm& comm, std::int64_t units, std::size_t d,
                                 std::span<const UnitStats> mine) {
  FeatureStats total;
  total.mean.assign(d, 0.0);
  total.m2.assign(d, 0.0);
  total.min.assign(d, kInf);
  total.max.assign(d, -kInf);
  std::vector<double> acc = pack(total);
  const std::size_t rec = 1 + packed_size(d);
  // Units travel in blocks of about 16 MiB, so memory does not grow with the unit count.
  const auto block =
      static_cast<std::int64_t>(std::max<std::size_t>(1, (std::size_t{16} << 20) / (rec * 8)));
  MPI_Datatype t = MPI_DATATYPE_NULL;
  LOCUS_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(rec), MPI_DOUBLE, &t));
  Handle<TypeTraits> type(t);
  LOCUS_MPI_CHECK(MPI_Type_commit(&t));
  MPI_Op o = MPI_OP_NULL;
  LOCUS_MPI_CHECK(MPI_Op_create(&pick_op, /*commute=*/1, &o));
  Handle<OpTraits> op(o);
  std::vector<double> buf, merged(acc.size());
  std::size_t next = 0;  // the first entry of `mine` not yet sent
  for (std::int64_t first = 0; first < units; first += block) {
    const std::int64_t n = std::min(block, units - first);
    buf.assign(static_cast<std::size_t>(n) * rec, 0.0);
    for (; next < mine.size() && mine[next].unit < first + n; ++next) {
      const UnitStats& u = mine[next];
      LOCUS_ASSERT(u.unit >= first && u.stats.cols() == d,
                   fmt::format("unit {} out of order or of {} features, not {}", u.unit,
                               u.stats.cols(), d));
      const std::vector<double> p = pack(u.stats);
      double* r = buf.data() + static_cast<std::size_t>(u.unit - first) * rec;
      r[0] = 1;
      std::copy(p.begin(), p.end(), r + 1);
    }
    LOCUS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(n), type.get(),
                                  op.get(), comm.get()));
    for (std::int64_t i = 0; i < n; ++i) {
      const double* r = buf.data() + static_cast<std::size_t>(i) * rec;
      if (r[0] == 0) {
        throw InternalError(fmt::format("no rank holds the statistics of unit {} of {}",
                                        first + i, units));
      }
      merge_packed(acc.data(), r + 1, merged.data(), d);
      acc.swap(merged);
    }
  }
  return unpack(acc, d);
}

namespace {

// histogram_bin for one feature with the per-feature constants hoisted out of the row loop.
// The estimate multiplies by a precomputed bins/(hi - lo); being off by one ulp there is harmless
// because the edge comparisons below decide the bin exactly as numpy does.
struct Binner {
  double lo, hi, step, scale;
  int bins;

  Binner(double lo_, double hi_, int bins_)
      : lo(lo_), hi(hi_), step((hi_ - lo_) / bins_),
        scale(hi_ > lo_ ? bins_ / (hi_ - lo_) : 0.0), bins(bins_) {}

  double edge(int b) const { return b == bins ? hi : static_cast<double>(b) * step + lo; }

  int operator()(double x) const {
    if (std::isnan(x)) return -1;
    if (x < lo) return 0;
    if (x > hi) return bins - 1;
    if (hi <= lo) return bins / 2;  // constant feature and x == lo
    if (x >= hi) return bins - 1;
    int b = std::clamp(static_cast<int>((x - lo) * scale), 0, bins - 1);
    if (x < edge(b)) {
      --b;
    } else if (b != bins - 1 && x >= edge(b + 1)) {
      ++b;
    }
    return b;
  }
};

}  // namespace

int histogram_bin(double x, double lo, double hi, int bins) noexcept {
  return Binner(lo, hi, bins)(x);
}

Histogram compute_histogram(const mpi::Comm& comm, const Table& local, std::vector<double> lo,
                            std::vector<double> hi, int bins) {
  const std::int64_t d = global_cols(comm, local);
  mpi::agree_on(comm, [&] {
    if (bins < 1)
      throw ConfigError(fmt::format("histogram needs at least 1 bin, got {}: set psi_bins >= 1",
                                    bins));
    if (lo.size() != hi.size() || (d != 0 && static_cast<std::int64_t>(lo.size()) != d))
      throw DataError(fmt::format("histogram range has {} lower and {} upper bounds for a table "
                                  "of {} features: the reference statistics do not match the data",
                                  lo.size(), hi.size(), d));
    for (std::size_t f = 0; f < lo.size(); ++f)
      if (!std::isfinite(lo[f]) || !std::isfinite(hi[f]) || lo[f] > hi[f])
        throw DataError(fmt::format("histogram range of feature {} is [{}, {}], which is not a "
                                    "finite interval: recompute the reference statistics",
                                    f, lo[f], hi[f]));
  });

  Histogram h;
  h.bins = bins;
  h.counts.assign(lo.size() * static_cast<std::size_t>(bins), 0);
  const std::size_t cols = lo.size(), rows = static_cast<std::size_t>(local.rows());
  std::vector<Binner> binners;
  for (std::size_t f = 0; f < cols; ++f) binners.emplace_back(lo[f], hi[f], bins);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t f = 0; f < cols; ++f) {
      const int b = binners[f](local.features[r * cols + f]);
      if (b >= 0) ++h.counts[f * static_cast<std::size_t>(bins) + static_cast<std::size_t>(b)];
    }
  comm.allreduce_inplace(std::span<std::int64_t>(h.counts), MPI_SUM);
  h.lo = std::move(lo);
  h.hi = std::move(hi);
  return h;
}

NormalizationParams make_normalization(Normalization mode, const FeatureStats& raw) {
  const std::size_t d = raw.cols();
  NormalizationParams p{mode, std::vector<double>(d, 0.0), std::vector<double>(d, 1.0)};
  if (mode == Normalization::none || raw.count == 0) return p;
  const std::vector<double> sd = raw.stddev();
  for (std::size_t f = 0; f < d; ++f) {
    const bool standardize = mode == Normalization::standardize;
    const double offset = standardize ? raw.mean[f] : raw.min[f];
    const double spread = standardize ? sd[f] : raw.max[f] - raw.min[f];
    p.offset[f] = std::isfinite(offset) ? offset : 0.0;
    // A constant feature keeps its scale: it maps to 0, not to a division by zero.
    if (std::isfinite(spread) && spread > 0) p.scale[f] = 1.0 / spread;
  }
  return p;
}

void apply_normalization(Table& local, const NormalizationParams& p) {
  const std::size_t rows = static_cast<std::size_t>(local.rows());
  if (rows == 0) return;
  const auto d = static_cast<std::size_t>(local.cols);
  if (p.offset.size() != d || p.scale.size() != d)
    throw DataError(fmt::format("normalization parameters cover {} features but the data has {}: "
                                "appended data must have the dataset's columns",
                                p.offset.size(), d));
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t f = 0; f < d; ++f) {
      float& x = local.features[r * d + f];
      x = static_cast<float>((static_cast<double>(x) - p.offset[f]) * p.scale[f]);
    }
}

Normalization parse_normalization(const std::string& s) {
  if (s == "none") return Normalization::none;
  if (s == "standardize") return Normalization::standardize;
  if (s == "minmax") return Normalization::minmax;
  throw ConfigError(fmt::format("unknown normalization '{}': use one of none, standardize, minmax",
                                s));
}

std::string_view to_string(Normalization n) noexcept {
  switch (n) {
    case Normalization::standardize: return "standardize";
    case Normalization::minmax: return "minmax";
    case Normalization::none: break;
  }
  return "none";
}

std::int64_t nonfinite_rows(Table& t, std::int64_t from_row, bool drop) {
  const auto rows = static_cast<std::size_t>(t.rows());
  const auto d = static_cast<std::size_t>(t.cols);
  std::int64_t bad = 0;
  auto kept = static_cast<std::size_t>(from_row);  // rows compacted to the front when dropping
  for (std::size_t r = kept; r < rows; ++r) {
    const float* row = t.features.data() + r * d;
    const bool finite = std::all_of(row, row + d, [](float v) { return std::isfinite(v); });
    if (!finite) {
      ++bad;
      continue;
    }
    if (drop && kept != r) {
      std::copy(row, row + d, t.features.begin() + static_cast<std::ptrdiff_t>(kept * d));
      if (t.has_labels) t.labels[kept] = t.labels[r];
    }
    ++kept;
  }
  if (drop && bad > 0) {
    t.features.resize(kept * d);
    if (t.has_labels) t.labels.resize(kept);
  }
  return bad;
}

std::int64_t handle_nonfinite(const mpi::Comm& comm, Table& local, bool drop) {
  return comm.allreduce(nonfinite_rows(local, 0, drop), MPI_SUM);
}

}  // namespace locus::io
