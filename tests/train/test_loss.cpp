// Losses against direct double-precision formulas: values, gradients, the grad_divisor
// convention, numerical stability at extreme logits and label validation.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/train/model/loss.hpp"

namespace locus::train {
namespace {

TEST(SoftmaxCrossEntropy, ValueGradientAndAccuracy) {
  const std::vector<float> z{1.0f, 2.0f, 0.5f, -1.0f, 3.0f, 0.0f};  // 2 rows x 3 classes
  const std::vector<std::int32_t> labels{1, 0};
  std::vector<float> g(6);
  const LossStats s = softmax_cross_entropy(z, 2, 3, labels, g, 4.0);
  double expect = 0.0;
  for (int r = 0; r < 2; ++r) {
    double sum = 0.0;
    for (int j = 0; j < 3; ++j) sum += std::exp(static_cast<double>(z[r * 3 + j]));
    expect += std::log(sum) - z[static_cast<std::size_t>(r * 3 + labels[static_cast<std::size_t>(r)])];
    for (int j = 0; j < 3; ++j) {
      const double softmax = std::exp(static_cast<double>(z[r * 3 + j])) / sum;
      const double want = (softmax - (j == labels[static_cast<std::size_t>(r)] ? 1.0 : 0.0)) / 4.0;
      EXPECT_NEAR(g[static_cast<std::size_t>(r * 3 + j)], want, 1e-7);
    }
  }
  EXPECT_NEAR(s.loss_sum, expect, 1e-6);
  EXPECT_EQ(s.correct, 1);  // row 0 argmax 1 == label; row 1 argmax 1 != 0
  EXPECT_EQ(s.rows, 2);
}

TEST(SoftmaxCrossEntropy, StableAtExtremeLogits) {
  const std::vector<float> z{1e4f, -1e4f, 0.0f, 8e3f};
  const std::vector<std::int32_t> labels{1};
  std::vector<float> g(4);
  const LossStats s = softmax_cross_entropy(z, 1, 4, labels, g, 1.0);
  EXPECT_NEAR(s.loss_sum, 2e4, 1e-2);
  for (float v : g) EXPECT_TRUE(std::isfinite(v));
  EXPECT_NEAR(g[0], 1.0f, 1e-6);
  EXPECT_NEAR(g[1], -1.0f, 1e-6);
}

TEST(SoftmaxCrossEntropy, EvaluationOnlyAndBadLabels) {
  const std::vector<float> z{0.0f, 0.0f};
  const LossStats s = softmax_cross_entropy(z, 1, 2, std::vector<std::int32_t>{0}, {}, 1.0);
  EXPECT_NEAR(s.loss_sum, std::log(2.0), 1e-7);
  EXPECT_THROW(softmax_cross_entropy(z, 1, 2, std::vector<std::int32_t>{2}, {}, 1.0), DataError);
  EXPECT_THROW(softmax_cross_entropy(z, 1, 2, std::vector<std::int32_t>{-1}, {}, 1.0),
               DataError);
}

TEST(MeanSquaredError, MatchesTorchMeanReduction) {
  const std::vector<float> y{1.0f, 2.0f, 3.0f, 4.0f};  // 2 rows x 2 outputs
  const std::vector<float> t{0.0f, 2.0f, 1.0f, 1.0f};
  std::vector<float> g(4);
  const LossStats s = mean_squared_error(y, 2, 2, t, g, 2.0);
  // Per-sample loss = mean over outputs: row 0 (1 + 0) / 2, row 1 (4 + 9) / 2.
  EXPECT_NEAR(s.loss_sum, 0.5 + 6.5, 1e-12);
  // torch.nn.MSELoss()(y, t) = 14 / 4 = loss_sum / rows; its gradient 2 (y - t) / 4.
  const std::vector<float> want{0.5f, 0.0f, 1.0f, 1.5f};
  for (std::size_t i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(g[i], want[i]);
}

TEST(LossNames, ParseAndPrint) {
  EXPECT_EQ(parse_loss("cross_entropy"), Loss::softmax_cross_entropy);
  EXPECT_EQ(parse_loss("mse"), Loss::mse);
  EXPECT_EQ(to_string(Loss::mse), "mse");
  EXPECT_THROW(parse_loss("hinge"), ConfigError);
}

}  // namespace
}  // namespace locus::train
