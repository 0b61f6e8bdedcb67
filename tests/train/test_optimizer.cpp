// Optimizers against hand-computed values and against a plain double-precision transcription
// of the torch.optim algorithms; state naming, step counters and validation.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/train/optim/optimizer.hpp"

namespace locus::train {
namespace {

TEST(Sgd, HandComputedMomentumAndNesterov) {
  OptimizerOptions o;
  o.momentum = 0.9;
  auto sgd = make_optimizer(o, 1);
  std::vector<float> p{1.0f};
  const std::vector<float> g{0.5f};
  sgd->step(p, g, 0.1);  // buf = 0.5, p = 1 - 0.05
  EXPECT_FLOAT_EQ(p[0], 0.95f);
  sgd->step(p, g, 0.1);  // buf = 0.9 * 0.5 + 0.5 = 0.95, p = 0.95 - 0.095
  EXPECT_FLOAT_EQ(p[0], 0.855f);
  EXPECT_FLOAT_EQ(sgd->state()[0].data[0], 0.95f);
  EXPECT_EQ(sgd->state()[0].name, "momentum_buffer");
  EXPECT_EQ(sgd->steps(), 2);

  o.nesterov = true;
  auto nag = make_optimizer(o, 1);
  p = {1.0f};
  nag->step(p, g, 0.1);  // buf = 0.5, d = 0.5 + 0.9 * 0.5 = 0.95
  EXPECT_FLOAT_EQ(p[0], 0.905f);
}

TEST(Sgd, DampeningSkipsTheFirstStepAsPyTorch) {
  OptimizerOptions o;
  o.momentum = 0.5;
  o.dampening = 0.5;
  auto sgd = make_optimizer(o, 1);
  std::vector<float> p{0.0f};
  const std::vector<float> g{1.0f};
  sgd->step(p, g, 1.0);  // buf = clone(g) = 1 (no dampening on the first step)
  EXPECT_FLOAT_EQ(p[0], -1.0f);
  sgd->step(p, g, 1.0);  // buf = 0.5 * 1 + 0.5 * 1 = 1
  EXPECT_FLOAT_EQ(p[0], -2.0f);
}

// A line-by-line double transcription of torch.optim.SGD / Adam / AdamW for one element.
struct RefState {
  double p, buf = 0.0, m = 0.0, v = 0.0;
  int t = 0;
};

void ref_step(const OptimizerOptions& o, RefState& s, double g, double lr) {
  ++s.t;
  if (o.kind == OptimizerKind::sgd) {
    double d = g + o.weight_decay * s.p;
    if (o.momentum != 0.0) {
      s.buf = s.t == 1 ? d : s.buf * o.momentum + (1.0 - o.dampening) * d;
      d = o.nesterov ? d + o.momentum * s.buf : s.buf;
    }
    s.p -= lr * d;
    return;
  }
  if (o.kind == OptimizerKind::adamw) s.p *= 1.0 - lr * o.weight_decay;
  if (o.kind == OptimizerKind::adam) g += o.weight_decay * s.p;
  s.m = o.beta1 * s.m + (1.0 - o.beta1) * g;
  s.v = o.beta2 * s.v + (1.0 - o.beta2) * g * g;
  const double bc1 = 1.0 - std::pow(o.beta1, s.t);
  const double bc2 = 1.0 - std::pow(o.beta2, s.t);
  s.p -= lr / bc1 * s.m / (std::sqrt(s.v) / std::sqrt(bc2) + o.eps);
}

void expect_matches_reference(const OptimizerOptions& o, float grad_scale) {
  const std::size_t n = 37;  // not a multiple of any vector width
  auto opt = make_optimizer(o, n);
  std::vector<float> p(n), g(n);
  std::vector<RefState> ref(n);
  for (std::size_t i = 0; i < n; ++i) {
    p[i] = 0.1f * static_cast<float>(i) - 1.7f;
    ref[i].p = p[i];
  }
  for (int step = 0; step < 6; ++step) {
    const double lr = 0.05 / (1 + step);
    for (std::size_t i = 0; i < n; ++i) {
      g[i] = std::sin(0.37f * static_cast<float>(i * (step + 2))) * (i % 5 == 0 ? 1e-3f : 1.0f);
      ref_step(o, ref[i], static_cast<double>(g[i] * grad_scale), lr);
    }
    opt->step(p, g, lr, grad_scale);
  }
  EXPECT_EQ(opt->steps(), 6);
  for (std::size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(p[i], ref[i].p, 2e-6 * std::max(1.0, std::abs(ref[i].p)))
        << to_string(o.kind) << " element " << i;
  }
}

TEST(Optimizers, MatchDoubleTranscriptionOfPyTorch) {
  OptimizerOptions o;
  expect_matches_reference(o, 1.0f);  // plain SGD
  o.weight_decay = 0.01;
  o.momentum = 0.9;
  expect_matches_reference(o, 0.5f);
  o.dampening = 0.1;
  expect_matches_reference(o, 1.0f);
  o.dampening = 0.0;
  o.nesterov = true;
  expect_matches_reference(o, 0.25f);
  for (OptimizerKind k : {OptimizerKind::adam, OptimizerKind::adamw}) {
    OptimizerOptions a;
    a.kind = k;
    expect_matches_reference(a, 1.0f);
    a.weight_decay = 0.05;
    a.beta1 = 0.8;
    a.beta2 = 0.99;
    expect_matches_reference(a, 0.5f);
  }
}

TEST(Adam, FirstStepMovesByLearningRateAndStateIsNamed) {
  OptimizerOptions o;
  o.kind = OptimizerKind::adamw;
  o.weight_decay = 0.1;
  auto adam = make_optimizer(o, 2);
  std::vector<float> p{1.0f, -1.0f};
  const std::vector<float> g{0.3f, -2.0f};
  adam->step(p, g, 0.01);
  // Decoupled decay p * (1 - 0.001), then m_hat / sqrt(v_hat) = sign(g) (eps negligible).
  EXPECT_NEAR(p[0], 0.999 - 0.01, 1e-6);
  EXPECT_NEAR(p[1], -0.999 + 0.01, 1e-6);
  const auto state = adam->state();
  ASSERT_EQ(state.size(), 2u);
  EXPECT_EQ(state[0].name, "exp_avg");
  EXPECT_EQ(state[1].name, "exp_avg_sq");
  EXPECT_FLOAT_EQ(state[0].data[0], 0.1f * 0.3f);
  EXPECT_FLOAT_EQ(state[1].data[1], 0.001f * 4.0f);
  const Optimizer& cref = *adam;
  EXPECT_EQ(cref.state()[1].data.size(), 2u);
}

TEST(Optimizers, ResumeFromStateContinuesIdentically) {
  OptimizerOptions o;
  o.kind = OptimizerKind::adamw;
  o.weight_decay = 0.01;
  auto a = make_optimizer(o, 5);
  std::vector<float> p(5, 0.5f), g{0.1f, -0.2f, 0.3f, 0.0f, 1.0f};
  for (int i = 0; i < 3; ++i) a->step(p, g, 0.01);
  auto b = make_optimizer(o, 5);
  auto sa = a->state();
  auto sb = b->state();
  for (std::size_t k = 0; k < sa.size(); ++k) std::ranges::copy(sa[k].data, sb[k].data.begin());
  b->set_steps(a->steps());
  std::vector<float> pb = p;
  a->step(p, g, 0.01);
  b->step(pb, g, 0.01);
  EXPECT_EQ(p, pb);
  EXPECT_THROW(b->set_steps(-1), DataError);
}

TEST(Optimizers, ValidationAndNames) {
  OptimizerOptions o;
  o.nesterov = true;  // without momentum
  EXPECT_THROW(make_optimizer(o, 1), ConfigError);
  o.momentum = 0.9;
  o.dampening = 0.1;
  EXPECT_THROW(make_optimizer(o, 1), ConfigError);
  OptimizerOptions a;
  a.kind = OptimizerKind::adam;
  a.beta2 = 1.0;
  EXPECT_THROW(make_optimizer(a, 1), ConfigError);
  a.beta2 = 0.999;
  a.weight_decay = -1.0;
  EXPECT_THROW(make_optimizer(a, 1), ConfigError);
  EXPECT_EQ(parse_optimizer_kind("adamw"), OptimizerKind::adamw);
  EXPECT_THROW(parse_optimizer_kind("lamb"), ConfigError);
  OptimizerOptions plain;
  EXPECT_TRUE(make_optimizer(plain, 3)->state().empty());
}

}  // namespace
}  // namespace locus::train
