// Finite-difference checks of backward(): the fp32 analytic gradients against central
// differences of a double-precision reference, for every activation, both losses, with and
// without dropout (the mask is fixed by its key), and for a model without hidden layers.
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "locus/train/model/backward.hpp"
#include "reference.hpp"

namespace locus::train {
namespace {

using testing::make_batch;
using testing::ref_loss;

struct Case {
  Activation activation;
  Loss loss;
  float dropout;
  std::vector<int> widths;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(to_string(c.activation)) + "_" + std::string(to_string(c.loss)) +
         (c.dropout > 0.0f ? "_dropout" : "") + "_L" + std::to_string(c.widths.size() - 1);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << to_string(c.activation) << "/" << to_string(c.loss) << "/dropout " << c.dropout;
}

class GradCheck : public ::testing::TestWithParam<Case> {};

TEST_P(GradCheck, AnalyticMatchesCentralDifferences) {
  const Case& c = GetParam();
  ModelSpec spec{c.widths, c.activation, Init::xavier, c.dropout, 17};
  Mlp model(spec);
  // Non-zero biases so the bias path is exercised away from the init.
  for (int l = 0; l < model.num_layers(); ++l) {
    auto b = model.layout().bias(model.params(), l);
    for (std::size_t j = 0; j < b.size(); ++j) b[j] = 0.1f * static_cast<float>(j % 3) - 0.1f;
  }
  const int rows = 6;
  const std::uint64_t step = 5;
  const auto batch = make_batch(spec.widths, rows, 3);
  Workspace ws(model, rows);
  std::vector<float> grads(model.layout().size(), -1.0f);
  const Batch in{batch.x, rows, batch.labels, batch.targets, batch.ids};
  const LossStats stats = forward_backward(model, ws, c.loss, in, step, rows, grads);

  std::vector<double> p(model.params().begin(), model.params().end());
  const double loss0 = ref_loss(spec, p, c.loss, batch, step, true);
  EXPECT_NEAR(stats.loss_sum / rows, loss0, 1e-5 * std::max(1.0, std::abs(loss0)));

  const double h = 1e-6;
  int checked = 0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double saved = p[i];
    p[i] = saved + h;
    const double up = ref_loss(spec, p, c.loss, batch, step, true);
    p[i] = saved - h;
    const double down = ref_loss(spec, p, c.loss, batch, step, true);
    p[i] = saved;
    const double fd = (up - down) / (2.0 * h);
    ASSERT_NEAR(grads[i], fd, 2e-4 + 2e-3 * std::abs(fd)) << "parameter " << i;
    ++checked;
  }
  EXPECT_EQ(checked, static_cast<int>(model.layout().size()));
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (Activation a : {Activation::relu, Activation::gelu, Activation::tanh}) {
    for (Loss l : {Loss::softmax_cross_entropy, Loss::mse}) {
      for (float d : {0.0f, 0.3f}) cases.push_back({a, l, d, {7, 6, 5, 4}});
    }
  }
  cases.push_back({Activation::relu, Loss::softmax_cross_entropy, 0.0f, {5, 3}});
  cases.push_back({Activation::tanh, Loss::mse, 0.5f, {5, 9, 2}});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(AllLayers, GradCheck, ::testing::ValuesIn(all_cases()), case_name);

// The dropout mask really is applied (and fixed by its key): with dropout the loss differs
// from the no-dropout loss, and repeating the same key reproduces it bit for bit.
TEST(GradCheckDropout, MaskIsKeyedAndApplied) {
  ModelSpec spec{{7, 16, 4}, Activation::relu, Init::he, 0.5f, 9};
  Mlp model(spec);
  const auto batch = make_batch(spec.widths, 8, 4);
  Workspace ws(model, 8);
  const auto a = forward_train(model, batch.x, 8, ws, {1, batch.ids});
  const std::vector<float> first(a.begin(), a.end());
  const auto b = forward_train(model, batch.x, 8, ws, {1, batch.ids});
  EXPECT_EQ(first, std::vector<float>(b.begin(), b.end()));
  const auto c = forward_train(model, batch.x, 8, ws, {2, batch.ids});
  EXPECT_NE(first, std::vector<float>(c.begin(), c.end()));
  Workspace infer(model, 8, Mode::inference);
  const auto d = forward(model, batch.x, 8, infer);
  EXPECT_NE(first, std::vector<float>(d.begin(), d.end()));
}

}  // namespace
}  // namespace locus::train
