// The cpu backend's layer operations on layers [first, end) of the MLP: per layer one sgemm
// and one fused epilogue forward; backward per layer dW (sgemm, beta = 1 to accumulate), dX
// (sgemm) and one fused pass through the activation below that also sums its bias gradient --
// exactly the calls of forward.cpp / backward.cpp for one batch over every layer.
#include "cpu/cpu_layer_ops.hpp"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/train/compute.hpp"
#include "locus/train/optim/clip.hpp"
#include "model/kernels.hpp"

namespace locus::train::detail {

namespace {

std::size_t sz(int a, int b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); }

void grow(std::vector<float>& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
}

comm::GradientBuffer host_view(std::vector<float>& v, std::size_t n) {
  return {v.data(), n, comm::MemorySpace::host, nullptr};
}

class CpuActivations final : public LayerActivations {
 public:
  comm::GradientBuffer input() override { return host_view(input_, sz(rows_, in_)); }
  comm::GradientBuffer output() override { return host_view(out.back(), sz(rows_, out_w_)); }
  comm::GradientBuffer grad_in() override { return host_view(grad_in_, sz(rows_, out_w_)); }

 private:
  friend class CpuLayerOps;
  int in_ = 0, out_w_ = 0;
  std::vector<float> input_;               // received activations [rows, w_first]
  std::vector<std::vector<float>> out;     // per range layer: [rows, w_{l+1}] post-activation
  std::vector<std::vector<float>> deriv;   // per hidden gelu/tanh layer: act'(z) * dropout
  std::vector<float> grad_in_;             // received d(loss)/d(range output)
};

class CpuBuffer final : public LayerBuffer {
 public:
  comm::GradientBuffer view(std::size_t n) override {
    grow(data_, n);
    return host_view(data_, n);
  }

 private:
  std::vector<float> data_;
};

class CpuLayerOps final : public LayerOps {
 public:
  CpuLayerOps(const ModelSpec& spec, LayerRange range, std::span<const float> params,
              std::span<float> grads, std::span<float> updatable, Optimizer* optimizer)
      : spec_(spec),
        layout_(spec.widths),
        num_layers_(layout_.num_layers()),
        range_(range),
        begin_(layout_.begin_of(range)),
        params_(params),
        updatable_(updatable),
        optimizer_(optimizer) {
    const std::size_t n = layout_.end_of(range) - begin_;
    if (grads.empty()) {
      own_grads_.assign(n, 0.0f);
      grads = own_grads_;
    }
    grads_ = grads;
    LOCUS_ASSERT(params.size() == n && grads_.size() == n,
                 fmt::format("layers [{}, {}) have {} parameters, got buffers of {} params and "
                             "{} grads",
                             range.first, range.end, n, params.size(), grads_.size()));
    int max_width = 0;
    for (int l = range.first; l <= range.end; ++l) max_width = std::max(max_width, width(l));
    bias_scratch_.assign(static_cast<std::size_t>(max_width), 0.0f);
  }

  std::string describe() const override { return "cpu (OpenBLAS)"; }
  LayerRange range() const noexcept override { return range_; }
  comm::GradientBuffer grads() noexcept override {
    return {grads_.data(), grads_.size(), comm::MemorySpace::host, nullptr};
  }
  std::unique_ptr<LayerActivations> make_activations() const override {
    return std::make_unique<CpuActivations>();
  }
  std::unique_ptr<LayerBuffer> make_buffer() const override {
    return std::make_unique<CpuBuffer>();
  }
  std::unique_ptr<comm::StageLink> make_link(const mpi::Comm& pp) const override {
    return comm::make_mpi_link(pp);
  }
  std::size_t prepare(LayerActivations& a, int rows, bool receives_input, bool receives_grad,
                      bool training) override;
  void forward(LayerActivations& a, std::span<const float> host_x, bool training,
               const DropoutKey& key) override;
  LossStats loss(LayerActivations& a, Loss loss, std::span<const std::int32_t> labels,
                 std::span<const float> targets, double grad_divisor, bool want_grad) override;
  void backward(LayerActivations& a, std::span<const float> host_x, bool from_loss,
                bool accumulate, float* dx, const GradsReadyFn& on_layer) override;
  double grad_sum_of_squares() override { return sum_of_squares(grads_); }
  void update(double lr, float grad_scale) override {
    LOCUS_ASSERT(optimizer_ != nullptr && updatable_.size() == params_.size(),
                 "these layer operations compute over read-only parameters: no update");
    optimizer_->step(updatable_, grads_, lr, grad_scale);
  }

 private:
  int width(int boundary) const noexcept { return spec_.widths[static_cast<std::size_t>(boundary)]; }
  int input_width() const noexcept { return width(range_.first); }
  int output_width() const noexcept { return width(range_.end); }
  bool holds_logits() const noexcept { return range_.end == num_layers_; }
  // The buffers hold the slice from begin_: these take layout offsets.
  const float* param(std::size_t offset) const noexcept { return params_.data() + (offset - begin_); }
  float* grad(std::size_t offset) const noexcept { return grads_.data() + (offset - begin_); }
  // Model layer l keeps act'(z) for backward (gelu, tanh; relu reads its output).
  bool stores_deriv(int l) const noexcept {
    return l + 1 < num_layers_ && spec_.activation != Activation::relu;
  }
  static CpuActivations& cpu(LayerActivations& a) { return static_cast<CpuActivations&>(a); }
  const float* input_of(CpuActivations& a, std::span<const float> host_x) const {
    return host_x.empty() ? a.input_.data() : host_x.data();
  }
  // dZ of hidden model layer l from dH (in place) and its bias gradient.
  void through_activation(const CpuActivations& a, int l, float* g, bool accumulate);
  // Where a layer's bias gradient is summed: into grads (written), or scratch then added.
  float* bias_target(int l, bool accumulate) {
    return accumulate ? bias_scratch_.data() : grad(layout_.layer(l).bias_offset);
  }
  void finish_bias(int l, bool accumulate);

  ModelSpec spec_;
  ParamLayout layout_;
  int num_layers_ = 0;
  LayerRange range_;
  std::size_t begin_ = 0;
  std::span<const float> params_;
  std::span<float> updatable_;  // params_, writable (empty: read-only)
  Optimizer* optimizer_ = nullptr;
  std::vector<float> own_grads_;
  std::span<float> grads_;
  std::vector<float> scratch_[2];  // back-propagated gradients inside the range
  std::vector<float> bias_scratch_;
  std::vector<float> dlogits_;     // the loss's gradient for the next backward
};

std::size_t CpuLayerOps::prepare(LayerActivations& base, int rows, bool receives_input,
                                 bool receives_grad, bool training) {
  CpuActivations& a = cpu(base);
  const int layers = range_.layers();
  a.rows_ = rows;
  a.in_ = input_width();
  a.out_w_ = output_width();
  a.out.resize(static_cast<std::size_t>(layers));
  a.deriv.resize(static_cast<std::size_t>(layers));
  std::size_t floats = 0;
  const auto take = [&](std::vector<float>& v, int w) {
    grow(v, sz(rows, w));
    floats += sz(rows, w);
  };
  if (receives_input) take(a.input_, input_width());
  for (int i = 0; i < layers; ++i) {
    const int l = range_.first + i;
    take(a.out[static_cast<std::size_t>(i)], width(l + 1));
    if (training && stores_deriv(l)) take(a.deriv[static_cast<std::size_t>(i)], width(l + 1));
  }
  if (receives_grad) take(a.grad_in_, output_width());
  if (training) {
    const int widest = *std::max_element(spec_.widths.begin(), spec_.widths.end());
    for (auto& s : scratch_) grow(s, sz(rows, widest));
  }
  return floats * sizeof(float);
}

void CpuLayerOps::forward(LayerActivations& base, std::span<const float> host_x, bool training,
                          const DropoutKey& key) {
  CpuActivations& a = cpu(base);
  const int rows = a.rows_;
  LOCUS_ASSERT(host_x.empty() || host_x.size() == sz(rows, input_width()),
               fmt::format("input holds {} floats, expected {} rows x {} features",
                           host_x.size(), rows, input_width()));
  const bool dropout = training && spec_.dropout > 0.0f;
  LOCUS_ASSERT(!dropout || key.sample_ids.size() == static_cast<std::size_t>(rows),
               fmt::format("dropout needs one sample id per row: got {} for {} rows",
                           key.sample_ids.size(), rows));
  if (rows == 0) return;
  const float* x = input_of(a, host_x);
  for (int l = range_.first; l < range_.end; ++l) {
    const LayerLayout& ly = layout_.layer(l);
    const auto i = static_cast<std::size_t>(l - range_.first);
    const float* in = l == range_.first ? x : a.out[i - 1].data();
    float* z = a.out[i].data();
    // Z[b, out] = X[b, in] * W^T with W stored [out, in] row-major.
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
      float* deriv = training && stores_deriv(l) ? a.deriv[i].data() : nullptr;
      add_bias_activate(z, deriv, bias, rows, ly.out, static_cast<int>(spec_.activation), d);
    }
  }
}

LossStats CpuLayerOps::loss(LayerActivations& base, Loss loss,
                            std::span<const std::int32_t> labels, std::span<const float> targets,
                            double grad_divisor, bool want_grad) {
  LOCUS_ASSERT(holds_logits(), "the loss needs the model's last layer");
  CpuActivations& a = cpu(base);
  const int rows = a.rows_, classes = output_width();
  const std::span<const float> logits = std::span<const float>(a.out.back()).first(sz(rows, classes));
  std::span<float> dlogits;
  if (want_grad) {
    grow(dlogits_, sz(rows, classes));
    dlogits = std::span<float>(dlogits_).first(sz(rows, classes));
  }
  if (loss == Loss::softmax_cross_entropy) {
    return softmax_cross_entropy(logits, rows, classes, labels, dlogits, grad_divisor);
  }
  LossStats st = mean_squared_error(logits, rows, classes, targets, dlogits, grad_divisor);
  if (!labels.empty()) st.correct = count_correct(logits, rows, classes, labels);
  return st;
}

void CpuLayerOps::finish_bias(int l, bool accumulate) {
  if (!accumulate) return;
  float* db = grad(layout_.layer(l).bias_offset);
  const int n = layout_.layer(l).out;
  for (int j = 0; j < n; ++j) db[j] += bias_scratch_[static_cast<std::size_t>(j)];
}

void CpuLayerOps::through_activation(const CpuActivations& a, int l, float* g, bool accumulate) {
  const auto i = static_cast<std::size_t>(l - range_.first);
  const int cols = layout_.layer(l).out;
  float* db = bias_target(l, accumulate);
  if (stores_deriv(l)) {
    deriv_backward(g, a.deriv[i].data(), db, a.rows_, cols);
  } else {
    const float p = spec_.dropout;
    relu_backward(g, a.out[i].data(), p > 0.0f ? 1.0f / (1.0f - p) : 1.0f, db, a.rows_, cols);
  }
  finish_bias(l, accumulate);
}

void CpuLayerOps::backward(LayerActivations& base, std::span<const float> host_x,
                           bool from_loss, bool accumulate, float* dx,
                           const GradsReadyFn& on_layer) {
  CpuActivations& a = cpu(base);
  const int rows = a.rows_;
  const int first = range_.first;
  const int last = range_.end - 1;
  if (rows == 0) {  // nothing to add; a first contribution is zero
    for (int l = last; l >= first; --l) {
      const LayerLayout& ly = layout_.layer(l);
      if (!accumulate) std::fill(grad(ly.begin()), grad(ly.end()), 0.0f);
      if (on_layer) on_layer(l);
    }
    return;
  }
  float* g = from_loss ? dlogits_.data() : a.grad_in_.data();
  // dZ of the range's top layer: the loss gave it for the logits; a hidden top layer still
  // goes through its activation (which also yields its bias gradient).
  if (holds_logits()) {
    column_sums(g, bias_target(last, accumulate), rows, layout_.layer(last).out);
    finish_bias(last, accumulate);
  } else {
    through_activation(a, last, g, accumulate);
  }
  const float* x = input_of(a, host_x);
  float* dz = g;
  for (int l = last; l >= first; --l) {
    const LayerLayout& ly = layout_.layer(l);
    const auto i = static_cast<std::size_t>(l - first);
    const float* in = l == first ? x : a.out[i - 1].data();
    // dW[out, in] = dZ[b, out]^T * X[b, in] (+ the earlier micro-batches' when accumulating).
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ly.out, ly.in, rows, 1.0f, dz, ly.out, in,
                ly.in, accumulate ? 1.0f : 0.0f, grad(ly.weight_offset), ly.in);
    float* next = nullptr;
    if (l > first || dx != nullptr) {
      // dX = dZ W: inside the range it goes through layer l-1's activation; at the range's
      // first layer it is what the previous stage receives. This reads W_l, so it comes
      // before on_layer(l).
      next = l > first ? scratch_[l % 2].data() : dx;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, ly.in, ly.out, 1.0f, dz, ly.out,
                  param(ly.weight_offset), ly.in, 0.0f, next, ly.in);
      if (l > first) through_activation(a, l - 1, next, accumulate);
    }
    if (on_layer) on_layer(l);
    dz = next;
  }
}

}  // namespace

std::unique_ptr<LayerOps> make_cpu_layer_ops(TrainState& state) {
  const std::span<float> params = state.model.params();
  return std::make_unique<CpuLayerOps>(state.model.spec(), state.model.held(), params,
                                       std::span<float>(), params, state.optimizer.get());
}

std::unique_ptr<LayerOps> make_cpu_layer_ops(const ModelSpec& spec, LayerRange range,
                                             std::span<const float> params,
                                             std::span<float> grads) {
  LOCUS_ASSERT(!grads.empty() || params.empty(), "the caller's gradient buffer is empty");
  return std::make_unique<CpuLayerOps>(spec, range, params, grads, std::span<float>(), nullptr);
}

}  // namespace locus::train::detail
