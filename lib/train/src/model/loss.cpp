// Softmax cross-entropy (stable log-softmax: one exp per logit, reused for the gradient) and
// mean squared error, each a single pass over the logits.
#include "locus/train/model/loss.hpp"

#include <fmt/format.h>

#include <cmath>

#include "locus/comm/error.hpp"

namespace locus::train {

Loss parse_loss(std::string_view name) {
  if (name == "cross_entropy" || name == "softmax_cross_entropy") {
    return Loss::softmax_cross_entropy;
  }
  if (name == "mse") return Loss::mse;
  throw ConfigError(fmt::format("unknown loss '{}': use cross_entropy or mse", name));
}

std::string_view to_string(Loss loss) noexcept {
  return loss == Loss::mse ? "mse" : "cross_entropy";
}

namespace {

void check_shapes(std::span<const float> z, int rows, int width, std::span<float> dz,
                  double grad_divisor) {
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(width);
  LOCUS_ASSERT(rows >= 0 && width >= 1 && z.size() == n,
               fmt::format("logits hold {} floats, expected {} x {}", z.size(), rows, width));
  LOCUS_ASSERT(dz.empty() || dz.size() == n,
               fmt::format("gradient buffer holds {} floats, expected {} x {}", dz.size(), rows,
                           width));
  LOCUS_ASSERT(dz.empty() || grad_divisor > 0.0,
               fmt::format("grad_divisor {} must be > 0 (the global batch size)", grad_divisor));
}

}  // namespace

LossStats softmax_cross_entropy(std::span<const float> logits, int rows, int classes,
                                std::span<const std::int32_t> labels, std::span<float> dlogits,
                                double grad_divisor) {
  check_shapes(logits, rows, classes, dlogits, grad_divisor);
  LOCUS_ASSERT(labels.size() == static_cast<std::size_t>(rows),
               fmt::format("{} labels for {} rows", labels.size(), rows));
  const float inv = dlogits.empty() ? 0.0f : static_cast<float>(1.0 / grad_divisor);
  LossStats stats;
  stats.rows = rows;
  for (int r = 0; r < rows; ++r) {
    const std::int32_t label = labels[static_cast<std::size_t>(r)];
    if (label < 0 || label >= classes) {
      throw DataError(fmt::format("label {} of batch row {} is outside [0, {}): the dataset's "
                                  "labels must match the model's output width",
                                  label, r, classes));
    }
    const float* z = logits.data() + static_cast<std::size_t>(r) * classes;
    int best = 0;
    for (int j = 1; j < classes; ++j) best = z[j] > z[best] ? j : best;
    const float m = z[best];
    float* g = dlogits.empty() ? nullptr : dlogits.data() + static_cast<std::size_t>(r) * classes;
    float sum = 0.0f;
    for (int j = 0; j < classes; ++j) {
      const float e = std::exp(z[j] - m);
      sum += e;
      if (g != nullptr) g[j] = e;
    }
    const float log_sum = std::log(sum);
    stats.loss_sum += static_cast<double>(m + log_sum - z[label]);
    stats.correct += best == label ? 1 : 0;
    if (g != nullptr) {
      // softmax_j / divisor, minus 1 / divisor at the label.
      const float scale = inv / sum;
      for (int j = 0; j < classes; ++j) g[j] *= scale;
      g[label] -= inv;
    }
  }
  return stats;
}

LossStats mean_squared_error(std::span<const float> outputs, int rows, int width,
                             std::span<const float> targets, std::span<float> doutputs,
                             double grad_divisor) {
  check_shapes(outputs, rows, width, doutputs, grad_divisor);
  LOCUS_ASSERT(targets.size() == outputs.size(),
               fmt::format("targets hold {} floats, expected {} x {}", targets.size(), rows,
                           width));
  const float scale =
      doutputs.empty() ? 0.0f : static_cast<float>(2.0 / (static_cast<double>(width) * grad_divisor));
  LossStats stats;
  stats.rows = rows;
  for (int r = 0; r < rows; ++r) {
    const std::size_t base = static_cast<std::size_t>(r) * static_cast<std::size_t>(width);
    double row_sum = 0.0;
    for (int j = 0; j < width; ++j) {
      const float d = outputs[base + j] - targets[base + j];
      row_sum += static_cast<double>(d) * d;
      if (!doutputs.empty()) doutputs[base + j] = d * scale;
    }
    stats.loss_sum += row_sum / width;
  }
  return stats;
}

}  // namespace locus::train
