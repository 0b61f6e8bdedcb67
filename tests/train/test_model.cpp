// Model spec parsing, the flat parameter layout (PyTorch state_dict order), seeded
// initialisation and the forward pass against the double reference.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/train/model/forward.hpp"
#include "reference.hpp"

namespace locus::train {
namespace {

TEST(ModelSpec, ParsesWidthsAndNames) {
  EXPECT_EQ(parse_widths("784,256,128,10"), (std::vector<int>{784, 256, 128, 10}));
  EXPECT_EQ(parse_widths(" 4 , 2 "), (std::vector<int>{4, 2}));
  for (const char* bad : {"", "784", "784,,10", "784,0,10", "a,10", "784,10,", "1.5,2"}) {
    EXPECT_THROW(parse_widths(bad), ConfigError) << bad;
  }
  EXPECT_EQ(parse_activation("gelu"), Activation::gelu);
  EXPECT_EQ(parse_init("xavier"), Init::xavier);
  EXPECT_THROW(parse_activation("sigmoid"), ConfigError);
  EXPECT_THROW(parse_init("zeros"), ConfigError);
  EXPECT_EQ(to_string(parse_activation("tanh")), "tanh");
  EXPECT_EQ(format_widths(std::vector<int>{3, 2, 1}), "3,2,1");
  EXPECT_THROW(Mlp(ModelSpec{{4}, Activation::relu, Init::he, 0.0f, 0}), ConfigError);
  EXPECT_THROW(Mlp(ModelSpec{{4, 2}, Activation::relu, Init::he, 1.0f, 0}), ConfigError);
  EXPECT_THROW(Mlp(ModelSpec{{4, -2}, Activation::relu, Init::he, 0.0f, 0}), ConfigError);
}

TEST(ParamLayout, FollowsStateDictOrder) {
  const std::vector<int> widths{784, 256, 128, 10};
  const ParamLayout layout(widths);
  ASSERT_EQ(layout.num_layers(), 3);
  std::size_t expect = 0;
  for (int l = 0; l < 3; ++l) {
    const LayerLayout& ly = layout.layer(l);
    EXPECT_EQ(ly.in, widths[static_cast<std::size_t>(l)]);
    EXPECT_EQ(ly.out, widths[static_cast<std::size_t>(l) + 1]);
    EXPECT_EQ(ly.weight_offset, expect);
    expect += static_cast<std::size_t>(ly.in) * ly.out;
    EXPECT_EQ(ly.bias_offset, expect);
    expect += static_cast<std::size_t>(ly.out);
    EXPECT_EQ(ly.end(), expect);
  }
  EXPECT_EQ(layout.size(), expect);
  EXPECT_EQ(layout.size(), 784u * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);
  const auto tensors = layout.tensors();
  ASSERT_EQ(tensors.size(), 6u);
  EXPECT_EQ(tensors[0].name, "layers.0.weight");
  EXPECT_EQ(tensors[0].shape, (std::vector<std::size_t>{256, 784}));
  EXPECT_EQ(tensors[1].name, "layers.0.bias");
  EXPECT_EQ(tensors[1].shape, (std::vector<std::size_t>{256}));
  EXPECT_EQ(tensors[5].name, "layers.2.bias");
  std::size_t sum = 0;
  for (const auto& t : tensors) {
    EXPECT_EQ(t.offset, sum);  // contiguous, no gaps
    sum += t.size();
  }
  EXPECT_EQ(sum, layout.size());
}

TEST(Init, HeAndXavierHaveTheirStatisticsAndAreSeeded) {
  Mlp he(ModelSpec{{1000, 400, 3}, Activation::relu, Init::he, 0.0f, 1});
  const auto w = he.layout().weight(std::span<const float>(he.params()), 0);
  const double mean = std::accumulate(w.begin(), w.end(), 0.0) / static_cast<double>(w.size());
  double var = 0.0;
  for (float v : w) var += (v - mean) * (v - mean);
  var /= static_cast<double>(w.size());
  EXPECT_NEAR(mean, 0.0, 1e-3);
  EXPECT_NEAR(std::sqrt(var), std::sqrt(2.0 / 1000.0), 0.01 * std::sqrt(2.0 / 1000.0));
  for (float b : he.layout().bias(std::span<const float>(he.params()), 0)) EXPECT_EQ(b, 0.0f);

  Mlp xa(ModelSpec{{300, 100, 3}, Activation::tanh, Init::xavier, 0.0f, 1});
  const double a = std::sqrt(6.0 / 400.0);
  double max_abs = 0.0;
  for (float v : xa.layout().weight(std::span<const float>(xa.params()), 0)) {
    max_abs = std::max(max_abs, std::abs(static_cast<double>(v)));
  }
  EXPECT_LE(max_abs, a);
  EXPECT_GT(max_abs, 0.99 * a);

  Mlp same(ModelSpec{{1000, 400, 3}, Activation::relu, Init::he, 0.0f, 1});
  Mlp other(ModelSpec{{1000, 400, 3}, Activation::relu, Init::he, 0.0f, 2});
  EXPECT_TRUE(std::ranges::equal(he.params(), same.params()));
  EXPECT_FALSE(std::ranges::equal(he.params(), other.params()));
}

TEST(Forward, MatchesDoubleReferenceForEveryActivation) {
  for (Activation act : {Activation::relu, Activation::gelu, Activation::tanh}) {
    ModelSpec spec{{9, 8, 7, 4}, act, Init::he, 0.0f, 5};
    Mlp model(spec);
    const auto b = testing::make_batch(spec.widths, 5, 1);
    Workspace ws(model, 8, Mode::inference);
    const auto logits = forward(model, b.x, 5, ws);
    ASSERT_EQ(logits.size(), 5u * 4);
    // Reference logits via the loss-free path: MSE against zero targets of one row at a time
    // would hide signs, so recompute the logits directly from the reference activations.
    std::vector<double> p(model.params().begin(), model.params().end());
    for (int r = 0; r < 5; ++r) {
      std::vector<double> h(b.x.begin() + r * 9, b.x.begin() + (r + 1) * 9);
      for (int l = 0; l < 3; ++l) {
        const LayerLayout& ly = model.layout().layer(l);
        std::vector<double> z(static_cast<std::size_t>(ly.out));
        for (int o = 0; o < ly.out; ++o) {
          double acc = p[ly.bias_offset + static_cast<std::size_t>(o)];
          for (int i = 0; i < ly.in; ++i) {
            acc += p[ly.weight_offset + static_cast<std::size_t>(o * ly.in + i)] *
                   h[static_cast<std::size_t>(i)];
          }
          z[static_cast<std::size_t>(o)] = l < 2 ? testing::ref_activation(act, acc) : acc;
        }
        h = z;
      }
      for (int j = 0; j < 4; ++j) {
        EXPECT_NEAR(logits[static_cast<std::size_t>(r * 4 + j)], h[static_cast<std::size_t>(j)],
                    1e-5 * std::max(1.0, std::abs(h[static_cast<std::size_t>(j)])))
            << to_string(act) << " row " << r << " col " << j;
      }
    }
  }
}

TEST(Forward, TrainingWithoutDropoutEqualsInference) {
  ModelSpec spec{{6, 10, 3}, Activation::gelu, Init::he, 0.0f, 2};
  Mlp model(spec);
  const auto b = testing::make_batch(spec.widths, 7, 2);
  Workspace train_ws(model, 7);
  Workspace infer_ws(model, 7, Mode::inference);
  const auto t = forward_train(model, b.x, 7, train_ws);
  const auto i = forward(model, b.x, 7, infer_ws);
  EXPECT_TRUE(std::ranges::equal(t, i));
  EXPECT_EQ(train_ws.layer_output(0).size(), 7u * 10);
}

// Splitting a batch (as ranks do) keeps every dropout mask: each row's mask depends on its
// global sample id, not on its position in the local batch. (sgemm may round a row
// differently with another row count, so values are compared to rounding, masks exactly.)
TEST(Forward, DropoutMasksIndependentOfBatchSplit) {
  ModelSpec spec{{5, 32, 16, 3}, Activation::tanh, Init::he, 0.4f, 8};
  Mlp model(spec);
  const int rows = 12;
  const auto b = testing::make_batch(spec.widths, rows, 6);
  Workspace full(model, rows);
  forward_train(model, b.x, rows, full, {3, b.ids});
  Workspace part(model, rows);
  int dropped = 0;
  for (int first = 0; first < rows; first += 5) {
    const int n = std::min(5, rows - first);
    const auto x = std::span<const float>(b.x).subspan(static_cast<std::size_t>(first) * 5,
                                                       static_cast<std::size_t>(n) * 5);
    const auto ids = std::span<const std::uint64_t>(b.ids).subspan(
        static_cast<std::size_t>(first), static_cast<std::size_t>(n));
    forward_train(model, x, n, part, {3, ids});
    for (int l = 0; l < 3; ++l) {
      const int w = spec.widths[static_cast<std::size_t>(l) + 1];
      const auto got = part.layer_output(l);
      const auto want = full.layer_output(l);
      for (int r = 0; r < n; ++r) {
        for (int j = 0; j < w; ++j) {
          const float g = got[static_cast<std::size_t>(r * w + j)];
          const float e = want[static_cast<std::size_t>((first + r) * w + j)];
          EXPECT_NEAR(g, e, 1e-5f * std::max(1.0f, std::abs(e)));
          if (l < 2 && !dropout_keep(spec.seed, 3, l, ids[static_cast<std::size_t>(r)], j, 0.4f)) {
            EXPECT_EQ(g, 0.0f);  // tanh is never exactly 0 here: zeros are the mask
            EXPECT_EQ(e, 0.0f);
            ++dropped;
          }
        }
      }
    }
  }
  // About p of the hidden units are dropped (deterministic, so no flakiness).
  EXPECT_GT(dropped, static_cast<int>(0.4 * rows * 48 * 0.8));
  EXPECT_LT(dropped, static_cast<int>(0.4 * rows * 48 * 1.2));
}

TEST(Dropout, KeepRateMatchesProbability) {
  for (float p : {0.1f, 0.5f, 0.9f}) {
    int kept = 0;
    const int n = 200000;
    for (int i = 0; i < n; ++i) kept += dropout_keep(1, 2, i % 3, static_cast<std::uint64_t>(i / 97), i % 97, p) ? 1 : 0;
    EXPECT_NEAR(static_cast<double>(kept) / n, 1.0 - p, 0.01) << p;
  }
  EXPECT_TRUE(dropout_keep(1, 2, 0, 5, 7, 0.0f));
}

}  // namespace
}  // namespace locus::train
