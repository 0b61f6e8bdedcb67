// Feature statistics, histograms, normalization and non-finite handling, each checked against
// a serial reference over the whole data set, which every rank generates and then slices
// unevenly (some ranks hold no rows) to get its share.
#include <gtest/gtest.h>

#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>

#include "locus/comm/error.hpp"
#include "locus/io/stats.hpp"

using namespace locus;
using namespace locus::io;

namespace {

constexpr std::int64_t kCols = 5;

// The whole data set: a large offset with a tiny spread (the numerically hard case), a plain
// standard normal, a constant, a wide skewed feature, and one with mean 1e6.
Table full_table(std::int64_t rows, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0.0, 1.0);
  std::exponential_distribution<double> ex(0.5);
  Table t;
  t.cols = kCols;
  t.has_labels = true;
  for (std::int64_t f = 0; f < kCols; ++f) t.feature_names.push_back("f" + std::to_string(f));
  for (std::int64_t r = 0; r < rows; ++r) {
    t.features.push_back(static_cast<float>(1e4 + 0.01 * n01(rng)));
    t.features.push_back(static_cast<float>(n01(rng)));
    t.features.push_back(3.0f);
    t.features.push_back(static_cast<float>(ex(rng) * 100.0));
    t.features.push_back(static_cast<float>(1e6 + 1e3 * n01(rng)));
    t.labels.push_back(static_cast<std::int32_t>(r % 10));
  }
  return t;
}

// Rows [begin, end) of rank `rank` when the rows are shared by weights (zero weights give
// empty ranks), so the merge sees very different partial counts.
std::pair<std::int64_t, std::int64_t> share(std::int64_t rows, int rank, int size,
                                            std::vector<int> weights) {
  std::vector<std::int64_t> w(static_cast<std::size_t>(size));
  std::int64_t total = 0;
  for (int r = 0; r < size; ++r) total += w[static_cast<std::size_t>(r)] =
                                     weights[static_cast<std::size_t>(r) % weights.size()];
  if (total == 0) {  // e.g. {0, 0, 0, 1} on fewer than 4 ranks: the last rank takes all
    w.back() = 1;
    total = 1;
  }
  std::int64_t before = 0;
  for (int r = 0; r < rank; ++r) before += w[static_cast<std::size_t>(r)];
  const std::int64_t begin = rows * before / total;
  const std::int64_t end = rows * (before + w[static_cast<std::size_t>(rank)]) / total;
  return {begin, end};
}

Table slice(const Table& t, std::int64_t begin, std::int64_t end) {
  Table s = t;
  s.features.assign(t.features.begin() + begin * t.cols, t.features.begin() + end * t.cols);
  s.labels.assign(t.labels.begin() + begin, t.labels.begin() + end);
  return s;
}

// Serial two-pass reference in long double.
struct Reference {
  std::vector<long double> mean, m2;
  std::vector<double> min, max;
};
Reference serial_stats(const Table& t) {
  const auto d = static_cast<std::size_t>(t.cols);
  const auto n = static_cast<std::size_t>(t.rows());
  Reference ref{std::vector<long double>(d, 0), std::vector<long double>(d, 0),
                std::vector<double>(d, INFINITY), std::vector<double>(d, -INFINITY)};
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t f = 0; f < d; ++f) {
      const double v = t.features[r * d + f];
      ref.mean[f] += v;
      ref.min[f] = std::min(ref.min[f], v);
      ref.max[f] = std::max(ref.max[f], v);
    }
  for (auto& m : ref.mean) m /= static_cast<long double>(n);
  for (std::size_t r = 0; r < n; ++r)
    for (std::size_t f = 0; f < d; ++f) {
      const long double dev = t.features[r * d + f] - ref.mean[f];
      ref.m2[f] += dev * dev;
    }
  return ref;
}

bool rel_near(double got, long double want, double rel = 1e-6) {
  const long double err = std::fabs(static_cast<long double>(got) - want);
  return err <= rel * std::max(std::fabs(want), 1e-300L);
}

void expect_matches(const FeatureStats& s, const Table& full) {
  const Reference ref = serial_stats(full);
  ASSERT_EQ(s.count, full.rows());
  ASSERT_EQ(s.cols(), static_cast<std::size_t>(full.cols));
  for (std::size_t f = 0; f < s.cols(); ++f) {
    EXPECT_TRUE(rel_near(s.mean[f], ref.mean[f])) << "mean f" << f << " " << s.mean[f];
    EXPECT_TRUE(rel_near(s.m2[f], ref.m2[f])) << "m2 f" << f << " " << s.m2[f] << " vs "
                                              << static_cast<double>(ref.m2[f]);
    EXPECT_EQ(s.min[f], ref.min[f]) << "min f" << f;
    EXPECT_EQ(s.max[f], ref.max[f]) << "max f" << f;
  }
}

// Every rank must hold bit-identical values: MIN and MAX of the bit patterns agree.
void expect_identical_on_all_ranks(const mpi::Comm& comm, const std::vector<double>& v) {
  std::vector<std::int64_t> lo(v.size()), hi(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) lo[i] = hi[i] = std::bit_cast<std::int64_t>(v[i]);
  comm.allreduce_inplace(std::span<std::int64_t>(lo), MPI_MIN);
  comm.allreduce_inplace(std::span<std::int64_t>(hi), MPI_MAX);
  EXPECT_EQ(lo, hi) << "ranks hold different statistics";
}

const std::vector<std::vector<int>> kWeightSets = {{5, 0, 1, 30}, {1, 40, 0, 3}, {0, 0, 0, 1}};

}  // namespace

TEST(Stats, MatchSerialTwoPassAcrossUnevenShares) {
  mpi::Comm world = mpi::Comm::world();
  const Table full = full_table(2357, 42);
  for (const auto& weights : kWeightSets) {
    const auto [b, e] = share(full.rows(), world.rank(), world.size(), weights);
    const FeatureStats s = compute_stats(world, slice(full, b, e));
    expect_matches(s, full);
    expect_identical_on_all_ranks(world, s.mean);
    expect_identical_on_all_ranks(world, s.m2);
    // The 1e4-offset feature: its spread must survive (naive Σx² - n·mean² loses it in float).
    EXPECT_LT(s.stddev()[0], 0.02);
    EXPECT_GT(s.stddev()[0], 0.005);
    EXPECT_EQ(s.m2[2], 0.0) << "a constant feature has no spread";
  }
}

TEST(Stats, EmptyRanksMayReportZeroColumns) {
  mpi::Comm world = mpi::Comm::world();
  const Table full = full_table(100, 7);
  const auto [b, e] = share(full.rows(), world.rank(), world.size(), {0, 1});
  Table mine = slice(full, b, e);
  if (mine.rows() == 0) mine = Table{};  // as a reader that saw no rows might leave it
  expect_matches(compute_stats(world, mine), full);
}

TEST(Stats, NoRowsAnywhereGivesMergeIdentity) {
  mpi::Comm world = mpi::Comm::world();
  Table empty = full_table(0, 1);
  const FeatureStats s = compute_stats(world, empty);
  EXPECT_EQ(s.count, 0);
  ASSERT_EQ(s.cols(), static_cast<std::size_t>(kCols));
  EXPECT_EQ(s.min[0], INFINITY);
  EXPECT_EQ(s.max[0], -INFINITY);
  EXPECT_EQ(s.stddev(), std::vector<double>(kCols, 0.0));
}

TEST(Stats, RanksDisagreeingOnColumnsAllThrowTheSameError) {
  mpi::Comm world = mpi::Comm::world();
  if (world.size() == 1) GTEST_SKIP() << "needs two ranks";
  Table t = full_table(10, 3);
  if (world.rank() == 1) {  // one fewer column, still 10 rows
    t.cols = kCols - 1;
    t.features.resize(static_cast<std::size_t>(10 * t.cols));
  }
  try {
    compute_stats(world, t);
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("between 4 and 5"), std::string::npos) << e.what();
  }
}

TEST(Stats, MergeEqualsStatsOfConcatenation) {
  mpi::Comm self = mpi::Comm::borrow(MPI_COMM_SELF);
  const Table full = full_table(1000, 11);
  for (std::int64_t cut : {0, 1, 10, 500, 999, 1000}) {
    const FeatureStats a = compute_stats(self, slice(full, 0, cut));
    const FeatureStats b = compute_stats(self, slice(full, cut, full.rows()));
    expect_matches(merge(a, b), full);
  }
  const FeatureStats all = compute_stats(self, full);
  const FeatureStats m = merge(all, FeatureStats{});
  EXPECT_EQ(m.mean, all.mean);
  EXPECT_EQ(merge(FeatureStats{}, all).m2, all.m2);
  FeatureStats other = all;
  other.mean.pop_back();
  EXPECT_THROW(merge(all, other), DataError);
}

TEST(Histogram, BinBoundaries) {
  EXPECT_EQ(histogram_bin(-1.0, 0, 4, 4), 0);
  EXPECT_EQ(histogram_bin(0.0, 0, 4, 4), 0);
  EXPECT_EQ(histogram_bin(0.999, 0, 4, 4), 0);
  EXPECT_EQ(histogram_bin(1.0, 0, 4, 4), 1);
  EXPECT_EQ(histogram_bin(3.5, 0, 4, 4), 3);
  EXPECT_EQ(histogram_bin(4.0, 0, 4, 4), 3);
  EXPECT_EQ(histogram_bin(INFINITY, 0, 4, 4), 3);
  EXPECT_EQ(histogram_bin(-INFINITY, 0, 4, 4), 0);
  EXPECT_EQ(histogram_bin(NAN, 0, 4, 4), -1);
  // Values on an edge, where floor((x - lo) / (hi - lo) * bins) rounds one bin low but
  // numpy.histogram (and so histogram_bin) puts them in the bin that the edge opens.
  EXPECT_EQ(histogram_bin(4.1, 4.0, 4.2, 2), 1);
  EXPECT_EQ(histogram_bin(6.0, 4.4, 6.4, 5), 4);
  EXPECT_EQ(histogram_bin(1.14, 0.9, 1.2, 5), 4);
  // constant feature: below, equal, above
  EXPECT_EQ(histogram_bin(1.0, 2, 2, 5), 0);
  EXPECT_EQ(histogram_bin(2.0, 2, 2, 5), 2);
  EXPECT_EQ(histogram_bin(3.0, 2, 2, 5), 4);
}

TEST(Histogram, EqualsSerialCounts) {
  mpi::Comm world = mpi::Comm::world();
  const Table full = full_table(1777, 5);
  // A range narrower than the data for some features, so the clamping is exercised.
  const std::vector<double> lo = {1e4 - 0.01, -1.0, 3.0, 0.0, 1e6 - 5e3};
  const std::vector<double> hi = {1e4 + 0.01, 1.0, 3.0, 300.0, 1e6 + 5e3};
  const int bins = 7;
  std::vector<std::int64_t> want(kCols * bins, 0);
  for (std::int64_t r = 0; r < full.rows(); ++r)
    for (std::size_t f = 0; f < kCols; ++f)
      ++want[f * bins + static_cast<std::size_t>(histogram_bin(
                            full.features[static_cast<std::size_t>(r * kCols) + f], lo[f],
                            hi[f], bins))];
  for (const auto& weights : kWeightSets) {
    const auto [b, e] = share(full.rows(), world.rank(), world.size(), weights);
    const Histogram h = compute_histogram(world, slice(full, b, e), lo, hi, bins);
    EXPECT_EQ(h.counts, want);
    EXPECT_EQ(h.lo, lo);
    EXPECT_EQ(h.bins, bins);
    EXPECT_EQ(h.at(2, bins / 2), full.rows()) << "constant feature lands in the middle bin";
  }
  EXPECT_THROW(compute_histogram(world, full_table(3, 1), lo, hi, 0), ConfigError);
  std::vector<double> bad_hi = hi;
  bad_hi[1] = -2.0;
  EXPECT_THROW(compute_histogram(world, full_table(3, 1), lo, bad_hi, bins), DataError);
}

TEST(Normalization, StandardizeAndMinmaxMath) {
  mpi::Comm world = mpi::Comm::world();
  const Table full = full_table(999, 9);
  const auto [b, e] = share(full.rows(), world.rank(), world.size(), {2, 1, 0, 1});
  const FeatureStats raw = compute_stats(world, slice(full, b, e));

  const NormalizationParams st = make_normalization(Normalization::standardize, raw);
  EXPECT_EQ(st.offset[1], raw.mean[1]);
  EXPECT_DOUBLE_EQ(st.scale[1], 1.0 / raw.stddev()[1]);
  EXPECT_EQ(st.scale[2], 1.0) << "constant feature keeps scale 1";
  Table mine = slice(full, b, e);
  apply_normalization(mine, st);
  const FeatureStats ns = compute_stats(world, mine);
  const std::vector<double> sd = ns.stddev();
  for (std::size_t f : {0u, 1u, 3u, 4u}) {
    EXPECT_NEAR(ns.mean[f], 0.0, 1e-5) << f;
    EXPECT_NEAR(sd[f], 1.0, 1e-5) << f;
  }
  EXPECT_EQ(ns.max[2], 0.0);

  const NormalizationParams mm = make_normalization(Normalization::minmax, raw);
  mine = slice(full, b, e);
  apply_normalization(mine, mm);
  const FeatureStats nm = compute_stats(world, mine);
  for (std::size_t f : {0u, 1u, 3u, 4u}) {
    EXPECT_NEAR(nm.min[f], 0.0, 1e-6) << f;
    EXPECT_NEAR(nm.max[f], 1.0, 1e-6) << f;
  }

  const NormalizationParams none = make_normalization(Normalization::none, raw);
  mine = slice(full, b, e);
  apply_normalization(mine, none);
  EXPECT_EQ(mine.features, slice(full, b, e).features);

  Table narrow = full_table(2, 1);
  narrow.cols = 2;
  narrow.features.resize(4);
  EXPECT_THROW(apply_normalization(narrow, st), DataError);
}

TEST(Normalization, ParseNamesAllowedValues) {
  EXPECT_EQ(parse_normalization("none"), Normalization::none);
  EXPECT_EQ(parse_normalization("standardize"), Normalization::standardize);
  EXPECT_EQ(parse_normalization("minmax"), Normalization::minmax);
  for (auto n : {Normalization::none, Normalization::standardize, Normalization::minmax})
    EXPECT_EQ(parse_normalization(std::string(to_string(n))), n);
  try {
    parse_normalization("zscore");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'zscore'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("none, standardize, minmax"), std::string::npos) << msg;
  }
}

TEST(Nonfinite, CountsAndDropsExactlyTheBadRows) {
  mpi::Comm world = mpi::Comm::world();
  Table full = full_table(500, 13);
  const std::vector<std::pair<std::int64_t, std::int64_t>> bad = {
      {0, 1}, {17, 4}, {18, 0}, {250, 2}, {251, 3}, {499, 4}};
  const float poison[] = {NAN, INFINITY, -INFINITY};
  for (std::size_t i = 0; i < bad.size(); ++i)
    full.features[static_cast<std::size_t>(bad[i].first * kCols + bad[i].second)] =
        poison[i % 3];
  full.features[17 * kCols + 2] = NAN;  // two bad values in one row count once
  Table kept;
  kept.cols = kCols;
  for (std::int64_t r = 0; r < full.rows(); ++r) {
    if (std::any_of(bad.begin(), bad.end(), [&](auto p) { return p.first == r; })) continue;
    kept.features.insert(kept.features.end(), full.features.begin() + r * kCols,
                         full.features.begin() + (r + 1) * kCols);
    kept.labels.push_back(full.labels[static_cast<std::size_t>(r)]);
  }
  for (const auto& weights : kWeightSets) {
    const auto [b, e] = share(full.rows(), world.rank(), world.size(), weights);
    Table mine = slice(full, b, e);
    const Table before = mine;
    EXPECT_EQ(handle_nonfinite(world, mine, /*drop=*/false), 6);
    EXPECT_EQ(mine.features.size(), before.features.size()) << "drop=false keeps rows";

    EXPECT_EQ(handle_nonfinite(world, mine, /*drop=*/true), 6);
    // Expected survivors of this rank: its original rows minus the bad ones, in order.
    std::int64_t kb = b, ke = e;
    for (auto [row, col] : bad) {
      (void)col;
      if (row < b) --kb;
      if (row < e) --ke;
    }
    const Table want = slice(kept, kb, ke);
    EXPECT_EQ(mine.features, want.features);
    EXPECT_EQ(mine.labels, want.labels);
    EXPECT_EQ(handle_nonfinite(world, mine, true), 0) << "nothing left to drop";
  }
}

namespace {

// numpy's view of a real data set: rank 0 has Python unpack the IDX file to raw float32 rows and
// write mean, std (ddof=0), min, max and 10-bin histograms over [min, max] as raw arrays.
constexpr const char* kNumpyScript = R"(
import gzip, sys, numpy as np
src, out = sys.argv[1], sys.argv[2]
raw = gzip.open(src).read()
n, r, c = (int.from_bytes(raw[i:i + 4], "big") for i in (4, 8, 12))
x = np.frombuffer(raw, np.uint8, offset=16).reshape(n, r * c).astype(np.float32)
x.tofile(out + "/x.f32")
x64 = x.astype(np.float64)
lo, hi = x64.min(0), x64.max(0)
np.stack([x64.mean(0), x64.std(0), lo, hi]).tofile(out + "/stats.f64")
h = np.zeros((x.shape[1], 10), np.int64)
for f in range(x.shape[1]):
    if hi[f] > lo[f]:
        h[f] = np.histogram(x64[:, f], bins=10, range=(lo[f], hi[f]))[0]
    else:
        h[f, 5] = n  # numpy widens a zero range; locus puts a constant in the middle bin
h.tofile(out + "/hist.i64")
)";

template <class T>
std::vector<T> read_raw(const std::string& path, std::int64_t first = 0, std::int64_t count = -1) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(0, std::ios::end);
  const auto total = static_cast<std::int64_t>(in.tellg()) / static_cast<std::int64_t>(sizeof(T));
  if (count < 0) count = total - first;
  std::vector<T> v(static_cast<std::size_t>(count));
  in.seekg(first * static_cast<std::int64_t>(sizeof(T)));
  in.read(reinterpret_cast<char*>(v.data()), count * static_cast<std::int64_t>(sizeof(T)));
  return v;
}

}  // namespace

TEST(Stats, MatchNumpyOnFashionMnist) {
  mpi::Comm world = mpi::Comm::world();
  const std::string images = "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz";
  std::string dir;
  if (world.is_root() && access(images.c_str(), R_OK) == 0 &&
      access("/usr/bin/python3", X_OK) == 0) {
    char tmpl[] = "/tmp/locus-stats-XXXXXX";
    if (mkdtemp(tmpl) != nullptr) {
      dir = tmpl;
      std::ofstream(dir + "/numpy_stats.py") << kNumpyScript;
      const std::string cmd = "/usr/bin/python3 " + dir + "/numpy_stats.py " + images + " " + dir;
      if (std::system(cmd.c_str()) != 0) dir += "!";  // "!" marks a failed script
    }
  }
  dir = world.bcast(dir, 0);
  if (dir.empty()) GTEST_SKIP() << "needs " << images << " and /usr/bin/python3";
  ASSERT_NE(dir.back(), '!') << "the numpy script failed";

  const std::vector<double> np_stats = read_raw<double>(dir + "/stats.f64");
  const std::int64_t d = static_cast<std::int64_t>(np_stats.size()) / 4;
  const auto np_part = [&](int k) {
    return std::vector<double>(np_stats.begin() + k * d, np_stats.begin() + (k + 1) * d);
  };
  const std::int64_t rows = std::filesystem::file_size(dir + "/x.f32") / (4 * d);
  const auto [b, e] = share(rows, world.rank(), world.size(), {3, 1, 0, 2});
  Table mine;
  mine.cols = d;
  mine.features = read_raw<float>(dir + "/x.f32", b * d, (e - b) * d);

  const FeatureStats s = compute_stats(world, mine);
  EXPECT_EQ(s.count, rows);
  const std::vector<double> mean = np_part(0), sd = np_part(1), mn = np_part(2), mx = np_part(3);
  const std::vector<double> my_sd = s.stddev();
  for (std::size_t f = 0; f < static_cast<std::size_t>(d); ++f) {
    EXPECT_NEAR(s.mean[f], mean[f], 1e-6 * std::max(std::abs(mean[f]), 1e-9)) << f;
    EXPECT_NEAR(my_sd[f], sd[f], 1e-6 * std::max(sd[f], 1e-9)) << f;
  }
  EXPECT_EQ(s.min, mn);
  EXPECT_EQ(s.max, mx);
  const Histogram h = compute_histogram(world, mine, s.min, s.max, 10);
  EXPECT_EQ(h.counts, read_raw<std::int64_t>(dir + "/hist.i64"));

  world.barrier();
  if (world.is_root()) std::filesystem::remove_all(dir);
}
