// Data-quality gates: each rule fires on a crafted bad input with the measured value and the
// threshold in the report, passes on good input, and the JSON report parses and is identical
// on every rank. (dump_json on its own: test_json.cpp.)
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "agreed_error.hpp"
#include "locus/comm/error.hpp"
#include "locus/io/gates.hpp"

using namespace locus;
using namespace locus::io;

namespace {

constexpr std::int64_t kCols = 6, kClasses = 10, kRows = 2000, kRefRows = 2100;

// Labelled data: normal features with different scales, f5 constant (3.0).
Table full_table(std::int64_t rows, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n01(0.0, 1.0);
  Table t;
  t.cols = kCols;
  t.has_labels = true;
  t.label_name = "label";
  for (std::int64_t f = 0; f < kCols; ++f) t.feature_names.push_back("f" + std::to_string(f));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t f = 0; f < kCols - 1; ++f)
      t.features.push_back(static_cast<float>(10.0 * static_cast<double>(f) +
                                              (1.0 + static_cast<double>(f)) * n01(rng)));
    t.features.push_back(3.0f);
    t.labels.push_back(static_cast<std::int32_t>(rng() % kClasses));
  }
  return t;
}

float& at(Table& t, std::int64_t row, std::int64_t col) {
  return t.features[static_cast<std::size_t>(row * t.cols + col)];
}

// This rank's uneven share of the rows (rank 1 of 2 or 4 holds none).
Table my_share(const mpi::Comm& comm, const Table& t) {
  static const int weights[] = {3, 0, 1, 5};
  std::int64_t total = 0, before = 0;
  for (int r = 0; r < comm.size(); ++r) {
    total += weights[r % 4];
    if (r < comm.rank()) before += weights[r % 4];
  }
  const std::int64_t b = t.rows() * before / total;
  const std::int64_t e = t.rows() * (before + weights[comm.rank() % 4]) / total;
  Table s = t;
  s.features.assign(t.features.begin() + b * t.cols, t.features.begin() + e * t.cols);
  if (t.has_labels) s.labels.assign(t.labels.begin() + b, t.labels.begin() + e);
  return s;
}

// The reference dataset as the app would load it: stats and a histogram over its own range.
struct RefData {
  ReferenceStats stats;
  Histogram hist;
};
RefData make_reference(const mpi::Comm& comm, const Table& full_ref, int bins = 10) {
  const Table mine = my_share(comm, full_ref);
  const FeatureStats s = compute_stats(comm, mine);
  RefData r;
  r.stats = {"ref.h5", s.count, static_cast<std::int64_t>(s.cols()), s.mean, s.stddev(), s.min,
             s.max};
  r.hist = compute_histogram(comm, mine, s.min, s.max, bins);
  return r;
}

GateConfig all_gates() {
  GateConfig g;
  g.features = kCols;
  g.num_classes = kClasses;
  g.require_labels = true;
  g.min_rows = 100;
  g.max_rows = 1000000;
  g.rows_within_pct = 10;
  g.max_mean_shift = 0.5;
  g.max_psi = 0.25;
  return g;
}

// Evaluates the gates on this rank's share of `full`, as the app does.
GateReport evaluate(const mpi::Comm& comm, const Table& full, const GateConfig& cfg,
                    const RefData* ref) {
  const Table mine = my_share(comm, full);
  return evaluate_gates(comm, mine, cfg, compute_stats(comm, mine), ref ? &ref->stats : nullptr,
                        ref ? &ref->hist : nullptr);
}

const RuleResult* find_rule(const GateReport& r, const std::string& name) {
  for (const RuleResult& x : r.rules)
    if (x.rule == name) return &x;
  return nullptr;
}

// Asserts exactly the rules in `failing` failed, and returns (a copy of) the first of them.
RuleResult expect_failed(const GateReport& r, const std::vector<std::string>& failing) {
  std::vector<std::string> got;
  for (const RuleResult& x : r.rules)
    if (!x.passed) got.push_back(x.rule);
  EXPECT_EQ(got, failing) << r.summary();
  EXPECT_FALSE(r.passed());
  const RuleResult* first = find_rule(r, failing.at(0));
  LOCUS_ASSERT(first != nullptr, "failing rule missing");
  return *first;
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Rank 0 pipes the document to Python's json module; every rank learns the verdict.
bool python_parses(const mpi::Comm& comm, const std::string& json, const std::string& check) {
  int ok = 1;
  if (comm.is_root() && access("/usr/bin/python3", X_OK) == 0) {
    const std::string cmd = "/usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); " +
                            check + "'";
    FILE* p = popen(cmd.c_str(), "w");
    ok = p != nullptr && std::fwrite(json.data(), 1, json.size(), p) == json.size();
    if (p != nullptr) ok = pclose(p) == 0 && ok;
  }
  return comm.allreduce(ok, MPI_MIN) == 1;
}

bool same_on_all_ranks(const mpi::Comm& comm, const std::string& s) {
  const int same = comm.bcast(s, 0) == s ? 1 : 0;
  return comm.allreduce(same, MPI_MIN) == 1;
}

}  // namespace

TEST(Gates, GoodDataPassesEveryRule) {
  mpi::Comm world = mpi::Comm::world();
  const RefData ref = make_reference(world, full_table(kRefRows, 1));
  const GateReport r = evaluate(world, full_table(kRows, 2), all_gates(), &ref);
  EXPECT_TRUE(r.passed()) << r.summary();
  EXPECT_EQ(r.rules.size(), 10u);
  EXPECT_EQ(r.rows, kRows);
  EXPECT_EQ(r.cols, kCols);
  EXPECT_TRUE(contains(r.summary(), "all 10 data-quality gates passed")) << r.summary();
  const RuleResult* psi = find_rule(r, "max_psi");
  ASSERT_NE(psi, nullptr);
  EXPECT_LT(psi->value, 0.05);
  EXPECT_GE(psi->value, 0.0);
  EXPECT_NO_THROW(require_passed(r));
  const std::string json = r.to_json();
  EXPECT_TRUE(same_on_all_ranks(world, json));
  EXPECT_TRUE(python_parses(world, json,
                            "assert d[\"passed\"] is True and len(d[\"rules\"]) == 10 and "
                            "d[\"failed\"] == [] and d[\"reference\"] == \"ref.h5\""));
}

TEST(Gates, SchemaMismatchAgainstConfigAndReference) {
  mpi::Comm world = mpi::Comm::world();
  GateConfig cfg = all_gates();
  cfg.features = 7;
  // A reference with one more column: its statistics cannot be compared.
  Table wide = full_table(kRefRows, 1);
  wide.cols = kCols + 1;
  wide.features.resize(static_cast<std::size_t>(wide.cols * (kRefRows * kCols / wide.cols)));
  wide.labels.resize(static_cast<std::size_t>(wide.rows()));
  wide.feature_names.push_back("extra");
  const RefData ref = make_reference(world, wide);
  const GateReport r = evaluate(world, full_table(kRows, 2), cfg, &ref);
  const RuleResult& f =
      expect_failed(r, {"features", "reference_cols", "rows_within_pct", "max_mean_shift",
                        "max_psi"});
  EXPECT_EQ(f.value, 6);
  EXPECT_EQ(f.threshold, 7);
  const RuleResult* rc = find_rule(r, "reference_cols");
  EXPECT_EQ(rc->value, 6);
  EXPECT_EQ(rc->threshold, 7);
  EXPECT_TRUE(contains(rc->detail, "reference ref.h5 has 7")) << rc->detail;
  EXPECT_TRUE(std::isnan(find_rule(r, "max_psi")->value));
  EXPECT_TRUE(contains(find_rule(r, "max_psi")->detail, "not measured")) << r.summary();
  const std::string json = r.to_json();
  EXPECT_TRUE(contains(json, "\"value\":null"));
  EXPECT_TRUE(python_parses(world, json,
                            "assert d[\"passed\"] is False and d[\"failed\"][0] == "
                            "\"features\" and d[\"rules\"][0][\"value\"] == 6"));
  try {
    require_passed(r);
    FAIL() << "expected GateError";
  } catch (const GateError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_TRUE(contains(e.what(), "gate 'features' failed: data has 6 features, expected 7"))
        << e.what();
  }
}

TEST(Gates, LabelsOutOfRangeNameTheFirstOffendingRow) {
  mpi::Comm world = mpi::Comm::world();
  Table full = full_table(kRows, 2);
  full.labels[1234] = 12;
  full.labels[1500] = -1;
  GateConfig cfg;
  cfg.num_classes = kClasses;
  const GateReport r = evaluate(world, full, cfg, nullptr);
  const RuleResult& l = expect_failed(r, {"label_range"});
  EXPECT_EQ(l.value, 12);
  EXPECT_EQ(l.threshold, kClasses);
  EXPECT_TRUE(contains(l.detail, "2 rows have labels outside [0, 10)")) << l.detail;
  EXPECT_TRUE(contains(l.detail, "[-1, 12]")) << l.detail;
  EXPECT_TRUE(contains(l.detail, "global row 1234 with label 12")) << l.detail;
  EXPECT_TRUE(same_on_all_ranks(world, r.to_json()));

  Table unlabelled = full_table(kRows, 2);
  unlabelled.has_labels = false;
  unlabelled.labels.clear();
  cfg.require_labels = true;
  Table mine = my_share(world, unlabelled);
  const GateReport u = evaluate_gates(world, mine, cfg, compute_stats(world, mine), nullptr,
                                      nullptr);
  expect_failed(u, {"require_labels", "label_range"});
}

TEST(Gates, NonfiniteFailsOrIsDropped) {
  mpi::Comm world = mpi::Comm::world();
  Table full = full_table(kRows, 2);
  at(full, 77, 3) = NAN;
  at(full, 900, 0) = INFINITY;
  GateConfig cfg;
  const GateReport r = evaluate(world, full, cfg, nullptr);
  const RuleResult& n = expect_failed(r, {"nonfinite"});
  EXPECT_EQ(n.value, 2);
  EXPECT_EQ(n.threshold, 0);
  EXPECT_EQ(r.nonfinite_rows, 2);
  EXPECT_TRUE(contains(n.detail, "global row 77, feature 'f3' (index 3)")) << n.detail;
  EXPECT_TRUE(python_parses(world, r.to_json(), "assert d[\"nonfinite_rows\"] == 2"));

  cfg.drop_nonfinite = true;
  Table mine = my_share(world, full);
  const std::int64_t dropped = handle_nonfinite(world, mine, true);
  EXPECT_EQ(dropped, 2);
  const GateReport d =
      evaluate_gates(world, mine, cfg, compute_stats(world, mine), nullptr, nullptr, dropped);
  EXPECT_TRUE(d.passed()) << d.summary();
  EXPECT_EQ(d.rows, kRows - 2);
  EXPECT_EQ(d.dropped_rows, 2);
  EXPECT_EQ(d.nonfinite_rows, 2);
  EXPECT_EQ(find_rule(d, "nonfinite")->value, 2);
}

TEST(Gates, RecordCounts) {
  mpi::Comm world = mpi::Comm::world();
  const RefData ref = make_reference(world, full_table(kRefRows, 1));
  const Table full = full_table(kRows, 2);
  GateConfig cfg;
  cfg.min_rows = kRows + 1;
  const GateReport r1 = evaluate(world, full, cfg, nullptr);
  const RuleResult& mn = expect_failed(r1, {"min_rows"});
  EXPECT_EQ(mn.value, kRows);
  EXPECT_EQ(mn.threshold, kRows + 1);
  cfg.min_rows = kRows;
  EXPECT_TRUE(evaluate(world, full, cfg, nullptr).passed());

  cfg = GateConfig{};
  cfg.max_rows = kRows - 1;
  const GateReport r2 = evaluate(world, full, cfg, nullptr);
  const RuleResult& mx = expect_failed(r2, {"max_rows"});
  EXPECT_EQ(mx.value, kRows);
  EXPECT_EQ(mx.threshold, kRows - 1);

  cfg = GateConfig{};
  const double pct = 100.0 * (kRefRows - kRows) / kRefRows;  // 4.76 %
  cfg.rows_within_pct = 4.0;
  const GateReport r3 = evaluate(world, full, cfg, &ref);
  const RuleResult& wp = expect_failed(r3, {"rows_within_pct"});
  EXPECT_DOUBLE_EQ(wp.value, pct);
  EXPECT_EQ(wp.threshold, 4.0);
  cfg.rows_within_pct = 5.0;
  EXPECT_TRUE(evaluate(world, full, cfg, &ref).passed());
}

TEST(Gates, MeanShiftNamesTheWorstFeature) {
  mpi::Comm world = mpi::Comm::world();
  const RefData ref = make_reference(world, full_table(kRefRows, 1));
  Table full = full_table(kRows, 2);
  for (std::int64_t r = 0; r < kRows; ++r) at(full, r, 2) += 3.0f;  // +1 stddev of f2
  GateConfig cfg;
  cfg.max_mean_shift = 0.5;
  const GateReport rep = evaluate(world, full, cfg, &ref);
  const RuleResult& m = expect_failed(rep, {"max_mean_shift"});
  const FeatureStats cur = compute_stats(world, my_share(world, full));
  const double want = std::abs(cur.mean[2] - ref.stats.mean[2]) / ref.stats.stddev[2];
  EXPECT_DOUBLE_EQ(m.value, want);
  EXPECT_GT(m.value, 0.8);
  EXPECT_EQ(m.threshold, 0.5);
  EXPECT_TRUE(contains(m.detail, "feature 'f2' (index 2)")) << m.detail;

  // The constant f5 is compared in absolute units: moving it by 0.25 fails a 0.2 threshold.
  Table moved = full_table(kRows, 2);
  for (std::int64_t r = 0; r < kRows; ++r) at(moved, r, 5) = 3.25f;
  cfg.max_mean_shift = 0.2;
  const GateReport rc = evaluate(world, moved, cfg, &ref);
  const RuleResult& c = expect_failed(rc, {"max_mean_shift"});
  EXPECT_DOUBLE_EQ(c.value, 0.25);
  EXPECT_TRUE(contains(c.detail, "feature 'f5' (index 5)")) << c.detail;
  cfg.max_mean_shift = 0.3;
  EXPECT_TRUE(evaluate(world, moved, cfg, &ref).passed());
}

TEST(Gates, PsiMatchesSerialComputationOnTheWorstFeature) {
  mpi::Comm world = mpi::Comm::world();
  const RefData ref = make_reference(world, full_table(kRefRows, 1));
  Table full = full_table(kRows, 2);
  for (std::int64_t r = 0; r < kRows; ++r) at(full, r, 4) = 40.0f + 2.0f * (at(full, r, 4) - 40.0f);
  GateConfig cfg;
  cfg.max_psi = 0.25;
  const GateReport rep = evaluate(world, full, cfg, &ref);
  const RuleResult& p = expect_failed(rep, {"max_psi"});
  EXPECT_EQ(p.threshold, 0.25);
  EXPECT_TRUE(contains(p.detail, "feature 'f4' (index 4)")) << p.detail;

  // Serial PSI of f4 over the reference's edges, written out independently.
  const int bins = ref.hist.bins;
  std::vector<double> cur(static_cast<std::size_t>(bins), 0), want_ref(cur.size(), 0);
  for (std::int64_t r = 0; r < kRows; ++r)
    cur[static_cast<std::size_t>(
        histogram_bin(at(full, r, 4), ref.stats.min[4], ref.stats.max[4], bins))] += 1;
  double n_ref = 0;
  for (int b = 0; b < bins; ++b) n_ref += static_cast<double>(ref.hist.at(4, b));
  double psi = 0;
  for (int b = 0; b < bins; ++b) {
    const double pc = std::max(cur[static_cast<std::size_t>(b)] / kRows, 1e-4);
    const double pr = std::max(static_cast<double>(ref.hist.at(4, b)) / n_ref, 1e-4);
    psi += (pc - pr) * std::log(pc / pr);
  }
  EXPECT_NEAR(p.value, psi, 1e-12 * psi);
  EXPECT_GT(p.value, 0.25);

  // Identical distributions have PSI 0, including a constant feature.
  const std::int64_t same[] = {5, 0, 7}, other[] = {0, 3, 9};
  EXPECT_EQ(population_stability_index(same, same, 3), 0.0);
  EXPECT_GT(population_stability_index(same, other, 3), 1.0);
}

TEST(Gates, DriftRulesWithoutReferenceAreConfigErrorsOnEveryRank) {
  mpi::Comm world = mpi::Comm::world();
  const Table mine = my_share(world, full_table(100, 2));
  const FeatureStats s = compute_stats(world, mine);
  GateConfig cfg;
  cfg.max_psi = 0.1;
  const std::string what = locus::test::agreed_error<ConfigError>(
      [&] { evaluate_gates(world, mine, cfg, s, nullptr, nullptr); });
  EXPECT_TRUE(contains(what, "max_psi")) << what;
  cfg = GateConfig{};
  cfg.psi_bins = 0;
  EXPECT_THROW(evaluate_gates(world, mine, cfg, s, nullptr, nullptr), ConfigError);
}

// A report whose strings hold bytes that are not UTF-8 (a reference path in Latin-1, a binary
// CSV header named in a detail) is still valid JSON, with U+FFFD in their place.
TEST(Gates, ReportIsValidJsonWhateverTheBytes) {
  mpi::Comm world = mpi::Comm::world();
  GateReport r;
  r.rows = 5;
  r.cols = 2;
  r.reference = "caf\xe9/ref.h5";
  r.rules.push_back({"features", false, 2, 3, "feature '\xff\xfe' ..."});
  r.rules.push_back({"max_psi", true, NAN, 0.25, "not measured"});
  for (int indent : {0, 2}) {
    const std::string json = r.to_json(indent);
    EXPECT_TRUE(python_parses(
        world, json,
        "assert d[\"reference\"] == \"caf\\ufffd/ref.h5\" and "
        "d[\"rules\"][0][\"detail\"][9:11] == \"\\ufffd\\ufffd\" and "
        "d[\"rules\"][1][\"value\"] is None and d[\"rules\"][0][\"value\"] == 2.0 and "
        "d[\"failed\"] == [\"features\"] and list(d) == [\"passed\", \"rows\", \"cols\", "
        "\"nonfinite_rows\", \"dropped_rows\", \"reference\", \"failed\", \"rules\"]"))
        << json;
  }
}
