// The backward contract other modules rely on: the on_grads_ready order and slice finality,
// the grad_divisor convention (sum over batch shards == full-batch gradient), overwrite
// semantics and empty batches.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "locus/train/model/backward.hpp"
#include "reference.hpp"

namespace locus::train {
namespace {

TEST(Backward, AnnouncesEachLayerOnceLastToFirstWithFinalSlices) {
  ModelSpec spec{{8, 12, 10, 6, 3}, Activation::gelu, Init::he, 0.2f, 4};
  Mlp model(spec);
  const auto b = testing::make_batch(spec.widths, 9, 7);
  Workspace ws(model, 16);
  std::vector<float> grads(model.layout().size(), 0.0f);
  std::vector<int> order;
  std::vector<std::vector<float>> snapshots(4);
  const GradsReadyFn ready = [&](int l) {
    order.push_back(l);
    const LayerLayout& ly = model.layout().layer(l);
    snapshots[static_cast<std::size_t>(l)].assign(grads.begin() + static_cast<std::ptrdiff_t>(ly.begin()),
                                                  grads.begin() + static_cast<std::ptrdiff_t>(ly.end()));
  };
  forward_backward(model, ws, Loss::softmax_cross_entropy, {b.x, 9, b.labels, {}, b.ids}, 1,
                   9, grads, ready);
  EXPECT_EQ(order, (std::vector<int>{3, 2, 1, 0}));
  for (int l = 0; l < 4; ++l) {
    const LayerLayout& ly = model.layout().layer(l);
    EXPECT_TRUE(std::equal(grads.begin() + static_cast<std::ptrdiff_t>(ly.begin()),
                           grads.begin() + static_cast<std::ptrdiff_t>(ly.end()),
                           snapshots[static_cast<std::size_t>(l)].begin()))
        << "layer " << l << " changed after on_grads_ready";
  }
}

// Two shards with grad_divisor = global rows sum to the full-batch mean gradient (what an
// all-reduce SUM over ranks computes), dropout included.
TEST(Backward, ShardGradientsSumToGlobalMean) {
  ModelSpec spec{{6, 16, 8, 4}, Activation::relu, Init::he, 0.25f, 11};
  Mlp model(spec);
  const int rows = 10;
  const auto b = testing::make_batch(spec.widths, rows, 8);
  Workspace ws(model, rows);
  std::vector<float> full(model.layout().size());
  forward_backward(model, ws, Loss::softmax_cross_entropy, {b.x, rows, b.labels, {}, b.ids}, 2,
                   rows, full);
  std::vector<float> sum(model.layout().size(), 0.0f);
  std::vector<float> part(model.layout().size(), 7.0f);  // garbage: must be overwritten
  for (const auto& [first, n] : {std::pair{0, 3}, std::pair{3, 7}}) {
    const Batch shard{std::span<const float>(b.x).subspan(static_cast<std::size_t>(first) * 6,
                                                          static_cast<std::size_t>(n) * 6),
                      n,
                      std::span<const std::int32_t>(b.labels).subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(n)),
                      {},
                      std::span<const std::uint64_t>(b.ids).subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(n))};
    forward_backward(model, ws, Loss::softmax_cross_entropy, shard, 2, rows, part);
    for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
  }
  double max_abs = 0.0;
  for (float v : full) max_abs = std::max(max_abs, std::abs(static_cast<double>(v)));
  ASSERT_GT(max_abs, 1e-3);
  for (std::size_t i = 0; i < sum.size(); ++i) EXPECT_NEAR(sum[i], full[i], 1e-6) << i;
}

TEST(Backward, EmptyBatchGivesZeroGradients) {
  ModelSpec spec{{4, 5, 2}, Activation::tanh, Init::he, 0.0f, 1};
  Mlp model(spec);
  Workspace ws(model, 4);
  std::vector<float> grads(model.layout().size(), 3.0f);
  int calls = 0;
  forward_backward(model, ws, Loss::mse, {{}, 0, {}, {}, {}}, 0, 8, grads,
                   [&](int) { ++calls; });
  EXPECT_EQ(calls, 2);
  for (float g : grads) EXPECT_EQ(g, 0.0f);
}

}  // namespace
}  // namespace locus::train
