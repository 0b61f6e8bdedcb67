// Learning-rate schedules as pure functions of the step (resume needs no scheduler state).
#pragma once

#include <cstdint>
#include <string_view>

namespace locus::train {

enum class ScheduleKind { constant, step, cosine };
ScheduleKind parse_schedule_kind(std::string_view name);  // "constant" | "step" | "cosine"
std::string_view to_string(ScheduleKind kind) noexcept;

// With W = warmup_steps and s the 0-based index of the optimizer step about to be taken:
//   s <  W: base_lr * (s + 1) / W                       (linear warm-up, reaches base_lr at W-1)
//   s >= W, with t = s - W:
//     constant: base_lr
//     step:     base_lr * gamma^floor(t / step_size)
//     cosine:   min_lr + (base_lr - min_lr) * (1 + cos(pi * min(t, T) / T)) / 2,
//               T = total_steps - W (so lr reaches min_lr at s = total_steps and stays there)
struct ScheduleOptions {
  ScheduleKind kind = ScheduleKind::constant;
  double base_lr = 0.01;
  std::int64_t warmup_steps = 0;
  std::int64_t step_size = 1;     // step
  double gamma = 0.1;             // step
  std::int64_t total_steps = 0;   // cosine: > warmup_steps
  double min_lr = 0.0;            // cosine
};
void validate(const ScheduleOptions& options);  // throws ConfigError

double learning_rate(const ScheduleOptions& options, std::int64_t step);

}  // namespace locus::train
