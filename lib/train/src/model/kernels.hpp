// Elementwise kernels of the forward and backward passes (private). Each is one pass over a
// [rows, cols] row-major block that fuses everything done to it between two sgemms: bias,
// activation, dropout and the activation derivative; the backward ones also sum the bias
// gradient while the block is in registers. Hot ones are compiled per ISA (target_clones).
#pragma once

#include <cmath>
#include <cstdint>

namespace locus::train::detail {

// GELU, tanh approximation (PyTorch approximate='tanh'), and its derivative.
inline void gelu_tanh(float z, float& y, float& dy) noexcept {
  constexpr float kAlpha = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kBeta = 0.044715f;
  const float inner = kAlpha * (z + kBeta * z * z * z);
  const float t = std::tanh(inner);
  y = 0.5f * z * (1.0f + t);
  dy = 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * kAlpha * (1.0f + 3.0f * kBeta * z * z);
}

// z[r, j] += bias[j] (the output layer).
void add_bias(float* z, const float* bias, int rows, int cols) noexcept;
// z[r, j] = max(z[r, j] + bias[j], 0) (hidden relu layers without dropout).
void add_bias_relu(float* z, const float* bias, int rows, int cols) noexcept;

// The general hidden-layer epilogue: bias, activation (0 relu, 1 gelu, 2 tanh), dropout
// keyed by (seed, step, layer, sample_ids[r], j). deriv (may be null for relu) receives
// act'(z) times the dropout factor (0 or 1/(1-p)).
struct DropoutRows {
  bool enabled = false;
  float p = 0.0f;
  std::uint64_t seed = 0;
  std::uint64_t step = 0;
  int layer = 0;
  const std::uint64_t* sample_ids = nullptr;
};
void add_bias_activate(float* z, float* deriv, const float* bias, int rows, int cols,
                       int activation, const DropoutRows& dropout) noexcept;

// Backward through a relu (+ dropout scale) layer whose output h is stored:
// g = (h > 0 ? g * scale : 0) in place, db[j] = sum_r g[r, j].
void relu_backward(float* g, const float* h, float scale, float* db, int rows,
                   int cols) noexcept;
// Backward through a stored derivative: g *= deriv in place, db[j] = sum_r g[r, j].
void deriv_backward(float* g, const float* deriv, float* db, int rows, int cols) noexcept;
// db[j] = sum_r g[r, j].
void column_sums(const float* g, float* db, int rows, int cols) noexcept;

}  // namespace locus::train::detail
