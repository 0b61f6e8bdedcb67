// The scorer against a double-precision reference (softmax, argmax, top-k, metrics), and the
// property locus-infer's determinism rests on: a row's bytes do not depend on which block,
// unit or run it is scored in, as long as the batch grid is the same.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "locus/comm/error.hpp"
#include "locus/infer/scorer.hpp"

using namespace locus;

namespace {

struct Fixture {
  train::Mlp model;
  std::vector<float> x;
  std::vector<std::int32_t> y;
  int rows;
};

Fixture make(int rows, std::vector<int> widths, std::uint64_t seed = 1) {
  train::Mlp m(train::ModelSpec{.widths = widths, .seed = seed});
  std::mt19937 gen(static_cast<unsigned>(seed));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (float& p : m.params()) p += 0.05f * nd(gen);  // non-zero biases too
  std::vector<float> x(static_cast<std::size_t>(rows) * widths.front());
  for (float& v : x) v = nd(gen);
  std::vector<std::int32_t> y(static_cast<std::size_t>(rows));
  for (auto& l : y) l = static_cast<std::int32_t>(gen() % static_cast<unsigned>(widths.back()));
  return {std::move(m), std::move(x), std::move(y), rows};
}

// Logits in double, straight from the definition.
std::vector<double> logits64(const train::Mlp& m, const std::vector<float>& x, int rows) {
  const auto& L = m.layout();
  std::vector<double> h(x.begin(), x.end());
  int in = L.input_width();
  for (int l = 0; l < L.num_layers(); ++l) {
    const auto w = L.weight(m.params(), l);
    const auto b = L.bias(m.params(), l);
    const int out = L.layer(l).out;
    std::vector<double> z(static_cast<std::size_t>(rows) * out);
    for (int r = 0; r < rows; ++r)
      for (int o = 0; o < out; ++o) {
        double s = b[static_cast<std::size_t>(o)];
        for (int i = 0; i < in; ++i)
          s += h[static_cast<std::size_t>(r) * in + i] * w[static_cast<std::size_t>(o) * in + i];
        z[static_cast<std::size_t>(r) * out + o] = l + 1 < L.num_layers() ? std::max(s, 0.0) : s;
      }
    h = std::move(z);
    in = out;
  }
  return h;
}

bool same_bytes(const std::vector<float>& a, std::size_t ao, const std::vector<float>& b,
                std::size_t bo, std::size_t n) {
  return std::memcmp(a.data() + ao, b.data() + bo, n * sizeof(float)) == 0;
}

}  // namespace

TEST(Scorer, MatchesDoublePrecisionReference) {
  const int rows = 300, c = 7, k = 3;
  Fixture f = make(rows, {20, 16, c});
  infer::Scorer scorer(f.model, {.kind = infer::OutputKind::probabilities, .top_k = k,
                                 .batch_rows = 64});
  infer::Scores s;
  ASSERT_TRUE(scorer.score(0, 0, f.x, f.y, s));
  const std::vector<double> z = logits64(f.model, f.x, rows);
  infer::Metrics ref;
  ref.reset(c);
  for (int r = 0; r < rows; ++r) {
    const double* zr = z.data() + static_cast<std::size_t>(r) * c;
    const double m = *std::max_element(zr, zr + c);
    double sum = 0;
    for (int j = 0; j < c; ++j) sum += std::exp(zr[j] - m);
    for (int j = 0; j < c; ++j)
      EXPECT_NEAR(s.values[static_cast<std::size_t>(r) * c + j], std::exp(zr[j] - m) / sum, 1e-6);
    std::vector<int> order(c);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [zr](int a, int b) { return zr[a] > zr[b]; });
    EXPECT_EQ(s.predicted[static_cast<std::size_t>(r)], order[0]) << "row " << r;
    for (int i = 0; i < k; ++i) {
      EXPECT_EQ(s.topk_index[static_cast<std::size_t>(r) * k + i], order[static_cast<std::size_t>(i)]);
      EXPECT_EQ(s.topk_value[static_cast<std::size_t>(r) * k + i],
                s.values[static_cast<std::size_t>(r) * c + order[static_cast<std::size_t>(i)]]);
    }
    const int label = f.y[static_cast<std::size_t>(r)];
    ref.rows += 1;
    ref.correct += label == order[0];
    ref.confusion[static_cast<std::size_t>(label) * c + order[0]] += 1;
    ref.log_loss_sum += m + std::log(sum) - zr[label];
  }
  EXPECT_EQ(s.metrics.rows, ref.rows);
  EXPECT_EQ(s.metrics.correct, ref.correct);
  EXPECT_EQ(s.metrics.confusion, ref.confusion);
  EXPECT_NEAR(s.metrics.log_loss_sum, ref.log_loss_sum, 1e-4 * rows);
}

TEST(Scorer, RowBytesDoNotDependOnBlocksOrPadding) {
  const int rows = 203, u = 40, b = 16;
  Fixture f = make(rows, {12, 9, 5}, 4);
  const std::size_t d = 12, c = 5;
  auto score_units = [&](std::vector<int> cuts) {
    // Blocks [cuts[i], cuts[i + 1]) inside units of u rows, grid origin at the unit start.
    infer::Scorer scorer(f.model, {.kind = infer::OutputKind::probabilities, .top_k = 2,
                                   .batch_rows = b});
    std::vector<float> out(static_cast<std::size_t>(rows) * c, -1.0f);
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      const int lo = cuts[i], hi = cuts[i + 1];
      infer::Scores s;
      std::span<const float> x(f.x.data() + static_cast<std::size_t>(lo) * d,
                               static_cast<std::size_t>(hi - lo) * d);
      EXPECT_TRUE(scorer.score(static_cast<std::uint64_t>(lo / u * u), static_cast<std::uint64_t>(lo), x, {}, s));
      std::copy(s.values.begin(), s.values.end(), out.begin() + static_cast<std::ptrdiff_t>(lo * c));
    }
    return out;
  };
  const auto full = score_units({0, 40, 80, 120, 160, 200, 203});
  // An "incremental" run from row 57 and from row 161, and blocks cut inside units.
  const auto inc = score_units({0, 40, 57, 80, 120, 160, 161, 200, 203});
  const auto odd = score_units({0, 3, 40, 41, 42, 80, 99, 120, 160, 200, 201, 203});
  EXPECT_TRUE(same_bytes(full, 0, inc, 0, full.size()));
  EXPECT_TRUE(same_bytes(full, 0, odd, 0, full.size()));
}

TEST(Scorer, RawOutputsAreTheForwardLogits) {
  const int rows = 64;
  Fixture f = make(rows, {8, 6, 2}, 5);
  infer::Scorer scorer(f.model, {.kind = infer::OutputKind::raw, .top_k = 0, .batch_rows = 32});
  infer::Scores s;
  ASSERT_TRUE(scorer.score(0, 0, f.x, f.y, s));
  train::Workspace ws(f.model, rows, train::Mode::inference);
  const auto z = train::forward(f.model, f.x, rows, ws);
  ASSERT_EQ(s.values.size(), z.size());
  for (std::size_t i = 0; i < z.size(); ++i) EXPECT_NEAR(s.values[i], z[i], 1e-6f);
  EXPECT_TRUE(s.predicted.empty());
  EXPECT_EQ(s.metrics.rows, 0) << "raw outputs have no classification metrics";
}

TEST(Scorer, StopAbandonsTheBlockAndBadLabelsAreCounted) {
  const int rows = 100;
  Fixture f = make(rows, {8, 6, 4}, 6);
  f.y[3] = 4;
  f.y[50] = -1;
  infer::Scorer scorer(f.model, {.kind = infer::OutputKind::probabilities, .batch_rows = 10});
  infer::Scores s;
  int calls = 0;
  EXPECT_FALSE(scorer.score(0, 0, f.x, f.y, s, [&] { return ++calls == 2; }));
  EXPECT_EQ(calls, 2);
  ASSERT_TRUE(scorer.score(0, 0, f.x, f.y, s));
  EXPECT_EQ(s.metrics.out_of_range, 2);
  EXPECT_EQ(s.metrics.rows, rows - 2);
}

TEST(Scorer, BadSpecsAreConfigErrors) {
  Fixture f = make(4, {8, 6, 4}, 7);
  Fixture one = make(4, {8, 1}, 7);
  using K = infer::OutputKind;
  auto build = [](const train::Mlp& m, infer::ScoreSpec spec) { infer::Scorer sc(m, spec); };
  const infer::ScoreSpec too_many{.kind = K::probabilities, .top_k = 5};
  const infer::ScoreSpec raw_topk{.kind = K::raw, .top_k = 1};
  const infer::ScoreSpec no_batch{.kind = K::probabilities, .batch_rows = 0};
  const infer::ScoreSpec probs{.kind = K::probabilities};
  const infer::ScoreSpec raw{.kind = K::raw};
  EXPECT_THROW(build(f.model, too_many), ConfigError);
  EXPECT_THROW(build(f.model, raw_topk), ConfigError);
  EXPECT_THROW(build(f.model, no_batch), ConfigError);
  EXPECT_THROW(build(one.model, probs), ConfigError);
  EXPECT_NO_THROW(build(one.model, raw));
  EXPECT_THROW(infer::parse_output_kind("logits"), ConfigError);
}

TEST(Scorer, ForwardInPiecesThenFinishEqualsScore) {
  // A unit of 203 rows on a grid of 16-row batches starting 5 rows before it (an incremental
  // run's first unit), cut into pieces on the grid and off it: the logits, and what finish()
  // makes of them, are the bytes score() gives for the whole block.
  const int rows = 203, b = 16;
  const std::size_t d = 12, c = 5;
  Fixture f = make(rows, {12, 9, 5}, 8);
  infer::Scorer whole(f.model, {.kind = infer::OutputKind::probabilities, .top_k = 2,
                                .batch_rows = b});
  infer::Scores ref;
  ASSERT_TRUE(whole.score(100, 105, f.x, f.y, ref));
  for (const std::vector<int>& cuts : {std::vector<int>{0, 11, 43, 203}, {0, 1, 2, 3, 203},
                                       {0, 100, 101, 202, 203}}) {
    infer::Scorer pieces(f.model, whole.spec());
    std::vector<float> logits(static_cast<std::size_t>(rows) * c, -1.0f);
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      const auto lo = static_cast<std::size_t>(cuts[i]), hi = static_cast<std::size_t>(cuts[i + 1]);
      const auto x = std::span<const float>(f.x).subspan(lo * d, (hi - lo) * d);
      ASSERT_TRUE(pieces.forward(100, 105 + lo, x,
                                 std::span<float>(logits).subspan(lo * c, (hi - lo) * c)));
    }
    infer::Scores s;
    pieces.finish(logits, f.y, s);
    EXPECT_TRUE(same_bytes(s.values, 0, ref.values, 0, ref.values.size()));
    EXPECT_EQ(s.predicted, ref.predicted);
    EXPECT_EQ(s.topk_index, ref.topk_index);
    EXPECT_EQ(s.metrics.confusion, ref.metrics.confusion);
    EXPECT_EQ(s.metrics.log_loss_sum, ref.metrics.log_loss_sum);
  }
}
