// Private to the CUDA backend: the device computation of layers [first, end) of the MLP --
// forward (per layer one cuBLASLt GEMM and one fused epilogue), the loss, and backward (weight
// GEMMs written or accumulated with beta = 1, bias sums, input gradients through the
// activation below) -- on buffers the caller owns, enqueued on one stream, never waiting, so
// the whole-model backend can capture it into graphs. One implementation serves the whole
// model (cuda_compute.cpp: every layer, one batch) and a pipeline stage (cuda_layer_ops.cpp:
// its layers, micro-batches).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <span>
#include <vector>

#include "cuda/kernels.hpp"
#include "cuda/matmul.hpp"
#include "cuda/memory.hpp"
#include "locus/train/model/backward.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/model/model.hpp"

namespace locus::train::cuda {

// What one (micro-)batch of up to `capacity` rows leaves on the range between its forward and
// its backward.
struct LayerBuffers {
  // own_input: a device copy of the range's input (a pipeline stage receives or uploads it;
  // the whole model reads its input slot). grad_in: the gradient received from the next stage.
  // bf16_input: the passes are handed their input in bf16 already (no x_bf16 to convert into).
  LayerBuffers(const ModelSpec& spec, LayerRange range, int capacity, bool training, bool bf16,
               bool own_input, bool grad_in, bool bf16_input = false);
  int capacity = 0;
  DeviceBuffer<float> input;                 // [rows, w_first]
  DeviceBuffer<__nv_bfloat16> x_bf16;        // bf16 (not bf16_input): [rows, w_first], the
                                             // first GEMM's operand
  std::vector<DeviceBuffer<float>> out;      // per range layer [rows, w_{l+1}] post-activation
  std::vector<DeviceBuffer<float>> deriv;    // per hidden gelu/tanh layer: act'(z) * dropout
  std::vector<DeviceBuffer<__nv_bfloat16>> out_bf16;  // bf16: the next GEMM's operand
  DeviceBuffer<float> grad_in;               // [rows, w_end]
};

// Scratch of one pass, shared by every (micro-)batch of the range (up to `capacity` rows).
struct PassScratch {
  PassScratch(const ModelSpec& spec, LayerRange range, int capacity, bool training, bool bf16);
  int capacity = 0;
  DeviceBuffer<__nv_bfloat16> dz_bf16;  // [rows, max width]
  DeviceBuffer<float> out_grad;         // [rows, w_end]: the loss's d/d(logits)
  DeviceBuffer<float> scratch[2];       // [rows, max width] ping-pong dX inside the range
  DeviceBuffer<float> column_scratch;   // column_sums
  DeviceBuffer<float> bias_sums;        // [max width]: one micro-batch's bias gradient
  DeviceBuffer<double> row_scratch;     // [rows] loss per row
};

// The range's parameters on the device: element 0 is layer first's weight (layout offset
// `begin`); params_bf16 is their bf16 copy (bf16 precision only, else null).
struct DeviceParams {
  const float* params = nullptr;
  const __nv_bfloat16* params_bf16 = nullptr;
  float* grads = nullptr;
  std::size_t begin = 0;
};

class DeviceLayers {
 public:
  DeviceLayers(const ModelSpec& spec, LayerRange range, Precision precision, Matmul& matmul);

  LayerRange range() const noexcept { return range_; }
  const ParamLayout& layout() const noexcept { return layout_; }
  bool bf16() const noexcept { return precision_ == Precision::bf16; }
  bool holds_logits() const noexcept { return range_.end == layout_.num_layers(); }
  int input_width() const noexcept { return width(range_.first); }
  int output_width() const noexcept { return width(range_.end); }

  // Forward of `rows` rows of x ([rows, input width], fp32, device) into a.out (and a.deriv
  // when training; a.x_bf16 / a.out_bf16 in bf16). dropout: seed, step and sample ids; its
  // layer is set per model layer. x_bf16 (bf16 only; may be null): the input already in bf16,
  // [rows, input width] -- the first GEMM's operand, x unread and a.x_bf16 unwritten; the
  // backward of this batch must be given it too. Capturable.
  void forward(const DeviceParams& p, const float* x, int rows, LayerBuffers& a, bool training,
               DropoutArgs dropout, cudaStream_t s, const __nv_bfloat16* x_bf16 = nullptr);

  // The loss of the logits a.out.back() (holds_logits()): loss.hpp's sums into *stats and,
  // with dlogits, d(loss)/d(logits) * (*inv_divisor). labels (device, may be null for mse),
  // targets (mse). Capturable.
  void loss(Loss loss, const LayerBuffers& a, const std::int32_t* labels, const float* targets,
            float* dlogits, const float* inv_divisor, PassScratch& w, DeviceLossStats* stats,
            int rows, cudaStream_t s);

  // Backward of the batch in `a` whose forward read x. g: d(loss)/d(range output) -- the
  // logits' gradient at the model's top, else the post-activation output's -- overwritten.
  // Weight and bias gradients are written into p.grads (accumulate = false) or added to them.
  // dx (may be null) receives d(loss)/d(x) [rows, input width]. ready (may be null): called
  // for each layer, last first, as soon as its gradient work is enqueued. x_bf16: what the
  // forward was given. rows > 0. Capturable.
  void backward(const DeviceParams& p, const float* x, LayerBuffers& a, float* g, int rows,
                bool accumulate, float* dx, PassScratch& w, const GradsReadyFn* ready,
                cudaStream_t s, const __nv_bfloat16* x_bf16 = nullptr);

 private:
  int width(int boundary) const noexcept {
    return spec_.widths[static_cast<std::size_t>(boundary)];
  }
  Act act_of(int l) const noexcept {
    return l + 1 == layout_.num_layers() ? Act::none : static_cast<Act>(spec_.activation);
  }
  const void* weight_operand(const DeviceParams& p, int l) const noexcept;
  const float* bias(const DeviceParams& p, int l) const noexcept {
    return p.params + (layout_.layer(l).bias_offset - p.begin);
  }
  // Layer l's bias gradient from g [rows, out]: written, or summed apart and added.
  void bias_grad(const DeviceParams& p, int l, const float* g, int rows, bool accumulate,
                 PassScratch& w, cudaStream_t s);
  void gemm(int m, int n, int k, bool ta, bool tb, const void* a, int lda, const void* b,
            int ldb, float* d, int ldd, cudaStream_t s, bool accumulate = false);

  ModelSpec spec_;
  ParamLayout layout_;
  LayerRange range_;
  Precision precision_;
  Matmul& matmul_;
};

}  // namespace locus::train::cuda
