// The straggler detector: per-step part times summarised per interval, gathered once per
// interval, judged on rank 0 against the median of the other ranks of the same stage.
#include "locus/train/monitor/straggler.hpp"

#include "locus/train/metrics.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "locus/comm/error.hpp"

namespace locus::train {

void validate(const StragglerOptions& o) {
  if (!(o.pct >= 0) || !std::isfinite(o.pct)) {
    throw ConfigError(fmt::format("train.straggler_pct = {} is invalid: use 0 (off) or a "
                                  "percentage, e.g. 25", o.pct));
  }
  if (!(o.k >= 0) || !std::isfinite(o.k)) {
    throw ConfigError(fmt::format("train.straggler_k = {} is invalid: use 0 or more standard "
                                  "deviations, e.g. 3", o.k));
  }
  if (o.intervals < 1) {
    throw ConfigError(fmt::format("train.straggler_intervals = {} is invalid: use 1 or more "
                                  "log intervals", o.intervals));
  }
}

const char* part_name(StepPart p) noexcept {
  switch (p) {
    case StepPart::compute: return "compute";
    case StepPart::data_wait: return "data_wait";
    case StepPart::reduce_wait: return "reduce_wait";
    case StepPart::pipeline_wait: return "pipeline_wait";
  }
  return "?";
}

void StepTimes::add(const std::array<double, kStepParts>& parts, double step_s) {
  for (std::size_t i = 0; i < parts.size(); ++i) sums_[i] += parts[i];
  compute_.push_back(parts[0]);
  max_ = std::max(max_, step_s);
}

namespace {

// The q-quantile of sorted values (nearest rank).
double quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const auto i = static_cast<std::size_t>(std::ceil(q * static_cast<double>(sorted.size()))) ;
  return sorted[std::min(sorted.size() - 1, i == 0 ? 0 : i - 1)];
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double stddev(const std::vector<double>& v) {
  if (v.size() < 2) return 0;
  double mean = 0;
  for (double x : v) mean += x;
  mean /= static_cast<double>(v.size());
  double sq = 0;
  for (double x : v) sq += (x - mean) * (x - mean);
  return std::sqrt(sq / static_cast<double>(v.size()));
}

// Below this excess per step a rank is not judged: steps of tens of microseconds (a tiny model)
// differ by more than any percentage through scheduling noise alone.
constexpr double kMinExcessSeconds = 1e-3;

constexpr std::size_t kSummaryDoubles = 2 + kStepParts + 4;

std::array<double, kSummaryDoubles> pack(const RankSummary& s) {
  std::array<double, kSummaryDoubles> a{};
  a[0] = s.steps;
  for (std::size_t i = 0; i < s.mean.size(); ++i) a[1 + i] = s.mean[i];
  a[1 + kStepParts] = s.compute_sd;
  a[2 + kStepParts] = s.compute_p50;
  a[3 + kStepParts] = s.compute_p90;
  a[4 + kStepParts] = s.step_max;
  return a;
}

RankSummary unpack(const double* a) {
  RankSummary s;
  s.steps = a[0];
  for (int i = 0; i < kStepParts; ++i) s.mean[static_cast<std::size_t>(i)] = a[1 + i];
  s.compute_sd = a[1 + kStepParts];
  s.compute_p50 = a[2 + kStepParts];
  s.compute_p90 = a[3 + kStepParts];
  s.step_max = a[4 + kStepParts];
  return s;
}

}  // namespace

RankSummary StepTimes::take() {
  RankSummary s;
  const auto n = static_cast<double>(compute_.size());
  s.steps = n;
  if (n > 0) {
    for (std::size_t i = 0; i < s.mean.size(); ++i) s.mean[i] = sums_[i] / n;
    s.compute_sd = stddev(compute_);
    std::sort(compute_.begin(), compute_.end());
    s.compute_p50 = quantile(compute_, 0.5);
    s.compute_p90 = quantile(compute_, 0.9);
    s.step_max = max_;
  }
  sums_ = {};
  compute_.clear();
  max_ = 0;
  return s;
}

std::vector<RankPlace> gather_places(const mpi::Comm& comm) {
  constexpr std::size_t kField = 128;
  std::array<char, 2 * kField> mine{};
  char host[kField] = {};
  ::gethostname(host, kField - 1);
  const char* node = std::getenv("SLURMD_NODENAME");
  const std::string h(host, strnlen(host, kField - 1));
  const std::string n = node != nullptr ? std::string(node).substr(0, kField - 1) : "";
  std::memcpy(mine.data(), h.data(), h.size());
  std::memcpy(mine.data() + kField, n.data(), n.size());
  std::vector<char> all(2 * kField * static_cast<std::size_t>(comm.size()));
  LOCUS_MPI_CHECK(MPI_Allgather(mine.data(), 2 * kField, MPI_CHAR, all.data(), 2 * kField,
                                MPI_CHAR, comm.get()));
  std::vector<RankPlace> out;
  for (int r = 0; r < comm.size(); ++r) {
    const char* at = all.data() + 2 * kField * static_cast<std::size_t>(r);
    out.push_back(RankPlace{std::string(at, strnlen(at, kField - 1)),
                            std::string(at + kField, strnlen(at + kField, kField - 1))});
  }
  return out;
}

std::vector<RankSummary> gather_summaries(const mpi::Comm& comm, const RankSummary& mine) {
  const auto packed = pack(mine);
  std::vector<double> all(comm.is_root() ? kSummaryDoubles * static_cast<std::size_t>(comm.size())
                                         : 0);
  LOCUS_MPI_CHECK(MPI_Gather(packed.data(), static_cast<int>(kSummaryDoubles), MPI_DOUBLE,
                             all.data(), static_cast<int>(kSummaryDoubles), MPI_DOUBLE, 0,
                             comm.get()));
  std::vector<RankSummary> out;
  if (!comm.is_root()) return out;
  for (std::size_t at = 0; at < all.size(); at += kSummaryDoubles) {
    out.push_back(unpack(all.data() + at));
  }
  return out;
}

RanksRecord ranks_record(std::int64_t step, const std::vector<RankSummary>& all) {
  RanksRecord r;
  r.step = step;
  r.time = unix_seconds();
  for (const RankSummary& s : all) {
    r.compute_s.push_back(s.mean[0]);
    r.data_wait_s.push_back(s.mean[1]);
    r.reduce_wait_s.push_back(s.mean[2]);
    r.pipeline_wait_s.push_back(s.mean[3]);
    r.step_max_s.push_back(s.step_max);
    r.compute_sd_s.push_back(s.compute_sd);
    r.compute_p50_s.push_back(s.compute_p50);
    r.compute_p90_s.push_back(s.compute_p90);
  }
  return r;
}

StragglerDetector::StragglerDetector(const StragglerOptions& o, std::vector<RankPlace> places,
                                     int stages)
    : opts_(o),
      places_(std::move(places)),
      stages_(std::max(stages, 1)),
      slow_run_(places_.size(), 0),
      fine_run_(places_.size(), 0) {}

std::vector<MonitorEvent> StragglerDetector::judge(std::int64_t step,
                                                   const std::vector<RankSummary>& all) {
  std::vector<MonitorEvent> events;
  const int n = static_cast<int>(all.size());
  for (int r = 0; r < n && r < static_cast<int>(places_.size()); ++r) {
    // The parts a rank causes itself: compute, by its median step (a few steps of a rank
    // descheduled on a shared node move the mean, not the median), and the mean data wait. The
    // waits in reductions and for other stages are what its peers suffer from a straggler.
    auto value = [&](int q, int p) {
      const RankSummary& s = all[static_cast<std::size_t>(q)];
      return p == 0 ? s.compute_p50 : s.mean[static_cast<std::size_t>(p)];
    };
    std::array<std::vector<double>, 2> others;
    for (int q = 0; q < n; ++q) {
      const bool peer = q != r && q % stages_ == r % stages_;
      if (!peer || all[static_cast<std::size_t>(q)].steps == 0) continue;
      for (int p : {0, 1}) others[static_cast<std::size_t>(p)].push_back(value(q, p));
    }
    const RankSummary& me = all[static_cast<std::size_t>(r)];
    if (others[0].empty() || me.steps == 0) continue;  // nobody to compare with
    const double basis = median(others[0]);
    int slow_part = -1;
    double part_median = 0;
    for (int p : {0, 1}) {
      const auto& o = others[static_cast<std::size_t>(p)];
      const double med = median(o);
      const double excess = value(r, p) - med;
      if (excess > opts_.pct / 100.0 * basis && excess > opts_.k * stddev(o) &&
          excess > kMinExcessSeconds) {
        slow_part = p;
        part_median = med;
        break;
      }
    }
    auto& slow = slow_run_[static_cast<std::size_t>(r)];
    auto& fine = fine_run_[static_cast<std::size_t>(r)];
    if (slow_part >= 0) {
      ++slow;
      fine = 0;
    } else {
      slow = 0;
      ++fine;
    }
    const bool reported = current_.count(r) != 0;
    const RankPlace& place = places_[static_cast<std::size_t>(r)];
    const std::string where =
        place.node.empty() ? fmt::format("rank {} on {}", r, place.host)
                           : fmt::format("rank {} on {} (node {})", r, place.host, place.node);
    if (!reported && slow >= opts_.intervals) {
      MonitorEvent e;
      e.event = "straggler";
      e.step = step;
      e.time = unix_seconds();
      const double mine = value(r, slow_part);
      const double ratio = part_median > 0 ? mine / part_median : 0.0;
      e.values["rank"] = r;
      e.values["host"] = place.host;
      if (!place.node.empty()) e.values["node"] = place.node;
      e.values["part"] = part_name(static_cast<StepPart>(slow_part));
      e.values["seconds"] = mine;
      e.values["others_median_s"] = part_median;
      if (part_median > 0) e.values["ratio"] = ratio;
      e.values["intervals"] = slow;
      e.message = fmt::format(
          "straggler: {} is slow in {}: {:.4g} s per step against {:.4g} s on the other ranks{}, "
          "for {} log intervals (to step {})",
          where, part_name(static_cast<StepPart>(slow_part)), mine, part_median,
          part_median > 0 ? fmt::format(" ({:.2f}x)", ratio) : std::string(), slow, step);
      current_[r] = e;
      events.push_back(std::move(e));
    } else if (reported && fine >= opts_.intervals) {
      MonitorEvent e;
      e.event = "straggler_recovered";
      e.step = step;
      e.time = unix_seconds();
      e.values["rank"] = r;
      e.values["host"] = place.host;
      if (!place.node.empty()) e.values["node"] = place.node;
      e.values["part"] = current_[r].values["part"];
      e.values["compute_s"] = value(r, 0);
      e.values["others_median_s"] = basis;
      e.values["intervals"] = fine;
      e.message = fmt::format("straggler recovered: {} has kept up for {} log intervals (to "
                              "step {})", where, fine, step);
      current_.erase(r);
      events.push_back(std::move(e));
    }
  }
  return events;
}

std::string StragglerDetector::file_text(std::int64_t step) const {
  std::string text = fmt::format(
      "# locus stragglers at step {}: rank host node part ratio (node - outside Slurm)\n", step);
  for (const auto& [r, e] : current_) {
    const RankPlace& p = places_[static_cast<std::size_t>(r)];
    const double ratio = e.values.contains("ratio") ? e.values["ratio"].get<double>() : 0.0;
    text += fmt::format("{} {} {} {} {:.3f}\n", r, p.host, p.node.empty() ? "-" : p.node,
                        e.values["part"].get<std::string>(), ratio);
  }
  return text;
}

void write_stragglers_file(const std::string& path, const std::string& text) {
  const std::filesystem::path final_path(path);
  const std::filesystem::path tmp(path + ".tmp");
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << text;
    out.flush();
    if (!out) {
      std::fprintf(stderr, "warning: cannot write %s; the straggler verdict is not recorded for "
                           "a requeue\n", tmp.c_str());
      return;
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, final_path, ec);
  if (ec) {
    std::fprintf(stderr, "warning: cannot rename %s to %s (%s); the straggler verdict is not "
                         "recorded for a requeue\n", tmp.c_str(), final_path.c_str(),
                 ec.message().c_str());
  }
}

}  // namespace locus::train
