// The anomaly detector: the agreed step figures (one int64 all-reduce, exact whatever the
// order), the z-score window and the verdict.
#include "locus/train/monitor/anomaly.hpp"

#include <fmt/format.h>

#include <array>
#include <bit>
#include <cmath>
#include <limits>

#include "locus/comm/error.hpp"
#include "locus/train/metrics.hpp"

namespace locus::train {

AnomalyAction parse_anomaly_action(std::string_view name) {
  if (name == "warn") return AnomalyAction::warn;
  if (name == "skip") return AnomalyAction::skip;
  if (name == "stop") return AnomalyAction::stop;
  throw ConfigError(fmt::format("train.anomaly = {} is not one of warn, skip, stop", name));
}

std::string_view to_string(AnomalyAction a) noexcept {
  switch (a) {
    case AnomalyAction::warn: return "warn";
    case AnomalyAction::skip: return "skip";
    case AnomalyAction::stop: return "stop";
  }
  return "?";
}

void validate(const AnomalyOptions& o) {
  if (!(o.z > 0) || !std::isfinite(o.z)) {
    throw ConfigError(fmt::format("train.anomaly_z = {} is invalid: use a positive z-score "
                                  "(e.g. 8; smaller flags more steps)", o.z));
  }
  if (o.window < 2 || o.window > 100000) {
    throw ConfigError(fmt::format("train.anomaly_window = {} is invalid: use 2 to 100000 steps "
                                  "of history", o.window));
  }
}

ValueWindow::ValueWindow(int capacity) : values_(static_cast<std::size_t>(capacity), 0.0) {}

void ValueWindow::push(double v) {
  values_[next_] = v;
  next_ = (next_ + 1) % values_.size();
  if (size_ < values_.size()) ++size_;
}

double ValueWindow::z(double x) const {
  if (!full()) return std::numeric_limits<double>::quiet_NaN();
  // Oldest to newest, in one fixed order: the same window gives the same bits.
  const std::vector<double> v = values();
  double sum = 0;
  for (double a : v) sum += a;
  const double mean = sum / static_cast<double>(v.size());
  double sq = 0;
  for (double a : v) sq += (a - mean) * (a - mean);
  const double sd = std::sqrt(sq / static_cast<double>(v.size()));
  if (!(sd > 0)) return std::numeric_limits<double>::quiet_NaN();
  return (x - mean) / sd;
}

std::vector<double> ValueWindow::values() const {
  std::vector<double> out;
  out.reserve(size_);
  const std::size_t start = (next_ + values_.size() - size_) % values_.size();
  for (std::size_t i = 0; i < size_; ++i) out.push_back(values_[(start + i) % values_.size()]);
  return out;
}

void ValueWindow::assign(std::span<const double> v) {
  next_ = size_ = 0;
  const std::size_t skip = v.size() > values_.size() ? v.size() - values_.size() : 0;
  for (std::size_t i = skip; i < v.size(); ++i) push(v[i]);
}

namespace {

// Layout of the agreed record: the loss sum's limbs (ExactSum), rows, non-finite counts, then
// one slot per pipeline stage for its sum of squares (a double's bits: only the stage's
// data-parallel rank 0 writes it, so the integer sum is that pattern exactly).
constexpr std::size_t kLimbs = ExactSum::kLimbs;
constexpr std::size_t kRows = kLimbs, kBadLoss = kLimbs + 1, kBadGrads = kLimbs + 2;
constexpr std::size_t kStages = kLimbs + 3;

// An exact sum of limbs from several ranks, carried back into range.
ExactSum carried(std::array<std::int64_t, kLimbs> limbs) {
  for (std::size_t i = 0; i + 1 < kLimbs; ++i) {
    const std::int64_t carry = limbs[i] >> 32;  // floor division
    limbs[i] -= carry * (std::int64_t{1} << 32);
    limbs[i + 1] += carry;
  }
  return ExactSum::from_parts(limbs, 0.0);
}

}  // namespace

StepValues agree_step_values(const Grid& grid, const LossStats& local, double grad_squares,
                             const std::string& inject) {
  double loss_sum = local.loss_sum;
  if (inject == "loss-spike") loss_sum *= 1e3;
  if (inject == "loss-nan") loss_sum = std::numeric_limits<double>::quiet_NaN();
  if (inject == "grad-spike") grad_squares *= 1e6;
  std::vector<std::int64_t> rec(kStages + static_cast<std::size_t>(grid.pipeline_stages()), 0);
  // Every stage of a replica holds the replica's loss: stage 0 counts it once.
  if (grid.stage() == 0) {
    // ExactSum keeps values below 2^150 exactly; anything else (non-finite, or a loss so large
    // the run has diverged) is counted as non-finite.
    if (std::isfinite(loss_sum) && std::abs(loss_sum) < 0x1p150) {
      ExactSum e;
      e.add(loss_sum);
      for (std::size_t i = 0; i < kLimbs; ++i) rec[i] = e.limbs()[i];
    } else {
      rec[kBadLoss] = 1;
    }
    rec[kRows] = local.rows;
  }
  if (!std::isfinite(grad_squares)) rec[kBadGrads] = 1;
  // The reduced gradient is the same on every data-parallel rank: one of them reports it.
  if (grid.dp_rank() == 0 && std::isfinite(grad_squares)) {
    const auto slot = kStages + static_cast<std::size_t>(grid.stage());
    rec[slot] = std::bit_cast<std::int64_t>(grad_squares);
  }
  grid.world().allreduce_inplace(std::span<std::int64_t>(rec), MPI_SUM);
  StepValues v;
  std::array<std::int64_t, kLimbs> limbs{};
  for (std::size_t i = 0; i < kLimbs; ++i) limbs[i] = rec[i];
  v.rows = rec[kRows];
  v.loss_finite = rec[kBadLoss] == 0;
  v.grads_finite = rec[kBadGrads] == 0;
  v.loss = v.loss_finite ? (v.rows > 0 ? carried(limbs).value() / static_cast<double>(v.rows) : 0.0)
                         : std::numeric_limits<double>::quiet_NaN();
  double squares = 0;  // stage order: the same bits on every rank
  for (int s = 0; s < grid.pipeline_stages(); ++s) {
    squares += std::bit_cast<double>(rec[kStages + static_cast<std::size_t>(s)]);
  }
  v.grad_norm = v.grads_finite ? std::sqrt(squares) : std::numeric_limits<double>::quiet_NaN();
  return v;
}

AnomalyDetector::AnomalyDetector(const AnomalyOptions& o)
    : opts_(o), loss_(o.window), grad_(o.window) {}

StepVerdict AnomalyDetector::judge(std::int64_t step, const StepValues& v, MonitorEvent& e) {
  StepVerdict r;
  e = MonitorEvent{};
  e.step = step;
  if (!v.loss_finite || !v.grads_finite) {
    r.nonfinite = true;
    r.action = opts_.action == AnomalyAction::skip ? StepAction::skip : StepAction::stop;
  } else {
    r.loss_z = loss_.z(v.loss);
    r.grad_z = grad_.z(v.grad_norm);
    r.anomalous = r.loss_z > opts_.z || r.grad_z > opts_.z;  // false while NaN
    if (r.anomalous) {
      ++anomalies_;
      r.action = opts_.action == AnomalyAction::warn   ? StepAction::apply
                 : opts_.action == AnomalyAction::skip ? StepAction::skip
                                                       : StepAction::stop;
    }
  }
  const bool give_up = r.action == StepAction::skip &&
                       consecutive_skips_ + 1 > static_cast<std::int64_t>(opts_.window);
  if (give_up) r.action = StepAction::stop;
  if (r.action == StepAction::apply) {
    loss_.push(v.loss);
    grad_.push(v.grad_norm);
    consecutive_skips_ = 0;
  } else if (r.action == StepAction::skip) {
    ++skipped_;
    ++consecutive_skips_;
  }
  if (!r.nonfinite && !r.anomalous) return r;

  const char* action = r.action == StepAction::apply ? "warn"
                       : r.action == StepAction::skip ? "skip"
                                                      : "stop";
  e.event = r.nonfinite ? "nonfinite" : r.action == StepAction::skip ? "anomaly_skip" : "anomaly";
  e.time = unix_seconds();
  io::Json& j = e.values;
  j["action"] = action;
  j["loss"] = v.loss;
  j["grad_norm"] = v.grad_norm;
  if (!r.nonfinite) {
    j["loss_z"] = r.loss_z;
    j["grad_norm_z"] = r.grad_z;
    j["threshold"] = opts_.z;
  }
  j["anomalies"] = anomalies_;
  j["skipped"] = skipped_;
  std::string what;
  if (r.nonfinite) {
    what = fmt::format("non-finite {} at step {} (loss {}, gradient norm {})",
                       !v.loss_finite && !v.grads_finite ? "loss and gradients"
                       : !v.loss_finite                  ? "loss"
                                                         : "gradients",
                       step, v.loss, v.grad_norm);
  } else {
    what = fmt::format("anomaly at step {}: loss {:.6g} (z = {:.2f}), gradient norm {:.6g} "
                       "(z = {:.2f}), over train.anomaly_z = {:g} against the last {} steps",
                       step, v.loss, r.loss_z, v.grad_norm, r.grad_z, opts_.z, opts_.window);
  }
  if (give_up) {
    e.message = fmt::format("{}: {} updates dropped in a row, more than train.anomaly_window = "
                            "{}: stopping (the run does not recover by itself)",
                            what, consecutive_skips_ + 1, opts_.window);
  } else if (r.action == StepAction::apply) {
    e.message = fmt::format("warning: {}; the update was applied (train.anomaly = warn)", what);
  } else if (r.action == StepAction::skip) {
    e.message = fmt::format("warning: {}; the update was dropped (train.anomaly = skip)", what);
  } else {
    e.message = fmt::format("{}; stopping{}", what,
                            r.nonfinite ? " (non-finite values always stop unless train.anomaly "
                                          "= skip)"
                                        : " (train.anomaly = stop)");
  }
  return r;
}

AnomalyState AnomalyDetector::state() const {
  return AnomalyState{loss_.values(), grad_.values(), anomalies_, skipped_, consecutive_skips_};
}

void AnomalyDetector::restore(const AnomalyState& s) {
  LOCUS_ASSERT(s.loss.size() == s.grad_norm.size(),
               "an anomaly detector state's windows differ in length");
  loss_.assign(s.loss);
  grad_.assign(s.grad_norm);
  anomalies_ = s.anomalies;
  skipped_ = s.skipped;
  consecutive_skips_ = s.consecutive_skips;
}

bool params_finite(const Grid& grid, std::span<const float> params) {
  int ok = 1;
  for (float p : params) {
    if (!std::isfinite(p)) {
      ok = 0;
      break;
    }
  }
  grid.world().allreduce_inplace(std::span<int>(&ok, 1), MPI_MIN);
  return ok == 1;
}

}  // namespace locus::train
