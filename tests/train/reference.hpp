// A naive double-precision MLP (forward + loss only) used as the reference for finite
// differences: no BLAS, no fusion, plain loops over the documented formulas.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "locus/train/model/dropout.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/model/model.hpp"

namespace locus::train::testing {

inline double ref_activation(Activation a, double z) {
  switch (a) {
    case Activation::relu: return z > 0.0 ? z : 0.0;
    case Activation::gelu: {
      const double k = std::sqrt(2.0 / 3.14159265358979323846);
      return 0.5 * z * (1.0 + std::tanh(k * (z + 0.044715 * z * z * z)));
    }
    case Activation::tanh: return std::tanh(z);
  }
  return 0.0;
}

struct RefBatch {
  std::vector<float> x;                 // [rows, in]
  int rows = 0;
  std::vector<std::int32_t> labels;     // cross-entropy
  std::vector<float> targets;           // mse
  std::vector<std::uint64_t> ids;       // global sample ids (dropout)
};

// Mean loss over the batch (sum / rows) with params in double.
inline double ref_loss(const ModelSpec& spec, std::span<const double> params, Loss loss,
                       const RefBatch& b, std::uint64_t step, bool training) {
  const ParamLayout layout(spec.widths);
  double total = 0.0;
  for (int r = 0; r < b.rows; ++r) {
    std::vector<double> h(b.x.begin() + static_cast<std::ptrdiff_t>(r) * spec.widths[0],
                          b.x.begin() + static_cast<std::ptrdiff_t>(r + 1) * spec.widths[0]);
    for (int l = 0; l < layout.num_layers(); ++l) {
      const LayerLayout& ly = layout.layer(l);
      std::vector<double> z(static_cast<std::size_t>(ly.out));
      for (int o = 0; o < ly.out; ++o) {
        double acc = params[ly.bias_offset + static_cast<std::size_t>(o)];
        for (int i = 0; i < ly.in; ++i) {
          acc += params[ly.weight_offset + static_cast<std::size_t>(o) * ly.in + i] *
                 h[static_cast<std::size_t>(i)];
        }
        z[static_cast<std::size_t>(o)] = acc;
      }
      if (l + 1 < layout.num_layers()) {
        for (int o = 0; o < ly.out; ++o) {
          double y = ref_activation(spec.activation, z[static_cast<std::size_t>(o)]);
          if (training && spec.dropout > 0.0f) {
            const bool keep = dropout_keep(spec.seed, step, l, b.ids[static_cast<std::size_t>(r)],
                                           o, spec.dropout);
            y = keep ? y / (1.0 - static_cast<double>(spec.dropout)) : 0.0;
          }
          z[static_cast<std::size_t>(o)] = y;
        }
      }
      h = std::move(z);
    }
    if (loss == Loss::softmax_cross_entropy) {
      double m = h[0];
      for (double v : h) m = std::max(m, v);
      double s = 0.0;
      for (double v : h) s += std::exp(v - m);
      total += m + std::log(s) - h[static_cast<std::size_t>(b.labels[static_cast<std::size_t>(r)])];
    } else {
      double s = 0.0;
      for (std::size_t j = 0; j < h.size(); ++j) {
        const double d = h[j] - b.targets[static_cast<std::size_t>(r) * h.size() + j];
        s += d * d;
      }
      total += s / static_cast<double>(h.size());
    }
  }
  return total / b.rows;
}

// A deterministic batch: inputs in [-1, 1), labels and targets from a simple LCG.
inline RefBatch make_batch(std::span<const int> widths, int rows, std::uint64_t seed,
                           std::uint64_t first_id = 0) {
  RefBatch b;
  b.rows = rows;
  std::uint64_t s = seed * 6364136223846793005ull + 1442695040888963407ull;
  auto next = [&s]() {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(s >> 11) / 9007199254740992.0;  // [0, 1)
  };
  const int in = widths.front();
  const int out = widths.back();
  for (int i = 0; i < rows * in; ++i) b.x.push_back(static_cast<float>(2.0 * next() - 1.0));
  for (int r = 0; r < rows; ++r) {
    b.labels.push_back(static_cast<std::int32_t>(next() * out) % out);
    b.ids.push_back(first_id + static_cast<std::uint64_t>(r) * 7 + 3);
  }
  for (int i = 0; i < rows * out; ++i) b.targets.push_back(static_cast<float>(next()));
  return b;
}

}  // namespace locus::train::testing
