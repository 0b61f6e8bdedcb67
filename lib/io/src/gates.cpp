// Gate evaluation: each rule reduces this rank's evidence with all-reduces so every rank builds
// the same RuleResult, in the same order; the report renders as a summary and as JSON.
#include "locus/io/gates.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <utility>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"
#include "locus/io/json.hpp"

namespace locus::io {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();

// Human-readable number for messages (the JSON keeps the exact value).
std::string num(double v) { return fmt::format("{:.6g}", v); }

// "1 row has" / "2 rows have".
std::string rows_have(std::int64_t n) {
  return fmt::format("{} {}", n, n == 1 ? "row has" : "rows have");
}

// "feature 'pixel17' (index 17)", with rank 0's name so the text is identical on every rank.
// Collective over comm.
std::string feature_label(const mpi::Comm& comm, const Table& local, std::size_t f) {
  std::string name = f < local.feature_names.size() ? local.feature_names[f] : std::string();
  name = comm.bcast(std::move(name), 0);
  if (name.empty()) return fmt::format("feature {}", f);
  return fmt::format("feature '{}' (index {})", name, f);
}

// The first flagged row over all ranks (rank order) and a value its owner attaches to it.
struct Located {
  std::int64_t row = -1;  // global row index, -1 when no rank flagged a row
  std::int64_t payload = 0;
};

// The global index of a local row: offset + row for a contiguous block, else through the runs
// (ascending in both local and global order, so the first local row maps to the first global).
std::int64_t global_row(std::int64_t offset, std::span<const RowRun> runs, std::int64_t row) {
  if (runs.empty()) return offset + row;
  const auto after = std::upper_bound(runs.begin(), runs.end(), row,
                                      [](std::int64_t r, const RowRun& run) { return r < run.local; });
  LOCUS_ASSERT(after != runs.begin(), fmt::format("local row {} precedes the first run", row));
  const RowRun& run = *(after - 1);
  return run.global + (row - run.local);
}

// Collective over comm. local_row is this rank's first flagged row (or -1); offset the global
// index of this rank's first row (or runs, when its rows are not one block).
Located locate_first(const mpi::Comm& comm, std::int64_t offset, std::span<const RowRun> runs,
                     std::int64_t local_row, std::int64_t payload) {
  const std::int64_t mine = local_row >= 0 ? global_row(offset, runs, local_row) : kNone;
  const std::int64_t first = comm.allreduce(mine, MPI_MIN);
  if (first == kNone) return {};
  const std::int64_t owned =
      mine == first ? payload : std::numeric_limits<std::int64_t>::min();
  return {first, comm.allreduce(owned, MPI_MAX)};
}

// Everything a rule needs besides the table, computed once.
struct Context {
  const mpi::Comm& comm;
  const Table& local;
  const GateConfig& cfg;
  const FeatureStats& stats;
  const ReferenceStats* ref;
  const Histogram* ref_hist;
  std::int64_t rows = 0, cols = 0, offset = 0;
  std::span<const RowRun> runs;
  bool labelled = false;
};

// Checks made before any rule, agreed on all ranks: a misconfigured gate must fail the same way
// everywhere instead of leaving ranks in different collectives.
void validate(const Context& c) {
  const GateConfig& g = c.cfg;
  const auto need_ref = [&](bool set, const char* rule, bool need_hist) {
    if (set && (!c.ref || (need_hist && !c.ref_hist)))
      throw ConfigError(fmt::format("gate {} compares with a reference dataset{}, but none was "
                                    "given: give a reference dataset or unset {}",
                                    rule, need_hist ? " and its histogram" : "", rule));
  };
  need_ref(g.rows_within_pct.has_value(), "rows_within_pct", false);
  need_ref(g.max_mean_shift.has_value(), "max_mean_shift", false);
  need_ref(g.max_psi.has_value(), "max_psi", true);
  const auto non_negative = [](const char* rule, double v) {
    if (!(v >= 0))
      throw ConfigError(fmt::format("gate {} = {} must be a number >= 0", rule, v));
  };
  if (g.features) non_negative("features", static_cast<double>(*g.features));
  if (g.num_classes && *g.num_classes < 1)
    throw ConfigError(fmt::format("gate num_classes = {} must be >= 1", *g.num_classes));
  if (g.min_rows) non_negative("min_rows", static_cast<double>(*g.min_rows));
  if (g.max_rows) non_negative("max_rows", static_cast<double>(*g.max_rows));
  if (g.rows_within_pct) non_negative("rows_within_pct", *g.rows_within_pct);
  if (g.max_mean_shift) non_negative("max_mean_shift", *g.max_mean_shift);
  if (g.max_psi) non_negative("max_psi", *g.max_psi);
  if (g.psi_bins < 1)
    throw ConfigError(fmt::format("gate psi_bins = {} must be >= 1", g.psi_bins));
  if (c.ref) {
    const auto d = static_cast<std::size_t>(c.ref->cols);
    if (c.ref->mean.size() != d || c.ref->stddev.size() != d || c.ref->min.size() != d ||
        c.ref->max.size() != d)
      throw DataError(fmt::format("reference {} has {} columns but statistics for {}: the "
                                  "reference dataset is incomplete; re-ingest it",
                                  c.ref->path, d, c.ref->mean.size()));
  }
  if (c.ref && c.ref_hist) {
    const Histogram& h = *c.ref_hist;
    if (static_cast<std::int64_t>(h.cols()) != c.ref->cols || h.hi.size() != h.cols() ||
        h.bins < 1 || h.counts.size() != h.cols() * static_cast<std::size_t>(h.bins))
      throw DataError(fmt::format("reference {} has a histogram of {} features x {} bins for "
                                  "{} columns: the reference dataset is inconsistent; re-ingest "
                                  "it",
                                  c.ref->path, h.cols(), h.bins, c.ref->cols));
  }
  LOCUS_ASSERT(c.stats.count == c.rows &&
                   (c.rows == 0 || static_cast<std::int64_t>(c.stats.cols()) == c.cols),
               "evaluate_gates needs compute_stats of the same table (after any drop)");
}

void schema_rules(const Context& c, std::vector<RuleResult>& out) {
  if (c.cfg.features) {
    const std::int64_t want = *c.cfg.features;
    out.push_back({"features", c.cols == want, static_cast<double>(c.cols),
                   static_cast<double>(want),
                   fmt::format("data has {} features, expected {}", c.cols, want)});
  }
  if (c.ref) {
    out.push_back({"reference_cols", c.cols == c.ref->cols, static_cast<double>(c.cols),
                   static_cast<double>(c.ref->cols),
                   fmt::format("data has {} features, reference {} has {}", c.cols,
                               c.ref->path, c.ref->cols)});
  }
  if (c.cfg.require_labels) {
    out.push_back({"require_labels", c.labelled, c.labelled ? 1.0 : 0.0, 1.0,
                   c.labelled ? "the data has labels"
                              : "the data has no labels, but require_labels is set: give a "
                                "label column or unset require_labels"});
  }
}

void label_rule(const Context& c, std::vector<RuleResult>& out) {
  if (!c.cfg.num_classes) return;
  const std::int64_t k = *c.cfg.num_classes;
  const auto limit = static_cast<double>(k);
  if (!c.labelled) {
    out.push_back({"label_range", false, kNaN, limit,
                   fmt::format("labels must lie in [0, {}), but the data has no labels", k)});
    return;
  }
  // MIN-reduce of (min label, -max label); SUM of offending rows.
  std::int64_t range[2] = {kNone, kNone};
  std::int64_t bad = 0, first_bad = -1, first_label = 0;
  const std::size_t rows = static_cast<std::size_t>(c.local.rows());
  for (std::size_t r = 0; r < rows; ++r) {
    const std::int64_t y = c.local.labels[r];
    range[0] = std::min(range[0], y);
    range[1] = std::min(range[1], -y);
    if (y < 0 || y >= k) {
      if (bad++ == 0) first_bad = static_cast<std::int64_t>(r), first_label = y;
    }
  }
  c.comm.allreduce_inplace(std::span<std::int64_t>(range, 2), MPI_MIN);
  bad = c.comm.allreduce(bad, MPI_SUM);
  const Located at = locate_first(c.comm, c.offset, c.runs, first_bad, first_label);
  if (c.rows == 0) {
    out.push_back({"label_range", true, kNaN, limit, "no rows, hence no labels to check"});
  } else if (bad == 0) {
    out.push_back({"label_range", true, static_cast<double>(-range[1]), limit,
                   fmt::format("labels span [{}, {}] within [0, {})", range[0], -range[1], k)});
  } else {
    out.push_back({"label_range", false, static_cast<double>(at.payload), limit,
                   fmt::format("{} labels outside [0, {}) (observed range [{}, {}]); "
                               "first at global row {} with label {}",
                               rows_have(bad), k, range[0], -range[1], at.row, at.payload)});
  }
}

void nonfinite_rule(const Context& c, std::int64_t dropped, GateReport& report) {
  const auto rows = static_cast<std::size_t>(c.local.rows());
  const auto d = static_cast<std::size_t>(c.local.cols);
  std::int64_t remaining = 0, first_row = -1, first_feature = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* row = c.local.features.data() + r * d;
    const float* it = std::find_if(row, row + d, [](float v) { return !std::isfinite(v); });
    if (it == row + d) continue;
    if (remaining++ == 0) first_row = static_cast<std::int64_t>(r), first_feature = it - row;
  }
  remaining = c.comm.allreduce(remaining, MPI_SUM);
  const Located at = locate_first(c.comm, c.offset, c.runs, first_row, first_feature);
  report.dropped_rows = dropped;
  report.nonfinite_rows = dropped + remaining;
  const bool passed = c.cfg.drop_nonfinite ? remaining == 0 : report.nonfinite_rows == 0;
  std::string detail;
  if (at.row >= 0) {
    detail = fmt::format("{} NaN or Inf; first at global row {}, {}: {}", rows_have(remaining),
                         at.row,
                         feature_label(c.comm, c.local, static_cast<std::size_t>(at.payload)),
                         c.cfg.drop_nonfinite ? "drop them with handle_nonfinite before the gates"
                                              : "fix the input or set nonfinite to drop");
  } else if (dropped > 0) {
    detail = fmt::format("{} rows with NaN or Inf were dropped{}", dropped,
                         c.cfg.drop_nonfinite ? "" : ", but nonfinite is set to fail");
  } else {
    detail = "no NaN or Inf values";
  }
  report.rules.push_back({"nonfinite", passed, static_cast<double>(report.nonfinite_rows), 0.0,
                          std::move(detail)});
}

void count_rules(const Context& c, std::vector<RuleResult>& out) {
  const auto rows = static_cast<double>(c.rows);
  if (c.cfg.min_rows) {
    const std::int64_t m = *c.cfg.min_rows;
    out.push_back({"min_rows", c.rows >= m, rows, static_cast<double>(m),
                   fmt::format("{} rows {} minimum {}", c.rows, c.rows >= m ? ">=" : "<", m)});
  }
  if (c.cfg.max_rows) {
    const std::int64_t m = *c.cfg.max_rows;
    out.push_back({"max_rows", c.rows <= m, rows, static_cast<double>(m),
                   fmt::format("{} rows {} maximum {}", c.rows, c.rows <= m ? "<=" : ">", m)});
  }
  if (c.cfg.rows_within_pct) {
    const double pct_max = *c.cfg.rows_within_pct;
    const auto ref_rows = static_cast<double>(c.ref->rows);
    const double pct = c.ref->rows == 0
                           ? (c.rows == 0 ? 0.0 : std::numeric_limits<double>::infinity())
                           : std::abs(rows - ref_rows) / ref_rows * 100.0;
    const bool ok = pct <= pct_max;
    out.push_back({"rows_within_pct", ok, pct, pct_max,
                   fmt::format("{} rows differ from the {} rows of reference {} by {}% {} "
                               "threshold {}%",
                               c.rows, c.ref->rows, c.ref->path, num(pct), ok ? "<=" : ">",
                               num(pct_max))});
  }
}

// A drift rule that cannot be measured: it fails, with the reason in detail.
RuleResult unmeasured(const Context& c, const char* rule, double threshold) {
  const std::string why =
      c.cols != c.ref->cols
          ? fmt::format("not measured: data has {} features, reference {} has {}", c.cols,
                        c.ref->path, c.ref->cols)
          : std::string("not measured: the data has no rows");
  return {rule, false, kNaN, threshold, why};
}

void mean_shift_rule(const Context& c, std::vector<RuleResult>& out) {
  if (!c.cfg.max_mean_shift) return;
  const double limit = *c.cfg.max_mean_shift;
  if (c.cols != c.ref->cols || c.rows == 0) {
    out.push_back(unmeasured(c, "max_mean_shift", limit));
    return;
  }
  // stats and ref are identical on every rank, so this loop needs no communication.
  double worst = -1;
  std::size_t wf = 0;
  for (std::size_t f = 0; f < static_cast<std::size_t>(c.cols); ++f) {
    const double sd = c.ref->stddev[f];
    const double diff = std::abs(c.stats.mean[f] - c.ref->mean[f]);
    const double shift = sd > 0 ? diff / sd : diff;
    if (!(shift <= worst)) worst = shift, wf = f;  // a NaN shift is the worst of all
    if (std::isnan(worst)) break;
  }
  const bool ok = worst <= limit;
  const double sd = c.ref->stddev[wf];
  out.push_back({"max_mean_shift", ok, worst, limit,
                 fmt::format("{} mean {} vs reference {} ({}): shift {} {} threshold {}",
                             feature_label(c.comm, c.local, wf), num(c.stats.mean[wf]),
                             num(c.ref->mean[wf]),
                             sd > 0 ? "stddev " + num(sd) : std::string("constant, absolute"),
                             num(worst), ok ? "<=" : ">", num(limit))});
}

void psi_rule(const Context& c, std::vector<RuleResult>& out) {
  if (!c.cfg.max_psi) return;
  const double limit = *c.cfg.max_psi;
  if (c.cols != c.ref->cols || c.rows == 0) {
    out.push_back(unmeasured(c, "max_psi", limit));
    return;
  }
  const Histogram& rh = *c.ref_hist;
  const Histogram cur = compute_histogram(c.comm, c.local, rh.lo, rh.hi, rh.bins);
  double worst = -1;
  std::size_t wf = 0;
  for (std::size_t f = 0; f < rh.cols(); ++f) {
    const std::size_t at = f * static_cast<std::size_t>(rh.bins);
    const double psi = population_stability_index(&cur.counts[at], &rh.counts[at], rh.bins);
    if (!(psi <= worst)) worst = psi, wf = f;
  }
  const bool ok = worst <= limit;
  out.push_back({"max_psi", ok, worst, limit,
                 fmt::format("{} PSI {} {} threshold {} ({} bins over the reference range "
                             "[{}, {}])",
                             feature_label(c.comm, c.local, wf), num(worst), ok ? "<=" : ">",
                             num(limit), rh.bins, num(rh.lo[wf]), num(rh.hi[wf]))});
}

}  // namespace

double population_stability_index(const std::int64_t* current, const std::int64_t* reference,
                                  int bins, double eps) {
  double n_cur = 0, n_ref = 0;
  for (int b = 0; b < bins; ++b) {
    n_cur += static_cast<double>(current[b]);
    n_ref += static_cast<double>(reference[b]);
  }
  double psi = 0;
  for (int b = 0; b < bins; ++b) {
    // An empty histogram has no distribution: every proportion takes the floor.
    const double p = std::max(n_cur > 0 ? static_cast<double>(current[b]) / n_cur : 0.0, eps);
    const double q = std::max(n_ref > 0 ? static_cast<double>(reference[b]) / n_ref : 0.0, eps);
    psi += (p - q) * std::log(p / q);
  }
  return psi;
}

GateReport evaluate_gates(const mpi::Comm& comm, const Table& local, const GateConfig& cfg,
                          const FeatureStats& stats, const ReferenceStats* ref,
                          const Histogram* ref_hist, std::int64_t dropped_rows,
                          std::span<const RowRun> runs) {
  Context c{comm, local, cfg, stats, ref, ref_hist};
  c.cols = global_cols(comm, local);
  c.rows = comm.allreduce(local.rows(), MPI_SUM);
  c.offset = comm.exscan_sum(local.rows());
  c.runs = runs;
  // Labelled when every rank with rows has labels (and, with no rows at all, when any rank
  // says so): MIN-reduce of (labels where rows exist, -has_labels).
  const bool has = local.has_labels;
  LOCUS_ASSERT(!has || static_cast<std::int64_t>(local.labels.size()) == local.rows(),
               "Table has_labels but labels.size() != rows()");
  int flags[2] = {local.rows() > 0 ? int{has} : 1, -int{has}};
  comm.allreduce_inplace(std::span<int>(flags, 2), MPI_MIN);
  c.labelled = c.rows > 0 ? flags[0] == 1 : flags[1] == -1;
  mpi::agree_on(comm, [&] { validate(c); });

  GateReport report;
  report.rows = c.rows;
  report.cols = c.cols;
  report.reference = ref ? ref->path : std::string();
  schema_rules(c, report.rules);
  label_rule(c, report.rules);
  nonfinite_rule(c, dropped_rows, report);
  count_rules(c, report.rules);
  mean_shift_rule(c, report.rules);
  psi_rule(c, report.rules);
  return report;
}

void join_missing_rule(const GateConfig& cfg, std::int64_t missing, const std::string& first,
                       const std::string& input, const std::string& table,
                       const std::string& key, GateReport& report) {
  report.join_missing_rows = missing;
  std::string detail;
  if (missing == 0) {
    detail = fmt::format("every row's key (column '{}') is in join table '{}'", key, table);
  } else if (cfg.drop_join_missing) {
    detail = fmt::format("{} {} of '{}' with a key (column '{}') that join table '{}' lacks "
                         "were dropped (gates.join_missing = drop); first: {}", missing,
                         missing == 1 ? "row" : "rows", input, key, table, first);
  } else {
    detail = fmt::format("{} {} of '{}' {} a key (column '{}') that join table '{}' lacks; "
                         "first: {}; add the keys to '{}', or set gates.join_missing = drop to "
                         "leave those rows out", missing, missing == 1 ? "row" : "rows", input,
                         missing == 1 ? "has" : "have", key, table, first, table);
  }
  report.rules.push_back({"join_missing", missing == 0 || cfg.drop_join_missing,
                          static_cast<double>(missing), 0.0, std::move(detail)});
}

bool GateReport::passed() const {
  return std::all_of(rules.begin(), rules.end(), [](const RuleResult& r) { return r.passed; });
}

std::string GateReport::to_json(int indent) const { return dump_json(json(), indent); }

Json GateReport::json() const {
  Json failed = Json::array(), rule_list = Json::array();
  for (const RuleResult& r : rules) {
    if (!r.passed) failed.push_back(r.rule);
    rule_list.push_back(Json{{"rule", r.rule}, {"passed", r.passed}, {"value", r.value},
                             {"threshold", r.threshold}, {"detail", r.detail}});
  }
  Json j;
  j["passed"] = passed();
  j["rows"] = rows;
  j["cols"] = cols;
  j["nonfinite_rows"] = nonfinite_rows;
  j["dropped_rows"] = dropped_rows;
  if (join_missing_rows) j["join_missing_rows"] = *join_missing_rows;
  j["reference"] = reference.empty() ? Json(nullptr) : Json(reference);
  j["failed"] = std::move(failed);
  j["rules"] = std::move(rule_list);
  return j;
}

std::string GateReport::summary() const {
  std::string out;
  for (const RuleResult& r : rules)
    if (!r.passed) out += fmt::format("gate '{}' failed: {}\n", r.rule, r.detail);
  if (out.empty()) return fmt::format("all {} data-quality gates passed", rules.size());
  out.pop_back();  // no trailing newline
  return out;
}

void require_passed(const GateReport& report) {
  if (!report.passed()) throw_error(ErrorKind::gate, report.summary(), /*agreed=*/true);
}

}  // namespace locus::io
