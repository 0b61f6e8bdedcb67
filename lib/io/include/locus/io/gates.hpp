// Data-quality gates of locus-ingest: schema, labels, non-finite values, record count and drift
// against a reference dataset, evaluated collectively before anything is published, and the
// report (human summary and JSON) that says which rule failed with its value and threshold.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/io/json.hpp"
#include "locus/io/stats.hpp"
#include "locus/io/table.hpp"

namespace locus::io {

// Which gates to evaluate; an unset optional means "rule not evaluated".
struct GateConfig {
  // schema
  std::optional<std::int64_t> features;     // expected feature count
  std::optional<std::int64_t> num_classes;  // labels must lie in [0, num_classes)
  bool require_labels = false;
  // non-finite values: false = "fail" (any NaN/Inf row fails), true = "drop" (the app dropped
  // them with handle_nonfinite and passes the count as dropped_rows)
  bool drop_nonfinite = false;
  // rows whose ingest.join key the join table lacks (always left out of the data): false =
  // "fail" (any such row fails the join_missing rule), true = "drop" (counted, passes)
  bool drop_join_missing = false;
  // record count
  std::optional<std::int64_t> min_rows, max_rows;
  std::optional<double> rows_within_pct;  // |rows - ref.rows| / ref.rows * 100 <= pct
  // drift against the reference dataset's statistics
  std::optional<double> max_mean_shift;   // max_f |mean_f - ref.mean_f| / ref.stddev_f
  std::optional<double> max_psi;          // max_f PSI_f
  int psi_bins = 10;  // bins of the histogram stored with each dataset (compute_histogram)
};

// The statistics of the reference dataset (loaded by the app from its HDF5 attributes).
struct ReferenceStats {
  std::string path;
  std::int64_t rows = 0, cols = 0;
  std::vector<double> mean, stddev, min, max;  // population stddev, as FeatureStats::stddev()
};

// One evaluated rule. `value` is what was measured, `threshold` the limit it was held to
// (NaN, written as null in JSON, where a rule could not be measured); `detail` is a sentence
// with the feature, row or file concerned, e.g. "feature 'pixel17' (index 17) PSI 0.41 >
// threshold 0.25".
struct RuleResult {
  std::string rule;
  bool passed = false;
  double value = 0;
  double threshold = 0;
  std::string detail;
};

struct GateReport {
  std::vector<RuleResult> rules;  // every evaluated rule, passed or not, in evaluation order
  std::int64_t rows = 0, cols = 0;  // of the data as evaluated (after any drop)
  std::int64_t nonfinite_rows = 0;  // rows with NaN/Inf found, dropped ones included
  std::int64_t dropped_rows = 0;
  std::optional<std::int64_t> join_missing_rows;  // with ingest.join: rows whose key it lacks
  std::string reference;            // reference dataset path, empty without one

  bool passed() const;
  // {"passed":false,"rows":..,"cols":..,"nonfinite_rows":..,"dropped_rows":..,
  //  "join_missing_rows":.. (only with a join),"reference":"..."|null,"failed":["max_psi"],"rules":[{"rule":"max_psi","passed":false,
  //  "value":0.41,"threshold":0.25,"detail":"..."}, ...]}; numbers round-trip exactly and
  // non-finite ones are null. indent > 0 pretty-prints.
  std::string to_json(int indent = 0) const;
  // The same document, to extend (locus-ingest adds its "schedule").
  Json json() const;
  // One line per failed rule, "gate 'max_psi' failed: feature 'pixel17' (index 17) PSI 0.41 >
  // threshold 0.25", or "all N data-quality gates passed" when none failed.
  std::string summary() const;
};

// Where a rank's rows sit in the dataset when they are not one block in rank order
// (locus-ingest's units): local rows from `local` up to the next run's are global rows from
// `global` on. Runs are ascending in both.
struct RowRun {
  std::int64_t local = 0;
  std::int64_t global = 0;
};

// Collective over comm. Evaluates, in this order and only where configured:
//   features        local cols == cfg.features
//   reference_cols  cols == ref->cols (whenever a reference is given)
//   require_labels  the table has labels
//   label_range     every label in [0, num_classes); value = the label of the first offending
//                   row (global row index in detail: rows numbered in rank order, or by
//                   `runs`), with the observed label range and the number of offending rows
//   nonfinite       always evaluated: value = rows with NaN/Inf (dropped_rows + those still in
//                   `local`), threshold 0; with drop_nonfinite only rows still present fail it
//   min_rows, max_rows, rows_within_pct (ref.rows == 0: 0 % if rows == 0, else +inf)
//   max_mean_shift  max over features of |mean - ref.mean| / ref.stddev; where ref.stddev is 0
//                   the absolute shift |mean - ref.mean| is used (a constant reference feature
//                   must stay put to within the threshold in its own units)
//   max_psi         PSI_f = Σ_b (p_cur - p_ref) ln(p_cur / p_ref), proportions floored at 1e-4;
//                   the current histogram uses the reference histogram's edges and bins
//                   (ref_hist->lo/hi are the reference's min/max; for a constant reference
//                   feature see histogram_bin); the worst feature is named in detail
// Drift rules are reported as failed, not measured (value null), when the feature counts differ.
// `stats` are compute_stats(comm, local); `dropped_rows` the value handle_nonfinite returned
// with drop == true (0 otherwise). ref and ref_hist must be identical on every rank; a drift or
// rows_within_pct rule without them, or with a histogram that does not match the reference, is
// a ConfigError / DataError thrown on every rank. Returns the same report on every rank.
GateReport evaluate_gates(const mpi::Comm& comm, const Table& local, const GateConfig& cfg,
                          const FeatureStats& stats, const ReferenceStats* ref,
                          const Histogram* ref_hist, std::int64_t dropped_rows = 0,
                          std::span<const RowRun> runs = {});

// The join_missing rule of an ingest with ingest.join, appended to report (local; every rank
// passes the same numbers): `missing` rows of `input` had a key in column `key` that the join
// table `table` lacks (they are not in the data the other rules saw); `first` names the first
// ("'in.csv' line 57: key 'x'"). Passes when there are none, or with cfg.drop_join_missing.
void join_missing_rule(const GateConfig& cfg, std::int64_t missing, const std::string& first,
                       const std::string& input, const std::string& table,
                       const std::string& key, GateReport& report);

// Population stability index of two histograms of one feature (counts over the same bins),
// with each proportion floored at eps so empty bins do not make it infinite.
double population_stability_index(const std::int64_t* current, const std::int64_t* reference,
                                  int bins, double eps = 1e-4);

// Throws a GateError carrying report.summary(), marked agreed (the report is identical on
// every rank), when the report did not pass; returns otherwise.
void require_passed(const GateReport& report);

}  // namespace locus::io
