// The device computation of a range of layers (see layers.hpp): the GEMMs as the transposed
// column-major products of matmul.hpp and the fused kernels of kernels.hpp, in the order of the
// CPU's forward.cpp / backward.cpp.
#include "cuda/layers.hpp"

#include <algorithm>
#include <cstdint>

namespace locus::train::cuda {

namespace {

std::size_t sz(int a, int b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); }

int max_width(const ModelSpec& spec, LayerRange range) {
  int w = 1;
  for (int l = range.first; l <= range.end; ++l) {
    w = std::max(w, spec.widths[static_cast<std::size_t>(l)]);
  }
  return w;
}

}  // namespace

LayerBuffers::LayerBuffers(const ModelSpec& spec, LayerRange range, int rows, bool training,
                           bool bf16, bool own_input, bool receives_grad, bool bf16_input)
    : capacity(rows) {
  const auto& widths = spec.widths;
  const int layers = static_cast<int>(widths.size()) - 1;
  const auto w = [&](int boundary) { return widths[static_cast<std::size_t>(boundary)]; };
  const auto take = [](DeviceBuffer<float>& b, std::size_t n) { b = DeviceBuffer<float>(n); };
  if (own_input) take(input, sz(rows, w(range.first)));
  for (int l = range.first; l < range.end; ++l) {
    const bool hidden = l + 1 < layers;
    out.emplace_back();
    take(out.back(), sz(rows, w(l + 1)));
    deriv.emplace_back();
    if (training && hidden && spec.activation != Activation::relu) {
      take(deriv.back(), sz(rows, w(l + 1)));
    }
    // The range's top layer feeds no GEMM here (the next stage converts what it receives).
    out_bf16.emplace_back(bf16 && hidden && l + 1 < range.end ? sz(rows, w(l + 1)) : 0);
  }
  if (bf16 && !bf16_input) x_bf16 = DeviceBuffer<__nv_bfloat16>(sz(rows, w(range.first)));
  if (receives_grad) take(grad_in, sz(rows, w(range.end)));
}

PassScratch::PassScratch(const ModelSpec& spec, LayerRange range, int rows, bool training,
                         bool bf16)
    : capacity(rows) {
  const int widest = max_width(spec, range);
  if (training) {
    if (bf16) dz_bf16 = DeviceBuffer<__nv_bfloat16>(sz(rows, widest));
    out_grad = DeviceBuffer<float>(sz(rows, spec.widths[static_cast<std::size_t>(range.end)]));
    scratch[0] = DeviceBuffer<float>(sz(rows, widest));
    scratch[1] = DeviceBuffer<float>(sz(rows, widest));
    column_scratch =
        DeviceBuffer<float>(std::max<std::size_t>(column_sums_scratch(rows, widest), 1));
    bias_sums = DeviceBuffer<float>(static_cast<std::size_t>(widest));
  }
  row_scratch = DeviceBuffer<double>(static_cast<std::size_t>(std::max(rows, 1)));
}

DeviceLayers::DeviceLayers(const ModelSpec& spec, LayerRange range, Precision precision,
                           Matmul& matmul)
    : spec_(spec), layout_(spec.widths), range_(range), precision_(precision), matmul_(matmul) {}

const void* DeviceLayers::weight_operand(const DeviceParams& p, int l) const noexcept {
  const std::size_t off = layout_.layer(l).weight_offset - p.begin;
  if (bf16()) return p.params_bf16 + off;
  return p.params + off;
}

void DeviceLayers::gemm(int m, int n, int k, bool ta, bool tb, const void* a, int lda,
                        const void* b, int ldb, float* d, int ldd, cudaStream_t s,
                        bool accumulate) {
  GemmShape shape;
  shape.m = m;
  shape.n = n;
  shape.k = k;
  shape.trans_a = ta;
  shape.trans_b = tb;
  shape.lda = lda;
  shape.ldb = ldb;
  shape.ldd = ldd;
  shape.align_a = alignment_of(a);
  shape.align_b = alignment_of(b);
  shape.align_d = alignment_of(d);
  matmul_.run(shape, a, b, d, s, accumulate);
}

void DeviceLayers::forward(const DeviceParams& p, const float* x, int rows, LayerBuffers& a,
                           bool training, DropoutArgs dropout, cudaStream_t s,
                           const __nv_bfloat16* x_bf16) {
  const void* in_op = x;
  if (bf16()) {
    if (x_bf16 == nullptr) {
      LOCUS_ASSERT(a.x_bf16.size() >= sz(rows, input_width()),
                   "a bf16 forward pass without a bf16 input needs LayerBuffers' x_bf16");
      to_bf16(x, a.x_bf16.data(), sz(rows, input_width()), s);
      x_bf16 = a.x_bf16.data();
    }
    in_op = x_bf16;
  }
  dropout.enabled = training && spec_.dropout > 0.0f;
  for (int l = range_.first; l < range_.end; ++l) {
    const LayerLayout& ly = layout_.layer(l);
    const auto i = static_cast<std::size_t>(l - range_.first);
    float* z = a.out[i].data();
    // Z^T (out x rows) = op_T(W) (W stored [out, in] row-major = in x out column-major) X^T.
    gemm(ly.out, rows, ly.in, true, false, weight_operand(p, l), ly.in, in_op, ly.in, z, ly.out, s);
    dropout.layer = l;
    const bool hidden = l + 1 < layout_.num_layers();
    __nv_bfloat16* out_bf16 = a.out_bf16[i].size() > 0 ? a.out_bf16[i].data() : nullptr;
    float* deriv = training && hidden ? a.deriv[i].data() : nullptr;
    bias_act_forward(z, deriv, out_bf16, bias(p, l), rows, ly.out, act_of(l),
                     hidden ? dropout : DropoutArgs{}, s);
    in_op = bf16() ? static_cast<const void*>(out_bf16) : static_cast<const void*>(z);
  }
}

void DeviceLayers::loss(Loss loss, const LayerBuffers& a, const std::int32_t* labels,
                        const float* targets, float* dlogits, const float* inv_divisor,
                        PassScratch& w, DeviceLossStats* stats, int rows, cudaStream_t s) {
  LOCUS_ASSERT(holds_logits(), "the loss needs the model's last layer");
  const float* logits = a.out.back().data();
  if (loss == Loss::softmax_cross_entropy) {
    softmax_cross_entropy(logits, labels, dlogits, inv_divisor, w.row_scratch.data(), stats, rows,
                          output_width(), s);
  } else {
    mean_squared_error(logits, targets, labels, dlogits, inv_divisor, w.row_scratch.data(), stats,
                       rows, output_width(), s);
  }
}

void DeviceLayers::bias_grad(const DeviceParams& p, int l, const float* g, int rows,
                             bool accumulate, PassScratch& w, cudaStream_t s) {
  const LayerLayout& ly = layout_.layer(l);
  float* db = p.grads + (ly.bias_offset - p.begin);
  if (!accumulate) {
    column_sums(g, db, w.column_scratch.data(), rows, ly.out, s);
    return;
  }
  column_sums(g, w.bias_sums.data(), w.column_scratch.data(), rows, ly.out, s);
  add_into(db, w.bias_sums.data(), static_cast<std::size_t>(ly.out), s);
}

void DeviceLayers::backward(const DeviceParams& p, const float* x, LayerBuffers& a, float* g,
                            int rows, bool accumulate, float* dx, PassScratch& w,
                            const GradsReadyFn* ready, cudaStream_t s,
                            const __nv_bfloat16* x_bf16) {
  const float drop = spec_.dropout;
  const float relu_scale = drop > 0.0f ? 1.0f / (1.0f - drop) : 1.0f;
  const int first = range_.first, top = range_.end - 1;
  if (bf16() && x_bf16 == nullptr) {
    LOCUS_ASSERT(a.x_bf16.size() >= sz(rows, input_width()),
                 "a bf16 backward pass without a bf16 input needs LayerBuffers' x_bf16");
    x_bf16 = a.x_bf16.data();
  }
  const void* x_op = bf16() ? static_cast<const void*>(x_bf16) : x;
  __nv_bfloat16* dz_bf16 = bf16() ? w.dz_bf16.data() : nullptr;
  // dZ of the range's top layer: the loss gave it for the logits; a hidden top layer's output
  // gradient still goes through its activation.
  if (holds_logits()) {
    bias_grad(p, top, g, rows, accumulate, w, s);
    if (bf16()) to_bf16(g, dz_bf16, sz(rows, output_width()), s);
  } else {
    const auto i = static_cast<std::size_t>(top - first);
    const float* deriv = a.deriv[i].size() > 0 ? a.deriv[i].data() : nullptr;
    act_backward(g, deriv, a.out[i].data(), relu_scale, dz_bf16, rows, output_width(), s);
    bias_grad(p, top, g, rows, accumulate, w, s);
  }
  float* dz = g;
  for (int l = top; l >= first; --l) {
    const LayerLayout& ly = layout_.layer(l);
    const auto i = static_cast<std::size_t>(l - first);
    const void* dz_op = bf16() ? static_cast<const void*>(dz_bf16) : dz;
    const void* in_op = l == first ? x_op
                        : bf16()   ? static_cast<const void*>(a.out_bf16[i - 1].data())
                                   : static_cast<const void*>(a.out[i - 1].data());
    // dW^T (in x out) = X^T (in x rows) op_T(dZ^T) (dZ row-major [rows, out] = out x rows).
    gemm(ly.in, ly.out, rows, false, true, in_op, ly.in, dz_op, ly.out,
         p.grads + (ly.weight_offset - p.begin), ly.in, s, accumulate);
    // Layer l is complete: its bias gradient was summed before (from dz).
    if (ready != nullptr && *ready) (*ready)(l);
    if (l == first && dx == nullptr) break;
    // dX^T (in x rows) = W^T (in x out) dZ^T (out x rows): inside the range it goes through
    // layer l-1's activation; at the range's first layer it is what the previous stage gets.
    float* next = l > first ? w.scratch[l % 2].data() : dx;
    gemm(ly.in, rows, ly.out, false, false, weight_operand(p, l), ly.in, dz_op, ly.out, next,
         ly.in, s);
    if (l == first) break;
    const float* deriv = a.deriv[i - 1].size() > 0 ? a.deriv[i - 1].data() : nullptr;
    act_backward(next, deriv, a.out[i - 1].data(), relu_scale, dz_bf16, rows, ly.in, s);
    bias_grad(p, l - 1, next, rows, accumulate, w, s);
    dz = next;
  }
}

}  // namespace locus::train::cuda
