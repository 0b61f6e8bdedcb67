// The scorer: fixed-grid, padded forward passes, then one pass per row for softmax, argmax,
// top-k and metrics.
#include "locus/infer/scorer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "locus/comm/error.hpp"

namespace locus::infer {

OutputKind parse_output_kind(std::string_view name) {
  if (name == "probabilities") return OutputKind::probabilities;
  if (name == "raw") return OutputKind::raw;
  throw ConfigError(fmt::format("unknown output kind '{}': use probabilities (softmax, "
                                "classifiers) or raw (regression outputs)", name));
}

std::string_view to_string(OutputKind k) noexcept {
  return k == OutputKind::raw ? "raw" : "probabilities";
}

void Metrics::reset(int classes) {
  rows = correct = out_of_range = 0;
  log_loss_sum = 0.0;
  confusion.assign(static_cast<std::size_t>(classes) * static_cast<std::size_t>(classes), 0);
}

void Metrics::merge(const Metrics& o) {
  rows += o.rows;
  correct += o.correct;
  out_of_range += o.out_of_range;
  log_loss_sum += o.log_loss_sum;
  if (confusion.size() < o.confusion.size()) confusion.resize(o.confusion.size(), 0);
  for (std::size_t i = 0; i < o.confusion.size(); ++i) confusion[i] += o.confusion[i];
}

const ScoreSpec& check_score_spec(const ScoreSpec& spec, int outputs) {
  if (spec.batch_rows < 1) {
    throw ConfigError(fmt::format("infer.batch_rows = {}: give a batch of at least 1 row",
                                  spec.batch_rows));
  }
  if (spec.kind == OutputKind::raw && spec.top_k > 0) {
    throw ConfigError(fmt::format("infer.top_k = {} needs class probabilities; with "
                                  "infer.outputs = raw set infer.top_k = 0", spec.top_k));
  }
  if (spec.kind == OutputKind::probabilities && outputs < 2) {
    throw ConfigError(fmt::format("the model has {} output; softmax probabilities need at least "
                                  "2 classes: set infer.outputs = raw", outputs));
  }
  if (spec.top_k < 0 || spec.top_k > outputs) {
    throw ConfigError(fmt::format("infer.top_k = {} is outside [0, {}] (the model's {} "
                                  "outputs)", spec.top_k, outputs, outputs));
  }
  return spec;
}

Scorer::Scorer(const train::Mlp& model, const ScoreSpec& spec)
    : model_(model),
      spec_(check_score_spec(spec, model.layout().output_width())),
      inputs_(model.layout().input_width()),
      outputs_(model.layout().output_width()),
      ws_(model, spec.batch_rows, train::Mode::inference),
      padded_(static_cast<std::size_t>(spec.batch_rows) * static_cast<std::size_t>(inputs_)) {}

bool Scorer::score(std::uint64_t grid_origin, std::uint64_t first_row, std::span<const float> x,
                   std::span<const std::int32_t> labels, Scores& out,
                   const std::function<bool()>& stop) {
  logits_.resize(x.size() / static_cast<std::size_t>(inputs_) * static_cast<std::size_t>(outputs_));
  if (!forward(grid_origin, first_row, x, logits_, stop)) return false;
  finish(logits_, labels, out);
  return true;
}

bool Scorer::forward(std::uint64_t grid_origin, std::uint64_t first_row, std::span<const float> x,
                     std::span<float> logits, const std::function<bool()>& stop) {
  const auto d = static_cast<std::size_t>(inputs_);
  const auto c = static_cast<std::size_t>(outputs_);
  LOCUS_ASSERT(x.size() % d == 0, fmt::format("{} floats is not a whole number of {}-wide rows",
                                              x.size(), d));
  const std::size_t n = x.size() / d;
  LOCUS_ASSERT(grid_origin <= first_row, "the batch grid must start at or before the block");
  LOCUS_ASSERT(logits.size() == n * c, fmt::format("{} logits for {} rows of {} outputs",
                                                   logits.size(), n, c));
  const auto b = static_cast<std::uint64_t>(spec_.batch_rows);
  std::size_t pos = 0;
  while (pos < n) {
    const std::uint64_t row = first_row + pos;
    const std::uint64_t batch_start = grid_origin + (row - grid_origin) / b * b;
    const auto offset = static_cast<std::size_t>(row - batch_start);
    const std::size_t take = std::min<std::size_t>(b - offset, n - pos);
    const float* in = x.data() + pos * d;
    if (offset != 0 || take != b) {
      std::fill(padded_.begin(), padded_.end(), 0.0f);
      std::copy_n(in, take * d, padded_.begin() + static_cast<std::ptrdiff_t>(offset * d));
      in = padded_.data();
    }
    const std::span<const float> z =
        train::forward(model_, std::span<const float>(in, b * d), spec_.batch_rows, ws_);
    std::copy_n(z.begin() + static_cast<std::ptrdiff_t>(offset * c), take * c,
                logits.begin() + static_cast<std::ptrdiff_t>(pos * c));
    pos += take;
    if (stop && stop()) return false;
  }
  return true;
}

void Scorer::finish(std::span<const float> logits, std::span<const std::int32_t> labels,
                    Scores& out) const {
  const auto c = static_cast<std::size_t>(outputs_);
  const auto k = static_cast<std::size_t>(spec_.top_k);
  LOCUS_ASSERT(logits.size() % c == 0, fmt::format("{} logits is not a whole number of {}-wide "
                                                   "rows", logits.size(), c));
  const std::size_t n = logits.size() / c;
  LOCUS_ASSERT(labels.empty() || labels.size() == n,
               fmt::format("{} labels for {} rows", labels.size(), n));
  const bool probs = spec_.kind == OutputKind::probabilities;
  out.values.resize(n * c);
  out.predicted.resize(probs ? n : 0);
  out.topk_index.resize(n * k);
  out.topk_value.resize(n * k);
  out.metrics.reset(labels.empty() ? 0 : outputs_);
  finish_rows(logits, 0, static_cast<int>(n), labels, out);
}

void Scorer::finish_rows(std::span<const float> logits, int row0, int rows,
                          std::span<const std::int32_t> labels, Scores& out) const {
  const int c = outputs_;
  const auto cs = static_cast<std::size_t>(c);
  const auto k = static_cast<std::size_t>(spec_.top_k);
  std::vector<int> order(k > 0 ? cs : 0);
  for (int r = 0; r < rows; ++r) {
    const float* z = logits.data() + static_cast<std::size_t>(r) * cs;
    const auto row = static_cast<std::size_t>(row0 + r);
    float* v = out.values.data() + row * cs;
    if (spec_.kind == OutputKind::raw) {
      std::copy_n(z, cs, v);
      continue;
    }
    int best = 0;
    for (int j = 1; j < c; ++j) best = z[j] > z[best] ? j : best;
    const float m = z[best];
    double sum = 0.0;
    for (int j = 0; j < c; ++j) {
      v[j] = std::exp(z[j] - m);
      sum += v[j];
    }
    const auto inv = static_cast<float>(1.0 / sum);
    for (int j = 0; j < c; ++j) v[j] *= inv;
    out.predicted[row] = best;
    if (k > 0) {
      // Descending logits, ties to the lower class, so top-1 is the argmax.
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k),
                        order.end(), [z](int a, int b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
      for (std::size_t i = 0; i < k; ++i) {
        out.topk_index[row * k + i] = order[i];
        out.topk_value[row * k + i] = v[order[i]];
      }
    }
    if (labels.empty()) continue;
    const std::int32_t label = labels[row];
    Metrics& mt = out.metrics;
    if (label < 0 || label >= c) {
      ++mt.out_of_range;
      continue;
    }
    ++mt.rows;
    mt.correct += label == best;
    mt.confusion[static_cast<std::size_t>(label) * cs + static_cast<std::size_t>(best)] += 1;
    mt.log_loss_sum += static_cast<double>(m) + std::log(sum) - static_cast<double>(z[label]);
  }
}

}  // namespace locus::infer
