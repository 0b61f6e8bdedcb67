// The CUDA compute backend: parameters, gradients and optimizer state in one device buffer
// each (the CPU's layout, so a reduction bucket is still a slice); per layer a cuBLASLt GEMM
// and one fused epilogue kernel; the loss, clipping and optimizer as single passes; a step's
// two halves (forward+loss+backward, clip+update) replayed from captured CUDA graphs.
//
// Streams: `compute_` runs the step; `copy_` brings each batch from the loader's host memory
// into an input slot (two slots, so the copy of batch k+1 overlaps step k). Nothing waits for
// the device inside a step except for the host-side guarantee the loader needs: a batch's host
// memory is free again when forward_backward() returns (the copy has completed; it waited only
// for step k-2 to release the slot, so step k-1 and k stay queued on the device).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "cuda/cuda_compute.hpp"
#include "cuda/device.hpp"
#include "cuda/kernels.hpp"
#include "cuda/matmul.hpp"
#include "cuda/step_buffers.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train::cuda {

namespace {

std::size_t sz(int a, int b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); }

// Largest power of two (<= 256) that divides the address: cuBLASLt picks algorithms by it.
int alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % static_cast<std::uintptr_t>(align) != 0) align /= 2;
  return align;
}

// The loader's batch buffers in page-locked memory, so upload_inputs() copies them
// asynchronously at full PCIe speed. Portable: allocated and freed from any thread.
class PinnedHostMemory final : public HostMemory {
 public:
  void* allocate(std::size_t bytes) override {
    void* p = nullptr;
    const cudaError_t rc = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (rc != cudaSuccess) out_of_memory(rc, bytes, true);
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override { cudaFreeHost(p); }
};

// Per-step values of forward_backward the captured graph reads from device memory.
struct PassScalars {
  std::uint64_t step;
  float inv_divisor;
};

class CudaCompute final : public Compute {
 public:
  CudaCompute(const ComputeOptions& options, const DeviceInfo& device, TrainState& state,
              Loss loss);
  ~CudaCompute() override;

  std::string_view name() const noexcept override { return "cuda"; }
  std::string describe() const override {
    return fmt::format("cuda {} on {} ({:.1f} GiB, cc {}.{}), CUDA runtime {}, driver {}, {}",
                       to_string(options_.precision), device_.name, device_.memory_gib,
                       device_.major, device_.minor, device_.runtime_version,
                       device_.driver_version, Matmul::version());
  }
  comm::GradientBuffer grads() noexcept override {
    return {grads_.data(), grads_.size(), comm::MemorySpace::cuda, compute_.get()};
  }
  void forward_backward(const Batch& batch, std::uint64_t step, double grad_divisor,
                        const GradsReadyFn& on_grads_ready) override;
  void optimizer_step(double lr, double clip_max_norm) override;
  double last_grad_norm() override;
  double grad_squares() override;
  void drain_stats(std::vector<LossStats>& out) override;
  LossStats evaluate(const Batch& batch) override;
  void cache_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols) override;
  std::shared_ptr<HostMemory> host_memory() override {
    return std::make_shared<PinnedHostMemory>();
  }
  void sync_from_host() override;
  void sync_to_host() override;

 private:
  const ParamLayout& layout() const noexcept { return state_.model.layout(); }
  int layers() const noexcept { return layout().num_layers(); }
  int input_width() const noexcept { return layout().input_width(); }
  int output_width() const noexcept { return layout().output_width(); }
  bool bf16() const noexcept { return options_.precision == Precision::bf16; }
  Act act_of(int l) const noexcept {
    return l + 1 == layers() ? Act::none : static_cast<Act>(state_.model.spec().activation);
  }
  bool keeps_deriv() const noexcept {
    return state_.model.spec().activation != Activation::relu;
  }
  const void* weight_operand(int l) const noexcept {
    const std::size_t off = layout().layer(l).weight_offset;
    if (bf16()) return params_bf16_.data() + off;
    return params_.data() + off;
  }

  void ensure_capacity(int rows);
  void check_labels(const Batch& batch) const;
  void upload_inputs(const Batch& batch, InputSlot& slot);
  // The step's first half on compute_ (capturable): inputs of slot -> grads_, loss -> stats_.
  // ready (may be null): called for each layer, last first, as soon as its gradient work is
  // enqueued (eager steps: a reducer starts on it while the layers below still compute).
  void issue_pass(StepBuffers& w, const InputSlot& slot, int rows, bool training,
                  const GradsReadyFn* ready = nullptr);
  void issue_backward(StepBuffers& w, const void* x_op, int rows, const GradsReadyFn* ready);
  void issue_update(bool clip);
  void gemm(int m, int n, int k, bool ta, bool tb, const void* a, int lda, const void* b, int ldb,
            float* d, int ldd);
  // Runs `issue` from a graph captured for `key` once it has run eagerly twice (cuBLASLt
  // chooses its algorithms on first use, which a capture must not include).
  template <class Issue>
  void run_graph(std::map<std::uint64_t, std::pair<int, GraphExec>>& graphs, std::uint64_t key,
                 Issue&& issue);
  void store_stats(int rows);

  ComputeOptions options_;
  DeviceInfo device_;
  TrainState& state_;
  // The host state page-locked while this backend lives: sync_to_host()/sync_from_host() copy
  // at full speed (the only stall of a background checkpoint is that copy).
  std::vector<HostRegistration> registered_;
  Loss loss_;
  Stream compute_, copy_;
  Matmul matmul_;
  std::size_t n_ = 0;  // parameters
  DeviceBuffer<float> params_, grads_, state_a_, state_b_;
  DeviceBuffer<__nv_bfloat16> params_bf16_;
  ScalarUpload<PassScalars> pass_scalars_;
  ScalarUpload<OptimizerScalars> opt_scalars_;
  DeviceBuffer<float> grad_scale_;
  DeviceBuffer<double> norm_, norm_scratch_;
  DeviceBuffer<DeviceLossStats> stats_;
  std::optional<StepBuffers> train_ws_, eval_ws_;
  std::vector<InputSlot> slots_;
  int slot_capacity_ = 0;
  std::uint64_t passes_ = 0;  // forward_backward calls: the slot parity
  std::map<std::uint64_t, std::pair<int, GraphExec>> pass_graphs_, update_graphs_;
  bool clipped_ = false;
  double options_clip_ = 0;  // this step's clip_max_norm (issue_update)
  std::optional<InputSlot> eval_slot_;
  // The device cache: the rank's resident rows, batches gathered from it by index.
  DeviceBuffer<float> cached_x_;
  std::int64_t cached_rows_ = 0;
  bool scale_is_one_ = false;
  // Loss sums of the steps not yet drained: pinned ring filled by D2H copies on compute_.
  PinnedBuffer<DeviceLossStats> stats_ring_;
  std::vector<std::int64_t> pending_rows_;
  std::vector<LossStats> overflow_;
};

constexpr std::size_t kStatsRing = 4096;

CudaCompute::CudaCompute(const ComputeOptions& options, const DeviceInfo& device,
                         TrainState& state, Loss loss)
    : options_(options),
      device_(device),
      state_(state),
      loss_(loss),
      compute_(make_stream()),
      copy_(make_stream()),
      matmul_(options.precision),
      n_(state.model.params().size()),
      params_(n_),
      grads_(n_),
      grad_scale_(1),
      norm_(1),
      norm_scratch_(grad_norm_scratch(n_)),
      stats_(1),
      stats_ring_(kStatsRing) {
  LOCUS_ASSERT(state.model.whole(), "the cuda backend trains whole models (no pipeline stage)");
  const auto opt_state = state.optimizer->state();
  if (!opt_state.empty()) state_a_ = DeviceBuffer<float>(n_);
  if (opt_state.size() > 1) state_b_ = DeviceBuffer<float>(n_);
  if (bf16()) params_bf16_ = DeviceBuffer<__nv_bfloat16>(n_);
  registered_.emplace_back(state.model.params().data(), state.model.params().size_bytes());
  for (const auto& s : opt_state) registered_.emplace_back(s.data.data(), s.data.size_bytes());
  sync_from_host();
}

CudaCompute::~CudaCompute() {
  // Work may still be queued: let it finish before the buffers go (never throw here).
  if (compute_) cudaStreamSynchronize(compute_.get());
  if (copy_) cudaStreamSynchronize(copy_.get());
}

void CudaCompute::sync_from_host() {
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  LOCUS_CUDA_CHECK(cudaMemcpy(params_.data(), state_.model.params().data(), params_.bytes(),
                              cudaMemcpyHostToDevice));
  const auto st = std::as_const(*state_.optimizer).state();
  DeviceBuffer<float>* targets[2] = {&state_a_, &state_b_};
  for (std::size_t i = 0; i < st.size() && i < 2; ++i) {
    LOCUS_CUDA_CHECK(cudaMemcpy(targets[i]->data(), st[i].data.data(), targets[i]->bytes(),
                                cudaMemcpyHostToDevice));
  }
  if (bf16()) to_bf16(params_.data(), params_bf16_.data(), n_, compute_.get());
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
}

void CudaCompute::sync_to_host() {
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  LOCUS_CUDA_CHECK(cudaMemcpy(state_.model.params().data(), params_.data(), params_.bytes(),
                              cudaMemcpyDeviceToHost));
  auto st = state_.optimizer->state();
  const DeviceBuffer<float>* sources[2] = {&state_a_, &state_b_};
  for (std::size_t i = 0; i < st.size() && i < 2; ++i) {
    LOCUS_CUDA_CHECK(cudaMemcpy(st[i].data.data(), sources[i]->data(), sources[i]->bytes(),
                                cudaMemcpyDeviceToHost));
  }
}

void CudaCompute::cache_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols) {
  LOCUS_ASSERT(cols == input_width() && x.size() == static_cast<std::size_t>(rows * cols),
               "the cached block must be rows x input width");
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  cached_x_ = DeviceBuffer<float>(x.size());
  LOCUS_CUDA_CHECK(cudaMemcpy(cached_x_.data(), x.data(), x.size_bytes(), cudaMemcpyHostToDevice));
  cached_rows_ = rows;
  pass_graphs_.clear();
}

void CudaCompute::ensure_capacity(int rows) {
  if (rows <= slot_capacity_) return;
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(copy_.get()));
  const int capacity = std::max(rows, 1);
  pass_graphs_.clear();  // they captured the old buffers' addresses
  slots_.clear();
  for (int i = 0; i < 2; ++i) {
    slots_.emplace_back(capacity, input_width(), output_width(), loss_ == Loss::mse);
  }
  train_ws_.emplace(layout().widths(), capacity, true, keeps_deriv(), bf16());
  slot_capacity_ = capacity;
}

void CudaCompute::check_labels(const Batch& b) const {
  const int classes = output_width();
  for (int r = 0; r < b.rows && !b.labels.empty(); ++r) {
    const std::int32_t label = b.labels[static_cast<std::size_t>(r)];
    if (label < 0 || label >= classes) {
      throw DataError(fmt::format("label {} of batch row {} is outside [0, {}): the dataset's "
                                  "labels must match the model's output width",
                                  label, r, classes));
    }
  }
}

void CudaCompute::upload_inputs(const Batch& b, InputSlot& slot) {
  cudaStream_t s = copy_.get();
  LOCUS_CUDA_CHECK(cudaStreamWaitEvent(s, slot.consumed.get(), 0));
  auto h2d = [&](void* dst, const void* src, std::size_t bytes) {
    if (bytes > 0) LOCUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  };
  if (cached_x_.size() > 0) {
    LOCUS_ASSERT(b.x.empty() && b.resident_rows.size() == static_cast<std::size_t>(b.rows),
                 "a cached dataset's batches come as resident row indices");
    h2d(slot.resident_rows.data(), b.resident_rows.data(), b.resident_rows.size_bytes());
  } else {
    h2d(slot.x.data(), b.x.data(), b.x.size_bytes());
  }
  h2d(slot.labels.data(), b.labels.data(), b.labels.size_bytes());
  if (state_.model.spec().dropout > 0.0f) {
    h2d(slot.sample_ids.data(), b.sample_ids.data(), b.sample_ids.size_bytes());
  }
  if (loss_ == Loss::mse) h2d(slot.targets.data(), b.targets.data(), b.targets.size_bytes());
  LOCUS_CUDA_CHECK(cudaEventRecord(slot.copied.get(), s));
  LOCUS_CUDA_CHECK(cudaStreamWaitEvent(compute_.get(), slot.copied.get(), 0));
}

void CudaCompute::gemm(int m, int n, int k, bool ta, bool tb, const void* a, int lda,
                       const void* b, int ldb, float* d, int ldd) {
  GemmShape s;
  s.m = m;
  s.n = n;
  s.k = k;
  s.trans_a = ta;
  s.trans_b = tb;
  s.lda = lda;
  s.ldb = ldb;
  s.ldd = ldd;
  s.align_a = alignment_of(a);
  s.align_b = alignment_of(b);
  s.align_d = alignment_of(d);
  matmul_.run(s, a, b, d, nullptr, compute_.get());
}

void CudaCompute::issue_pass(StepBuffers& w, const InputSlot& slot, int rows, bool training,
                             const GradsReadyFn* ready) {
  cudaStream_t s = compute_.get();
  const ModelSpec& spec = state_.model.spec();
  const float* x = slot.x.data();
  if (training && cached_x_.size() > 0) {  // the batch's rows from the device cache
    gather_rows(cached_x_.data(), slot.resident_rows.data(), slot.x.data(), rows, input_width(),
                nullptr, nullptr, s);
  }
  const void* x_op = x;
  if (bf16()) {
    to_bf16(x, w.x_bf16.data(), sz(rows, input_width()), s);
    x_op = w.x_bf16.data();
  }
  DropoutArgs dropout;
  dropout.enabled = training && spec.dropout > 0.0f;
  dropout.p = spec.dropout;
  dropout.seed = spec.seed;
  dropout.step = &pass_scalars_.device()->step;
  dropout.sample_ids = slot.sample_ids.data();
  const void* in_op = x_op;
  for (int l = 0; l < layers(); ++l) {
    const LayerLayout& ly = layout().layer(l);
    float* z = w.out[static_cast<std::size_t>(l)].data();
    // Z^T (out x rows) = op_T(W) (W stored [out, in] row-major = in x out column-major) X^T.
    gemm(ly.out, rows, ly.in, true, false, weight_operand(l), ly.in, in_op, ly.in, z, ly.out);
    dropout.layer = l;
    const bool hidden = l + 1 < layers();
    __nv_bfloat16* out_bf16 = hidden && bf16() ? w.out_bf16[static_cast<std::size_t>(l)].data() : nullptr;
    float* deriv = training && hidden ? w.deriv[static_cast<std::size_t>(l)].data() : nullptr;
    bias_act_forward(z, deriv, out_bf16, params_.data() + ly.bias_offset, rows, ly.out, act_of(l),
                     hidden ? dropout : DropoutArgs{}, s);
    in_op = bf16() ? static_cast<const void*>(out_bf16) : static_cast<const void*>(z);
  }
  const float* logits = w.out.back().data();
  const float* inv = &pass_scalars_.device()->inv_divisor;
  float* dlogits = training ? w.out_grad.data() : nullptr;
  if (loss_ == Loss::softmax_cross_entropy) {
    softmax_cross_entropy(logits, slot.labels.data(), dlogits, inv, w.row_scratch.data(),
                          stats_.data(), rows, output_width(), s);
  } else {
    mean_squared_error(logits, slot.targets.data(), slot.labels.data(), dlogits, inv,
                       w.row_scratch.data(), stats_.data(), rows, output_width(), s);
  }
  if (training) issue_backward(w, x_op, rows, ready);
}

void CudaCompute::issue_backward(StepBuffers& w, const void* x_op, int rows,
                                 const GradsReadyFn* ready) {
  cudaStream_t s = compute_.get();
  const float p = state_.model.spec().dropout;
  const float relu_scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
  float* dz = w.out_grad.data();
  const int L = layers();
  column_sums(dz, grads_.data() + layout().layer(L - 1).bias_offset, w.column_scratch.data(),
              rows, output_width(), s);
  if (bf16()) to_bf16(dz, w.dz_bf16.data(), sz(rows, output_width()), s);
  for (int l = L - 1; l >= 0; --l) {
    const LayerLayout& ly = layout().layer(l);
    const void* dz_op = bf16() ? static_cast<const void*>(w.dz_bf16.data()) : dz;
    const void* in_op = l == 0 ? x_op
                        : bf16() ? static_cast<const void*>(w.out_bf16[static_cast<std::size_t>(l) - 1].data())
                                 : static_cast<const void*>(w.out[static_cast<std::size_t>(l) - 1].data());
    // dW^T (in x out) = X^T (in x rows) op_T(dZ^T) (dZ row-major [rows, out] = out x rows).
    gemm(ly.in, ly.out, rows, false, true, in_op, ly.in, dz_op, ly.out,
         grads_.data() + ly.weight_offset, ly.in);
    // Layer l is complete: its bias gradient was summed before (from dz).
    if (ready != nullptr && *ready) (*ready)(l);
    if (l == 0) break;
    // dX^T (in x rows) = W^T (in x out) dZ^T (out x rows).
    float* dx = w.scratch[l % 2].data();
    gemm(ly.in, rows, ly.out, false, false, weight_operand(l), ly.in, dz_op, ly.out, dx, ly.in);
    const auto below = static_cast<std::size_t>(l) - 1;
    const float* deriv = w.deriv[below].size() > 0 ? w.deriv[below].data() : nullptr;
    act_backward(dx, deriv, w.out[below].data(), relu_scale,
                 bf16() ? w.dz_bf16.data() : nullptr, rows, ly.in, s);
    column_sums(dx, grads_.data() + layout().layer(l - 1).bias_offset, w.column_scratch.data(),
                rows, ly.in, s);
    dz = dx;
  }
}

template <class Issue>
void CudaCompute::run_graph(std::map<std::uint64_t, std::pair<int, GraphExec>>& graphs,
                            std::uint64_t key, Issue&& issue) {
  constexpr std::size_t kMaxGraphs = 16;
  if (!options_.graphs) {
    issue();
    return;
  }
  auto& [runs, exec] = graphs[key];
  if (exec) {
    LOCUS_CUDA_CHECK(cudaGraphLaunch(exec.get(), compute_.get()));
    return;
  }
  if (runs < 2 || graphs.size() > kMaxGraphs) {  // warm-up, or too many shapes: eager
    ++runs;
    issue();
    return;
  }
  cudaGraph_t raw = nullptr;
  LOCUS_CUDA_CHECK(cudaStreamBeginCapture(compute_.get(), cudaStreamCaptureModeThreadLocal));
  try {
    issue();
  } catch (...) {
    cudaStreamEndCapture(compute_.get(), &raw);
    if (raw != nullptr) cudaGraphDestroy(raw);
    throw;
  }
  LOCUS_CUDA_CHECK(cudaStreamEndCapture(compute_.get(), &raw));
  Graph graph(raw);
  cudaGraphExec_t instance = nullptr;
  LOCUS_CUDA_CHECK(cudaGraphInstantiate(&instance, graph.get(), 0));
  exec = GraphExec(instance);
  LOCUS_CUDA_CHECK(cudaGraphLaunch(exec.get(), compute_.get()));
}

void CudaCompute::store_stats(int rows) {
  if (pending_rows_.size() == kStatsRing) {  // nobody drained for a long time: keep them
    std::vector<LossStats> out;
    drain_stats(out);
    overflow_.insert(overflow_.end(), out.begin(), out.end());
  }
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(stats_ring_.data() + pending_rows_.size(), stats_.data(),
                                   sizeof(DeviceLossStats), cudaMemcpyDeviceToHost,
                                   compute_.get()));
  pending_rows_.push_back(rows);
}

void CudaCompute::forward_backward(const Batch& batch, std::uint64_t step, double grad_divisor,
                                   const GradsReadyFn& on_grads_ready) {
  const int rows = batch.rows;
  check_labels(batch);
  ensure_capacity(rows);
  InputSlot& slot = slots_[passes_ % 2];
  const std::uint64_t parity = passes_ % 2;
  ++passes_;
  bool announced = false;
  pass_scalars_.upload(PassScalars{step, static_cast<float>(1.0 / grad_divisor)}, compute_.get());
  upload_inputs(batch, slot);
  if (rows == 0) {
    LOCUS_CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, grads_.bytes(), compute_.get()));
    LOCUS_CUDA_CHECK(cudaMemsetAsync(stats_.data(), 0, sizeof(DeviceLossStats), compute_.get()));
  } else if (!options_.graphs) {  // eager: each layer announced as its work is enqueued
    issue_pass(*train_ws_, slot, rows, true, &on_grads_ready);
    announced = true;
  } else {
    run_graph(pass_graphs_, (static_cast<std::uint64_t>(rows) << 1) | parity,
              [&] { issue_pass(*train_ws_, slot, rows, true); });
  }
  LOCUS_CUDA_CHECK(cudaEventRecord(slot.consumed.get(), compute_.get()));
  store_stats(rows);
  // The gradients' work is enqueued: announce every layer (a reducer orders itself after it
  // on grads().stream). Inside a graph the layers cannot be announced one by one.
  if (on_grads_ready && !announced) {
    for (int l = layers() - 1; l >= 0; --l) on_grads_ready(l);
  }
  // The loader may reuse the batch's host memory once we return.
  LOCUS_CUDA_CHECK(cudaEventSynchronize(slot.copied.get()));
}

void CudaCompute::issue_update(bool clip) {
  cudaStream_t s = compute_.get();
  if (clip) {
    grad_norm_and_scale(grads_.data(), n_, options_clip_, norm_scratch_.data(), norm_.data(),
                        grad_scale_.data(), s);
  }
  __nv_bfloat16* p16 = bf16() ? params_bf16_.data() : nullptr;
  const OptimizerOptions& o = state_.optimizer->options();
  if (o.kind == OptimizerKind::sgd) {
    SgdConfig c;
    c.weight_decay = static_cast<float>(o.weight_decay);
    c.momentum = static_cast<float>(o.momentum);
    c.nesterov = o.nesterov;
    sgd_update(params_.data(), grads_.data(), state_a_.size() > 0 ? state_a_.data() : nullptr,
               p16, n_, c, opt_scalars_.device(), grad_scale_.data(), s);
  } else {
    AdamConfig c;
    c.weight_decay = static_cast<float>(o.weight_decay);
    c.decoupled = o.kind == OptimizerKind::adamw;
    c.beta1 = o.beta1;
    c.beta2 = o.beta2;
    c.eps = o.eps;
    adam_update(params_.data(), grads_.data(), state_a_.data(), state_b_.data(), p16, n_, c,
                opt_scalars_.device(), grad_scale_.data(), s);
  }
}

void CudaCompute::optimizer_step(double lr, double clip_max_norm) {
  const OptimizerOptions& o = state_.optimizer->options();
  // The scalars exactly as optim/sgd.cpp and optim/adam.cpp compute theirs.
  OptimizerScalars sc{};
  const std::int64_t steps = state_.optimizer->steps();
  sc.neg_lr = static_cast<float>(-lr);
  sc.first_step = steps == 0 ? 1 : 0;
  sc.grad_coef = steps == 0 ? 1.0f : static_cast<float>(1.0 - o.dampening);
  const double t = static_cast<double>(steps + 1);
  sc.decay_factor = static_cast<float>(1.0 - lr * o.weight_decay);
  sc.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, t)));
  sc.neg_step_size = static_cast<float>(-lr / (1.0 - std::pow(o.beta1, t)));
  opt_scalars_.upload(sc, compute_.get());
  const bool clip = clip_max_norm > 0;
  options_clip_ = clip_max_norm;
  if (!clip && !scale_is_one_) {
    // On compute_ (a non-blocking stream, which a plain cudaMemcpy would not wait for), so a
    // previous clipped update still reading the factor is not overtaken.
    static constexpr float kOne = 1.0f;
    LOCUS_CUDA_CHECK(cudaMemcpyAsync(grad_scale_.data(), &kOne, sizeof(kOne),
                                     cudaMemcpyHostToDevice, compute_.get()));
    scale_is_one_ = true;
  }
  if (clip) scale_is_one_ = false;
  run_graph(update_graphs_, clip ? 1 : 0, [&] { issue_update(clip); });
  clipped_ = clipped_ || clip;
  state_.optimizer->finish_step();
}

double CudaCompute::last_grad_norm() {
  if (!clipped_) return -1;
  double norm = 0;
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(&norm, norm_.data(), sizeof(norm), cudaMemcpyDeviceToHost,
                                   compute_.get()));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  return norm;
}

// The clipping kernel without clipping (max_norm 0 writes a scale of 1, which a clipped update
// recomputes): the norm of the reduced gradient (finish() ordered compute_ after it), squared.
double CudaCompute::grad_squares() {
  grad_norm_and_scale(grads_.data(), n_, 0.0, norm_scratch_.data(), norm_.data(),
                      grad_scale_.data(), compute_.get());
  double norm = 0;
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(&norm, norm_.data(), sizeof(norm), cudaMemcpyDeviceToHost,
                                   compute_.get()));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  return norm * norm;
}

void CudaCompute::drain_stats(std::vector<LossStats>& out) {
  out.insert(out.end(), overflow_.begin(), overflow_.end());
  overflow_.clear();
  if (pending_rows_.empty()) return;
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  for (std::size_t i = 0; i < pending_rows_.size(); ++i) {
    const DeviceLossStats& d = stats_ring_.data()[i];
    out.push_back(LossStats{d.loss_sum, static_cast<std::int64_t>(d.correct), pending_rows_[i]});
  }
  pending_rows_.clear();
}

LossStats CudaCompute::evaluate(const Batch& batch) {
  const int rows = batch.rows;
  LossStats stats;
  stats.rows = rows;
  if (rows == 0) return stats;
  check_labels(batch);
  if (!eval_ws_ || eval_ws_->capacity < rows) {
    LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
    eval_ws_.emplace(layout().widths(), rows, false, keeps_deriv(), bf16());
    eval_slot_.reset();
    eval_slot_.emplace(rows, input_width(), output_width(), loss_ == Loss::mse);
  }
  InputSlot& slot = *eval_slot_;
  cudaStream_t s = compute_.get();
  auto h2d = [&](void* dst, const void* src, std::size_t bytes) {
    if (bytes > 0) LOCUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s));
  };
  h2d(slot.x.data(), batch.x.data(), batch.x.size_bytes());
  h2d(slot.labels.data(), batch.labels.data(), batch.labels.size_bytes());
  if (loss_ == Loss::mse) h2d(slot.targets.data(), batch.targets.data(), batch.targets.size_bytes());
  pass_scalars_.upload(PassScalars{0, 1.0f}, s);
  issue_pass(*eval_ws_, slot, rows, false);
  DeviceLossStats d{};
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(&d, stats_.data(), sizeof(d), cudaMemcpyDeviceToHost, s));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(s));
  stats.loss_sum = d.loss_sum;
  stats.correct = loss_ == Loss::mse && batch.labels.empty() ? 0 : d.correct;
  return stats;
}

}  // namespace

std::unique_ptr<Compute> make_cuda_compute(const ComputeOptions& options, const mpi::Comm& world,
                                           TrainState& state, Loss loss) {
  const DeviceInfo device = select_device(world, options.device);
  return std::make_unique<CudaCompute>(options, device, state, loss);
}

}  // namespace locus::train::cuda
