// Learning-rate schedules at their key steps, computed by hand from the documented formulas.
#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include "locus/comm/error.hpp"
#include "locus/train/optim/schedule.hpp"

namespace locus::train {
namespace {

TEST(Schedule, ConstantWithWarmup) {
  ScheduleOptions o;
  o.base_lr = 0.1;
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, 1000000), 0.1);
  o.warmup_steps = 4;
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.025);
  EXPECT_DOUBLE_EQ(learning_rate(o, 1), 0.05);
  EXPECT_DOUBLE_EQ(learning_rate(o, 3), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, 4), 0.1);
}

TEST(Schedule, StepDecaysEveryStepSizeAfterWarmup) {
  ScheduleOptions o;
  o.kind = ScheduleKind::step;
  o.base_lr = 1.0;
  o.step_size = 10;
  o.gamma = 0.5;
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 9), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 10), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(o, 25), 0.25);
  o.warmup_steps = 5;
  EXPECT_DOUBLE_EQ(learning_rate(o, 4), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 14), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 15), 0.5);
}

TEST(Schedule, CosineReachesMinAndStays) {
  ScheduleOptions o;
  o.kind = ScheduleKind::cosine;
  o.base_lr = 1.0;
  o.min_lr = 0.1;
  o.total_steps = 100;
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 1.0);
  EXPECT_NEAR(learning_rate(o, 50), 0.55, 1e-15);
  EXPECT_NEAR(learning_rate(o, 25), 0.1 + 0.9 * (1 + std::cos(std::numbers::pi / 4)) / 2, 1e-15);
  EXPECT_DOUBLE_EQ(learning_rate(o, 100), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, 500), 0.1);
  o.warmup_steps = 10;  // cosine over the remaining 90 steps
  EXPECT_DOUBLE_EQ(learning_rate(o, 0), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate(o, 9), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(o, 10), 1.0);
  EXPECT_NEAR(learning_rate(o, 55), 0.55, 1e-15);
  EXPECT_DOUBLE_EQ(learning_rate(o, 100), 0.1);
}

TEST(Schedule, ValidationAndNames) {
  ScheduleOptions o;
  o.kind = ScheduleKind::cosine;
  o.total_steps = 10;
  o.warmup_steps = 10;
  EXPECT_THROW(validate(o), ConfigError);
  o.total_steps = 20;
  EXPECT_NO_THROW(validate(o));
  o.min_lr = 1.0;  // above base_lr
  EXPECT_THROW(validate(o), ConfigError);
  ScheduleOptions s;
  s.kind = ScheduleKind::step;
  s.step_size = 0;
  EXPECT_THROW(validate(s), ConfigError);
  s.step_size = 1;
  s.base_lr = -1.0;
  EXPECT_THROW(validate(s), ConfigError);
  EXPECT_EQ(parse_schedule_kind("cosine"), ScheduleKind::cosine);
  EXPECT_THROW(parse_schedule_kind("linear"), ConfigError);
}

}  // namespace
}  // namespace locus::train
