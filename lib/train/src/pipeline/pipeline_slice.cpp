// One pipeline stage's slice of the MLP: forward and backward of layers [first, end) on one
// micro-batch, with exactly the sgemm shapes and fused kernels of forward.cpp / backward.cpp
// (so one micro-batch on any partition gives the bits of the unpartitioned model), and weight
// gradients accumulated across micro-batches by sgemm with beta = 1.
#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>

#include "model/kernels.hpp"
#include "locus/comm/error.hpp"
#include "pipeline/pipeline_detail.hpp"

namespace locus::train::detail {

namespace {

std::size_t sz(int a, int b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); }

void grow(std::vector<float>& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
}

}  // namespace

StageModel::StageModel(const ModelSpec& spec, const StageRange& range, StageBuffers buffers)
    : spec_(spec),
      layout_(spec.widths),
      widths_(spec.widths),
      num_layers_(layout_.num_layers()),
      range_(range),
      buffers_(buffers) {
  LOCUS_ASSERT(buffers.params.size() == range.size() && buffers.grads.size() == range.size(),
               fmt::format("stage of layers [{}, {}) has {} parameters, got buffers of {} params "
                           "and {} grads",
                           range.first_layer, range.end_layer, range.size(), buffers.params.size(),
                           buffers.grads.size()));
  int max_width = 0;
  for (int l = range.first_layer; l <= range.end_layer; ++l)
    max_width = std::max(max_width, width(l));
  bias_scratch_.assign(static_cast<std::size_t>(max_width), 0.0f);
}

bool StageModel::stores_deriv(int l) const noexcept {
  return l + 1 < num_layers_ && spec_.activation != Activation::relu;
}

std::size_t StageModel::prepare(ActivationSlot& slot, int m, int rows, bool receives_input,
                                bool receives_grad, bool training) const {
  const int layers = range_.layers();
  slot.micro_batch = m;
  slot.rows = rows;
  slot.out.resize(static_cast<std::size_t>(layers));
  slot.deriv.resize(static_cast<std::size_t>(layers));
  std::size_t floats = 0;
  const auto take = [&](std::vector<float>& v, int w) {
    grow(v, sz(rows, w));
    floats += sz(rows, w);
  };
  if (receives_input) take(slot.input, input_width());
  for (int i = 0; i < layers; ++i) {
    const int l = range_.first_layer + i;
    take(slot.out[static_cast<std::size_t>(i)], width(l + 1));
    if (training && stores_deriv(l)) take(slot.deriv[static_cast<std::size_t>(i)], width(l + 1));
  }
  if (receives_grad) take(slot.grad_in, output_width());
  if (training) {
    for (auto& s : scratch_) grow(s, sz(rows, *std::max_element(widths_.begin(), widths_.end())));
  }
  return floats * sizeof(float);
}

void StageModel::forward(const float* x, ActivationSlot& slot, bool training,
                         const DropoutKey& key) const {
  const int rows = slot.rows;
  if (rows == 0) return;
  const bool dropout = training && spec_.dropout > 0.0f;
  for (int l = range_.first_layer; l < range_.end_layer; ++l) {
    const LayerLayout& ly = layout_.layer(l);
    const auto i = static_cast<std::size_t>(l - range_.first_layer);
    const float* in = l == range_.first_layer ? x : slot.out[i - 1].data();
    float* z = slot.out[i].data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, ly.out, ly.in, 1.0f, in, ly.in,
                param(ly.weight_offset), ly.in, 0.0f, z, ly.out);
    const float* bias = param(ly.bias_offset);
    if (l + 1 == num_layers_) {
      add_bias(z, bias, rows, ly.out);
    } else if (spec_.activation == Activation::relu && !dropout) {
      add_bias_relu(z, bias, rows, ly.out);
    } else {
      DropoutRows d;
      d.enabled = dropout;
      d.p = spec_.dropout;
      d.seed = spec_.seed;
      d.step = key.step;
      d.layer = l;
      d.sample_ids = key.sample_ids.data();
      float* deriv = training && stores_deriv(l) ? slot.deriv[i].data() : nullptr;
      add_bias_activate(z, deriv, bias, rows, ly.out, static_cast<int>(spec_.activation), d);
    }
  }
}

std::span<const float> StageModel::output(const ActivationSlot& slot) const {
  return std::span<const float>(slot.out.back()).first(sz(slot.rows, output_width()));
}

float* StageModel::bias_target(int l, bool accumulate) const {
  if (accumulate) return bias_scratch_.data();
  return grad(layout_.layer(l).bias_offset);
}

void StageModel::finish_bias(int l, bool accumulate) const {
  if (!accumulate) return;
  float* db = grad(layout_.layer(l).bias_offset);
  const int n = layout_.layer(l).out;
  for (int j = 0; j < n; ++j) db[j] += bias_scratch_[static_cast<std::size_t>(j)];
}

void StageModel::through_activation(const ActivationSlot& slot, int l, float* g,
                                    bool accumulate) const {
  const auto i = static_cast<std::size_t>(l - range_.first_layer);
  const int cols = layout_.layer(l).out;
  float* db = bias_target(l, accumulate);
  if (stores_deriv(l)) {
    deriv_backward(g, slot.deriv[i].data(), db, slot.rows, cols);
  } else {
    const float p = spec_.dropout;
    relu_backward(g, slot.out[i].data(), p > 0.0f ? 1.0f / (1.0f - p) : 1.0f, db, slot.rows, cols);
  }
  finish_bias(l, accumulate);
}

void StageModel::backward(const float* x, ActivationSlot& slot, float* g, bool accumulate,
                          float* dx, const std::function<void(int)>& on_layer) const {
  const int rows = slot.rows;
  const int first = range_.first_layer;
  const int last = range_.end_layer - 1;
  if (rows == 0) {  // nothing to add; a first contribution is zero
    for (int l = last; l >= first; --l) {
      const LayerLayout& ly = layout_.layer(l);
      if (!accumulate) std::fill(grad(ly.begin()), grad(ly.end()), 0.0f);
      if (on_layer) on_layer(l);
    }
    return;
  }
  // dZ of the stage's top layer: the loss gave it for the logits; a hidden top layer still
  // goes through its activation (which also yields its bias gradient).
  if (holds_logits()) {
    column_sums(g, bias_target(last, accumulate), rows, layout_.layer(last).out);
    finish_bias(last, accumulate);
  } else {
    through_activation(slot, last, g, accumulate);
  }
  float* dz = g;
  for (int l = last; l >= first; --l) {
    const LayerLayout& ly = layout_.layer(l);
    const auto i = static_cast<std::size_t>(l - first);
    const float* in = l == first ? x : slot.out[i - 1].data();
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ly.out, ly.in, rows, 1.0f, dz, ly.out, in,
                ly.in, accumulate ? 1.0f : 0.0f, grad(ly.weight_offset), ly.in);
    float* next = nullptr;
    if (l > first || dx != nullptr) {
      // dX = dZ W: inside the stage it goes through layer l-1's activation; at the stage's
      // first layer it is what the previous stage receives.
      next = l > first ? scratch_[l % 2].data() : dx;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, ly.in, ly.out, 1.0f, dz, ly.out,
                  param(ly.weight_offset), ly.in, 0.0f, next, ly.in);
      if (l > first) through_activation(slot, l - 1, next, accumulate);
    }
    if (on_layer) on_layer(l);
    dz = next;
  }
}

}  // namespace locus::train::detail
