// The CUDA backend's layer operations (layer_ops.hpp) on a pipeline stage's layers: the
// stage's parameters, gradients and optimizer state on the device (device_state.hpp), each
// micro-batch's activations in device buffers of its own, forward / loss / backward through
// the same device code as the whole-model backend (layers.hpp), weight and bias gradients
// accumulated over micro-batches on the device. Inputs from the host (the first stage's rows,
// labels, targets, sample ids) are copied in on the stage's stream; what comes back to the
// host (a micro-batch's loss sums, the gradient's sum of squares) waits for it.
//
// Kernels are launched eagerly: a stage's step alternates with transfers through the stage
// link (host-staged MPI, with host waits in between), so it cannot be one captured graph;
// train.graphs applies to whole-model steps (cuda_compute.cpp).
#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda/cuda_compute.hpp"
#include "cuda/device.hpp"
#include "cuda/device_state.hpp"
#include "cuda/layers.hpp"
#include "cuda/step_buffers.hpp"

namespace locus::train::cuda {

namespace {

std::size_t sz(int a, int b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); }

// Device buffers replaced while work queued before may still read them: kept (moved here)
// until CudaLayerOps::free_replaced(), not freed, since cudaFree waits for the whole device.
class Replaced {
 public:
  template <class T>
  void keep(T&& old) {
    kept_.push_back(std::make_shared<std::decay_t<T>>(std::forward<T>(old)));
  }
  bool empty() const noexcept { return kept_.empty(); }
  void clear() noexcept { kept_.clear(); }

 private:
  std::vector<std::shared_ptr<void>> kept_;
};

comm::GradientBuffer device_view(float* p, std::size_t n, cudaStream_t s) {
  return {p, n, comm::MemorySpace::cuda, s};
}

// Host -> device copy of a span on s (pageable sources are staged by the driver before the
// call returns, so the host memory may change afterwards).
template <class T>
void upload(T* dst, std::span<const T> src, cudaStream_t s) {
  if (!src.empty()) {
    LOCUS_CUDA_CHECK(cudaMemcpyAsync(dst, src.data(), src.size_bytes(), cudaMemcpyHostToDevice, s));
  }
}

class CudaActivations final : public detail::LayerActivations {
 public:
  explicit CudaActivations(cudaStream_t s) : stream_(s) {}
  comm::GradientBuffer input() override {
    return device_view(bufs->input.data(), sz(rows_, in_), stream_);
  }
  comm::GradientBuffer output() override {
    return device_view(bufs->out.back().data(), sz(rows_, out_w_), stream_);
  }
  comm::GradientBuffer grad_in() override {
    return device_view(bufs->grad_in.data(), sz(rows_, out_w_), stream_);
  }

 private:
  friend class CudaLayerOps;
  cudaStream_t stream_;
  int in_ = 0, out_w_ = 0;
  bool training_ = false, grad_in_ = false;  // what bufs was allocated for
  std::optional<LayerBuffers> bufs;
  DeviceBuffer<std::uint64_t> sample_ids;  // dropout: the micro-batch's rows' global ids
};

// replaced: the layer ops' (which outlive the buffer), where a buffer that grows leaves its old
// memory (a transfer queued before may still read it).
class CudaBuffer final : public detail::LayerBuffer {
 public:
  CudaBuffer(cudaStream_t s, Replaced* replaced) : stream_(s), replaced_(replaced) {}
  comm::GradientBuffer view(std::size_t n) override {
    if (data_.size() < n) {
      if (data_.size() > 0) replaced_->keep(std::move(data_));
      data_ = DeviceBuffer<float>(n);
    }
    return device_view(data_.data(), n, stream_);
  }

 private:
  cudaStream_t stream_;
  Replaced* replaced_;
  DeviceBuffer<float> data_;
};

class CudaLayerOps final : public detail::LayerOps {
 public:
  CudaLayerOps(const ComputeOptions& options, const DeviceInfo& device, TrainState& state)
      : options_(options),
        device_(device),
        state_(state),
        stream_(make_stream()),
        matmul_(options.precision),
        dstate_(state, options.precision == Precision::bf16),
        layers_(state.model.spec(), state.model.held(), options.precision, matmul_),
        begin_(state.model.offset()),
        device_sum_(1),
        norm_scratch_(grad_norm_scratch(dstate_.size())),
        stats_(1),
        host_stats_(1),
        host_sum_(1) {
    matmul_.set_measure(options.measure_gemms);
    dstate_.sync_from_host(stream_.get());
  }

  ~CudaLayerOps() override {
    if (stream_) cudaStreamSynchronize(stream_.get());  // never throw here
  }

  std::string describe() const override { return describe_backend(options_.precision, device_); }
  LayerRange range() const noexcept override { return layers_.range(); }
  comm::GradientBuffer grads() noexcept override {
    return device_view(dstate_.grads(), dstate_.size(), stream_.get());
  }
  std::unique_ptr<detail::LayerActivations> make_activations() const override {
    return std::make_unique<CudaActivations>(stream_.get());
  }
  std::unique_ptr<detail::LayerBuffer> make_buffer() const override {
    return std::make_unique<CudaBuffer>(stream_.get(), &replaced_);
  }
  std::unique_ptr<comm::StageLink> make_link(const mpi::Comm& pp) const override {
    return make_staged_link(pp);
  }
  std::size_t prepare(detail::LayerActivations& a, int rows, bool receives_input,
                      bool receives_grad, bool training) override;
  void forward(detail::LayerActivations& a, std::span<const float> host_x, bool training,
               const DropoutKey& key) override;
  LossStats loss(detail::LayerActivations& a, Loss loss, std::span<const std::int32_t> labels,
                 std::span<const float> targets, double grad_divisor, bool want_grad) override;
  void backward(detail::LayerActivations& a, std::span<const float> host_x, bool from_loss,
                bool accumulate, float* dx, const GradsReadyFn& on_layer) override;
  double grad_sum_of_squares() override;
  void update(double lr, float grad_scale) override;
  void sync_from_host() override { dstate_.sync_from_host(stream_.get()); }
  void sync_to_host() override { dstate_.sync_to_host(stream_.get()); }
  void before_host_waits(std::function<void(void*)> settle) override {
    settle_ = settle;
    matmul_.set_before_wait(std::move(settle));
  }
  void free_replaced() override {
    if (replaced_.empty()) return;
    wait_for_stream();
    replaced_.clear();
  }

 private:
  static CudaActivations& dev(detail::LayerActivations& a) {
    return static_cast<CudaActivations&>(a);
  }
  DeviceParams params() const noexcept {
    return {dstate_.params(), dstate_.params_bf16(), dstate_.grads(), begin_};
  }
  bool stores_deriv(int l) const noexcept {
    return l + 1 < state_.model.num_layers() &&
           state_.model.spec().activation != Activation::relu;
  }
  void ensure_scratch(int rows);
  void check_labels(std::span<const std::int32_t> labels) const;
  // Before replaced buffers are freed: the stream's work done, its waits for peers watched.
  void wait_for_stream() {
    if (settle_) settle_(stream_.get());
    LOCUS_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
  }

  ComputeOptions options_;
  DeviceInfo device_;
  TrainState& state_;
  Stream stream_;
  Matmul matmul_;
  DeviceState dstate_;
  DeviceLayers layers_;
  std::size_t begin_ = 0;  // layout offset of the stage's first parameter
  std::optional<PassScratch> scratch_;
  ScalarUpload<std::uint64_t> step_;       // dropout masks' step
  ScalarUpload<float> inv_divisor_;        // the loss's 1 / grad_divisor
  ScalarUpload<float> grad_scale_upload_;  // the clipping factor, read by the update
  ScalarUpload<OptimizerScalars> opt_scalars_;
  DeviceBuffer<double> device_sum_, norm_scratch_;
  DeviceBuffer<DeviceLossStats> stats_;
  DeviceBuffer<std::int32_t> labels_;
  DeviceBuffer<float> targets_;
  PinnedBuffer<DeviceLossStats> host_stats_;
  PinnedBuffer<double> host_sum_;
  std::function<void(void*)> settle_;  // before_host_waits()
  mutable Replaced replaced_;          // buffers grown this step, until free_replaced()
};

std::size_t CudaLayerOps::prepare(detail::LayerActivations& base, int rows, bool receives_input,
                                  bool receives_grad, bool training) {
  CudaActivations& a = dev(base);
  const LayerRange r = range();
  a.rows_ = rows;
  a.in_ = layers_.input_width();
  a.out_w_ = layers_.output_width();
  // Buffers only grow: to the largest micro-batch, with what training and the transfers need.
  const bool grow = !a.bufs || a.bufs->capacity < rows || (training && !a.training_) ||
                    (receives_grad && !a.grad_in_);
  if (grow) {
    const int capacity = std::max({rows, 1, a.bufs ? a.bufs->capacity : 1});
    // Work queued before may still use the old buffers: kept until free_replaced().
    if (a.bufs) replaced_.keep(std::move(*a.bufs));
    if (a.sample_ids.size() > 0) replaced_.keep(std::move(a.sample_ids));
    a.training_ = a.training_ || training;
    a.grad_in_ = a.grad_in_ || receives_grad;
    // The device always keeps its own copy of the input: received, or uploaded from the host.
    a.bufs.emplace(state_.model.spec(), r, capacity, a.training_, layers_.bf16(), true,
                   a.grad_in_);
    if (state_.model.spec().dropout > 0.0f) {
      a.sample_ids = DeviceBuffer<std::uint64_t>(static_cast<std::size_t>(capacity));
    }
  }
  if (training) ensure_scratch(rows);
  // The bytes the micro-batch keeps, counted as the cpu backend counts them.
  std::size_t floats = receives_input ? sz(rows, a.in_) : 0;
  for (int l = r.first; l < r.end; ++l) {
    const int w = state_.model.spec().widths[static_cast<std::size_t>(l) + 1];
    floats += sz(rows, w);
    if (training && stores_deriv(l)) floats += sz(rows, w);
  }
  if (receives_grad) floats += sz(rows, a.out_w_);
  return floats * sizeof(float);
}

void CudaLayerOps::ensure_scratch(int rows) {
  if (scratch_ && scratch_->capacity >= rows) return;
  if (scratch_) replaced_.keep(std::move(*scratch_));  // queued work may still use it
  scratch_.emplace(state_.model.spec(), range(), std::max(rows, 1), true, layers_.bf16());
}

void CudaLayerOps::forward(detail::LayerActivations& base, std::span<const float> host_x,
                           bool training, const DropoutKey& key) {
  CudaActivations& a = dev(base);
  const int rows = a.rows_;
  LOCUS_ASSERT(host_x.empty() || host_x.size() == sz(rows, a.in_),
               fmt::format("input holds {} floats, expected {} rows x {} features",
                           host_x.size(), rows, a.in_));
  const ModelSpec& spec = state_.model.spec();
  const bool dropout = training && spec.dropout > 0.0f;
  LOCUS_ASSERT(!dropout || key.sample_ids.size() == static_cast<std::size_t>(rows),
               fmt::format("dropout needs one sample id per row: got {} for {} rows",
                           key.sample_ids.size(), rows));
  if (rows == 0) return;
  cudaStream_t s = stream_.get();
  upload(a.bufs->input.data(), host_x, s);  // the first stage; later ones received it
  DropoutArgs d;
  d.p = spec.dropout;
  d.seed = spec.seed;
  if (dropout) {
    upload(a.sample_ids.data(), key.sample_ids, s);
    step_.upload(key.step, s);
    d.step = step_.device();
    d.sample_ids = a.sample_ids.data();
  }
  layers_.forward(params(), a.bufs->input.data(), rows, *a.bufs, training, d, s);
}

void CudaLayerOps::check_labels(std::span<const std::int32_t> labels) const {
  const int classes = layers_.output_width();
  for (std::size_t r = 0; r < labels.size(); ++r) {
    if (labels[r] < 0 || labels[r] >= classes) {
      throw DataError(fmt::format("label {} of batch row {} is outside [0, {}): the dataset's "
                                  "labels must match the model's output width",
                                  labels[r], r, classes));
    }
  }
}

LossStats CudaLayerOps::loss(detail::LayerActivations& base, Loss loss,
                             std::span<const std::int32_t> labels,
                             std::span<const float> targets, double grad_divisor,
                             bool want_grad) {
  LOCUS_ASSERT(layers_.holds_logits(), "the loss needs the model's last layer");
  CudaActivations& a = dev(base);
  const int rows = a.rows_;
  if (rows == 0) return {};
  check_labels(labels);
  cudaStream_t s = stream_.get();
  // Grown: the old ones kept until free_replaced() (queued work may still read them).
  if (labels_.size() < labels.size()) {
    if (labels_.size() > 0) replaced_.keep(std::move(labels_));
    labels_ = DeviceBuffer<std::int32_t>(labels.size());
  }
  if (targets_.size() < targets.size()) {
    if (targets_.size() > 0) replaced_.keep(std::move(targets_));
    targets_ = DeviceBuffer<float>(targets.size());
  }
  upload(labels_.data(), labels, s);
  upload(targets_.data(), targets, s);
  inv_divisor_.upload(static_cast<float>(1.0 / grad_divisor), s);
  ensure_scratch(rows);
  layers_.loss(loss, *a.bufs, labels.empty() ? nullptr : labels_.data(),
               targets.empty() ? nullptr : targets_.data(),
               want_grad ? scratch_->out_grad.data() : nullptr, inv_divisor_.device(), *scratch_,
               stats_.data(), rows, s);
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(host_stats_.data(), stats_.data(), sizeof(DeviceLossStats),
                                   cudaMemcpyDeviceToHost, s));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(s));
  const DeviceLossStats d = host_stats_.data()[0];
  return LossStats{d.loss_sum, labels.empty() ? 0 : static_cast<std::int64_t>(d.correct), rows};
}

void CudaLayerOps::backward(detail::LayerActivations& base, std::span<const float>,
                            bool from_loss, bool accumulate, float* dx,
                            const GradsReadyFn& on_layer) {
  CudaActivations& a = dev(base);
  const int rows = a.rows_;
  const LayerRange r = range();
  cudaStream_t s = stream_.get();
  if (rows == 0) {  // nothing to add; a first contribution is zero
    if (!accumulate) {
      LOCUS_CUDA_CHECK(cudaMemsetAsync(dstate_.grads(), 0, dstate_.grads_bytes(), s));
    }
    for (int l = r.end - 1; l >= r.first && on_layer; --l) on_layer(l);
    return;
  }
  // prepare(training) sized the scratch; the loss's gradient is in it.
  LOCUS_ASSERT(scratch_ && scratch_->capacity >= rows, "backward of a batch prepared for inference");
  float* g = from_loss ? scratch_->out_grad.data() : a.bufs->grad_in.data();
  layers_.backward(params(), a.bufs->input.data(), *a.bufs, g, rows, accumulate, dx, *scratch_,
                   on_layer ? &on_layer : nullptr, s);
}

double CudaLayerOps::grad_sum_of_squares() {
  cudaStream_t s = stream_.get();
  cuda::grad_sum_of_squares(dstate_.grads(), dstate_.size(), norm_scratch_.data(),
                            device_sum_.data(), s);
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(host_sum_.data(), device_sum_.data(), sizeof(double),
                                   cudaMemcpyDeviceToHost, s));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(s));
  return host_sum_.data()[0];
}

void CudaLayerOps::update(double lr, float grad_scale) {
  cudaStream_t s = stream_.get();
  opt_scalars_.upload(dstate_.scalars(lr), s);
  grad_scale_upload_.upload(grad_scale, s);
  dstate_.issue_update(opt_scalars_.device(), grad_scale_upload_.device(), s);
  state_.optimizer->finish_step();
}

}  // namespace

std::unique_ptr<detail::LayerOps> make_cuda_layer_ops(const ComputeOptions& options,
                                                      const mpi::Comm& world, TrainState& state) {
  const DeviceInfo device = select_device(world, options.device);
  return std::make_unique<CudaLayerOps>(options, device, state);
}

}  // namespace locus::train::cuda
