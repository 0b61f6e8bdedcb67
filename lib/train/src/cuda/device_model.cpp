// DeviceModel: the forward-only face of the CUDA backend for inference (device_model.hpp).
// Mirrors CudaCompute::issue_pass with training off: per layer Z^T = op_T(W) X^T through
// cuBLASLt, then bias_act_forward (no dropout, no derivatives), bf16 operand copies in bf16.
#include "locus/train/cuda/device_model.hpp"

#include <fmt/format.h>

#include <cstdint>
#include <vector>

#include "cuda/cublaslt_api.hpp"
#include "cuda/device.hpp"
#include "cuda/kernels.hpp"
#include "cuda/matmul.hpp"
#include "cuda/memory.hpp"

namespace locus::train::cuda {

namespace {

std::size_t sz(int a, int b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); }

}  // namespace

SelectedDevice use_device(const mpi::Comm& world, int requested, std::string_view section) {
  const DeviceInfo d = select_device(world, requested, section);
  (void)lt();  // cuBLASLt loaded now (CublasError if it cannot be): the device is ready
  return {d.index, d.name, d.describe()};
}

struct DeviceModel::Impl {
  Impl(const Mlp& m, Precision p, int rows)
      : layout(m.layout()), activation(m.spec().activation), precision(p), max_rows(rows),
        matmul(p), params(m.params().size()) {
    LOCUS_ASSERT(m.whole(), "a DeviceModel holds the whole model (not a pipeline stage)");
    LOCUS_ASSERT(rows >= 1, "a DeviceModel needs batches of at least one row");
    // The heuristic's algorithms, never timed: a prediction file's bytes must not depend on
    // which rank (process) scored a unit, and each would time its own candidates.
    matmul.set_measure(false);
    LOCUS_CUDA_CHECK(cudaMemcpy(params.data(), m.params().data(), params.bytes(),
                                cudaMemcpyHostToDevice));
    const bool bf16 = p == Precision::bf16;
    if (bf16) {
      params_bf16 = DeviceBuffer<__nv_bfloat16>(params.size());
      to_bf16(params.data(), params_bf16.data(), params.size(), nullptr);
      x_bf16 = DeviceBuffer<__nv_bfloat16>(sz(rows, layout.input_width()));
    }
    for (int l = 0; l < layout.num_layers(); ++l) {
      const int w = layout.layer(l).out;
      out.emplace_back(sz(rows, w));
      const bool hidden = l + 1 < layout.num_layers();
      out_bf16.emplace_back(bf16 && hidden ? sz(rows, w) : 0);
    }
    LOCUS_CUDA_CHECK(cudaDeviceSynchronize());  // the uploads (legacy stream) are done
  }

  void gemm(int m, int n, int k, const void* a, const void* b, float* d, cudaStream_t s) {
    GemmShape g;
    g.m = m;
    g.n = n;
    g.k = k;
    g.trans_a = true;
    g.trans_b = false;
    g.lda = k;
    g.ldb = k;
    g.ldd = m;
    g.align_a = alignment_of(a);
    g.align_b = alignment_of(b);
    g.align_d = alignment_of(d);
    matmul.run(g, a, b, d, s);
  }

  ParamLayout layout;
  Activation activation;
  Precision precision;
  int max_rows;
  Matmul matmul;
  DeviceBuffer<float> params;
  DeviceBuffer<__nv_bfloat16> params_bf16, x_bf16;
  std::vector<DeviceBuffer<float>> out;               // per layer [rows, out]: logits last
  std::vector<DeviceBuffer<__nv_bfloat16>> out_bf16;  // per hidden layer (bf16)
};

DeviceModel::DeviceModel(const Mlp& model, Precision precision, int max_rows)
    : impl_(std::make_unique<Impl>(model, precision, max_rows)) {}

DeviceModel::~DeviceModel() = default;

int DeviceModel::inputs() const noexcept { return impl_->layout.input_width(); }
int DeviceModel::outputs() const noexcept { return impl_->layout.output_width(); }
int DeviceModel::max_rows() const noexcept { return impl_->max_rows; }
Precision DeviceModel::precision() const noexcept { return impl_->precision; }

std::string DeviceModel::describe() const {
  return fmt::format("{}, {}", to_string(impl_->precision), Matmul::version());
}

const float* DeviceModel::forward(const float* x, int rows, cudaStream_t s) {
  Impl& m = *impl_;
  LOCUS_ASSERT(rows >= 1 && rows <= m.max_rows,
               fmt::format("a forward pass of {} rows on a DeviceModel sized for {}", rows,
                           m.max_rows));
  const bool bf16 = m.precision == Precision::bf16;
  const void* in_op = x;
  if (bf16) {
    to_bf16(x, m.x_bf16.data(), sz(rows, inputs()), s);
    in_op = m.x_bf16.data();
  }
  const int layers = m.layout.num_layers();
  for (int l = 0; l < layers; ++l) {
    const LayerLayout& ly = m.layout.layer(l);
    const auto li = static_cast<std::size_t>(l);
    float* z = m.out[li].data();
    const void* w = bf16 ? static_cast<const void*>(m.params_bf16.data() + ly.weight_offset)
                         : static_cast<const void*>(m.params.data() + ly.weight_offset);
    // Z^T (out x rows) = op_T(W) (W stored [out, in] row-major = in x out column-major) X^T.
    m.gemm(ly.out, rows, ly.in, w, in_op, z, s);
    const bool hidden = l + 1 < layers;
    __nv_bfloat16* z_bf16 = hidden && bf16 ? m.out_bf16[li].data() : nullptr;
    const Act act = hidden ? static_cast<Act>(m.activation) : Act::none;
    bias_act_forward(z, nullptr, z_bf16, m.params.data() + ly.bias_offset, rows, ly.out, act,
                     DropoutArgs{}, s);
    in_op = bf16 ? static_cast<const void*>(z_bf16) : static_cast<const void*>(z);
  }
  return m.out.back().data();
}

}  // namespace locus::train::cuda
