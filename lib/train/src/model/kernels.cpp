// Elementwise forward/backward kernels; see kernels.hpp for what each fuses and why.
#include "model/kernels.hpp"

#include <cstddef>

#include "model/hash.hpp"

// One clone per ISA, chosen at load time: vectorised kernels without building for one CPU.
// (Not under ThreadSanitizer: see LOCUS_TRAIN_CLONES in optim/optimizers.hpp.)
#if defined(__SANITIZE_THREAD__)
#define LOCUS_CLONES
#else
#define LOCUS_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

namespace locus::train::detail {

namespace {

inline std::size_t at(int r, int cols) noexcept {
  return static_cast<std::size_t>(r) * static_cast<std::size_t>(cols);
}

// Activation value and derivative for one element (non-relu path).
inline void activate(int activation, float z, float& y, float& dy) noexcept {
  if (activation == 0) {
    y = z > 0.0f ? z : 0.0f;
    dy = z > 0.0f ? 1.0f : 0.0f;
  } else if (activation == 1) {
    gelu_tanh(z, y, dy);
  } else {
    y = std::tanh(z);
    dy = 1.0f - y * y;
  }
}

}  // namespace

LOCUS_CLONES void add_bias(float* __restrict z, const float* __restrict bias, int rows,
                           int cols) noexcept {
  for (int r = 0; r < rows; ++r) {
    float* __restrict row = z + at(r, cols);
    for (int j = 0; j < cols; ++j) row[j] += bias[j];
  }
}

LOCUS_CLONES void add_bias_relu(float* __restrict z, const float* __restrict bias, int rows,
                                int cols) noexcept {
  for (int r = 0; r < rows; ++r) {
    float* __restrict row = z + at(r, cols);
    for (int j = 0; j < cols; ++j) {
      const float v = row[j] + bias[j];
      row[j] = v > 0.0f ? v : 0.0f;
    }
  }
}

void add_bias_activate(float* __restrict z, float* __restrict deriv,
                       const float* __restrict bias, int rows, int cols, int activation,
                       const DropoutRows& dropout) noexcept {
  const std::uint64_t threshold = drop_threshold(dropout.p);
  const float scale = dropout.enabled ? 1.0f / (1.0f - dropout.p) : 1.0f;
  for (int r = 0; r < rows; ++r) {
    float* row = z + at(r, cols);
    float* drow = deriv != nullptr ? deriv + at(r, cols) : nullptr;
    const std::uint64_t key =
        dropout.enabled
            ? dropout_row_key(dropout.seed, dropout.step, dropout.layer, dropout.sample_ids[r])
            : 0;
    for (int j = 0; j < cols; ++j) {
      float y = 0.0f;
      float dy = 0.0f;
      activate(activation, row[j] + bias[j], y, dy);
      if (dropout.enabled) {
        const float factor = keep_unit(key, j, threshold) ? scale : 0.0f;
        y *= factor;
        dy *= factor;
      }
      row[j] = y;
      if (drow != nullptr) drow[j] = dy;
    }
  }
}

LOCUS_CLONES void relu_backward(float* __restrict g, const float* __restrict h, float scale,
                                float* __restrict db, int rows, int cols) noexcept {
  for (int j = 0; j < cols; ++j) db[j] = 0.0f;
  for (int r = 0; r < rows; ++r) {
    float* __restrict grow = g + at(r, cols);
    const float* __restrict hrow = h + at(r, cols);
    for (int j = 0; j < cols; ++j) {
      const float v = hrow[j] > 0.0f ? grow[j] * scale : 0.0f;
      grow[j] = v;
      db[j] += v;
    }
  }
}

LOCUS_CLONES void deriv_backward(float* __restrict g, const float* __restrict deriv,
                                 float* __restrict db, int rows, int cols) noexcept {
  for (int j = 0; j < cols; ++j) db[j] = 0.0f;
  for (int r = 0; r < rows; ++r) {
    float* __restrict grow = g + at(r, cols);
    const float* __restrict drow = deriv + at(r, cols);
    for (int j = 0; j < cols; ++j) {
      const float v = grow[j] * drow[j];
      grow[j] = v;
      db[j] += v;
    }
  }
}

LOCUS_CLONES void column_sums(const float* __restrict g, float* __restrict db, int rows,
                              int cols) noexcept {
  for (int j = 0; j < cols; ++j) db[j] = 0.0f;
  for (int r = 0; r < rows; ++r) {
    const float* __restrict grow = g + at(r, cols);
    for (int j = 0; j < cols; ++j) db[j] += grow[j];
  }
}

}  // namespace locus::train::detail
