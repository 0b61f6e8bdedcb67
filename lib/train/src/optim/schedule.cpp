// Learning-rate schedules: closed forms of the step, so resuming needs no scheduler state.
#include "locus/train/optim/schedule.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>

#include "locus/comm/error.hpp"

namespace locus::train {

ScheduleKind parse_schedule_kind(std::string_view name) {
  if (name == "constant") return ScheduleKind::constant;
  if (name == "step") return ScheduleKind::step;
  if (name == "cosine") return ScheduleKind::cosine;
  throw ConfigError(fmt::format("unknown learning-rate schedule '{}': use constant, step or "
                                "cosine",
                                name));
}

std::string_view to_string(ScheduleKind kind) noexcept {
  switch (kind) {
    case ScheduleKind::constant: return "constant";
    case ScheduleKind::step: return "step";
    case ScheduleKind::cosine: return "cosine";
  }
  return "?";
}

void validate(const ScheduleOptions& o) {
  if (!(std::isfinite(o.base_lr) && o.base_lr >= 0.0)) {
    throw ConfigError(fmt::format("learning rate {} is invalid: it must be >= 0", o.base_lr));
  }
  if (o.warmup_steps < 0) {
    throw ConfigError(fmt::format("warmup_steps {} is negative: use 0 to disable warm-up",
                                  o.warmup_steps));
  }
  if (o.kind == ScheduleKind::step && (o.step_size < 1 || !(o.gamma > 0.0))) {
    throw ConfigError(fmt::format("step schedule with step_size {} and gamma {}: step_size "
                                  "must be >= 1 and gamma > 0",
                                  o.step_size, o.gamma));
  }
  if (o.kind == ScheduleKind::cosine) {
    if (o.total_steps <= o.warmup_steps) {
      throw ConfigError(fmt::format("cosine schedule over total_steps {} with warmup_steps {}: "
                                    "total_steps must exceed warmup_steps",
                                    o.total_steps, o.warmup_steps));
    }
    if (!(o.min_lr >= 0.0 && o.min_lr <= o.base_lr)) {
      throw ConfigError(fmt::format("cosine schedule min_lr {} must be in [0, base lr {}]",
                                    o.min_lr, o.base_lr));
    }
  }
}

double learning_rate(const ScheduleOptions& o, std::int64_t step) {
  LOCUS_ASSERT(step >= 0, fmt::format("learning rate asked for step {}", step));
  if (step < o.warmup_steps) {
    return o.base_lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  }
  const std::int64_t t = step - o.warmup_steps;
  switch (o.kind) {
    case ScheduleKind::constant:
      return o.base_lr;
    case ScheduleKind::step:
      return o.base_lr * std::pow(o.gamma, static_cast<double>(t / o.step_size));
    case ScheduleKind::cosine: {
      const std::int64_t span = o.total_steps - o.warmup_steps;
      const double frac = static_cast<double>(std::min(t, span)) / static_cast<double>(span);
      return o.min_lr + (o.base_lr - o.min_lr) * (1.0 + std::cos(std::numbers::pi * frac)) / 2.0;
    }
  }
  return o.base_lr;
}

}  // namespace locus::train
