// Gradient clipping by global norm, with the cross-rank sum behind a callback.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "locus/train/optim/clip.hpp"

namespace locus::train {
namespace {

TEST(Clip, NormFactorAndScaling) {
  std::vector<float> g{3.0f, 4.0f, 0.0f, 0.0f, 0.0f};
  EXPECT_DOUBLE_EQ(sum_of_squares(g), 25.0);
  EXPECT_DOUBLE_EQ(global_grad_norm(g), 5.0);
  EXPECT_FLOAT_EQ(clip_factor(5.0, 10.0), 1.0f);
  EXPECT_FLOAT_EQ(clip_factor(5.0, 1.0), static_cast<float>(1.0 / (5.0 + 1e-6)));
  const double norm = clip_grad_norm(g, 1.0);
  EXPECT_DOUBLE_EQ(norm, 5.0);
  EXPECT_NEAR(g[0], 0.6f, 1e-6);
  EXPECT_NEAR(g[1], 0.8f, 1e-6);
  std::vector<float> small{0.1f, 0.2f};
  clip_grad_norm(small, 1.0);
  EXPECT_EQ(small, (std::vector<float>{0.1f, 0.2f}));  // below the limit: untouched
}

TEST(Clip, UsesTheCrossRankSum) {
  // Four "ranks" each holding the same local gradient: the global norm doubles.
  std::vector<float> g{3.0f, 4.0f};
  double seen = 0.0;
  const SumAcrossRanks four_ranks = [&](double local) {
    seen = local;
    return 4.0 * local;
  };
  EXPECT_DOUBLE_EQ(clip_grad_norm(g, 5.0, four_ranks), 10.0);
  EXPECT_DOUBLE_EQ(seen, 25.0);
  EXPECT_NEAR(g[0], 1.5f, 1e-6);
}

TEST(Clip, SumOfSquaresOfLongVectors) {
  std::vector<float> g(1001);
  double want = 0.0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    g[i] = static_cast<float>(std::sin(static_cast<double>(i)));
    want += static_cast<double>(g[i]) * g[i];
  }
  EXPECT_NEAR(sum_of_squares(g), want, 1e-10);
}

}  // namespace
}  // namespace locus::train
