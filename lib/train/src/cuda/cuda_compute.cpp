// The CUDA compute backend for the whole model: parameters, gradients and optimizer state in
// one device buffer each (device_state.hpp: the CPU's layout, so a reduction bucket is still a
// slice); the layers' forward and backward (layers.hpp, the same device code a pipeline stage
// runs on its layers: cuda_layer_ops.cpp); the loss, clipping and optimizer as single passes;
// a step's two halves (forward+loss+backward, clip+update) replayed from captured CUDA graphs.
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
#include "cuda/device_state.hpp"
#include "cuda/host_bf16.hpp"
#include "cuda/kernels.hpp"
#include "cuda/layers.hpp"
#include "cuda/matmul.hpp"
#include "cuda/step_buffers.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train::cuda {

namespace {

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

// A batch's activations and the pass's scratch (the whole model: one of each).
struct StepBuffers {
  // bf16_input: the training passes get their inputs in bf16 (the slots' x_bf16).
  StepBuffers(const ModelSpec& spec, int capacity, bool training, bool bf16,
              bool bf16_input = false)
      : acts(spec, ParamLayout(spec.widths).all_layers(), capacity, training, bf16, false, false,
             bf16_input),
        scratch(spec, ParamLayout(spec.widths).all_layers(), capacity, training, bf16) {}
  LayerBuffers acts;
  PassScratch scratch;
};

class CudaCompute final : public Compute {
 public:
  CudaCompute(const ComputeOptions& options, const DeviceInfo& device, TrainState& state,
              Loss loss);
  ~CudaCompute() override;

  std::string_view name() const noexcept override { return "cuda"; }
  std::string describe() const override { return describe_backend(options_.precision, device_); }
  comm::GradientBuffer grads() noexcept override {
    return {dstate_.grads(), dstate_.size(), comm::MemorySpace::cuda, compute_.get()};
  }
  void forward_backward(const Batch& batch, std::uint64_t step, double grad_divisor,
                        const GradsReadyFn& on_grads_ready) override;
  void optimizer_step(double lr, double clip_max_norm) override;
  double last_grad_norm() override;
  double grad_squares() override;
  void drain_stats(std::vector<LossStats>& out) override;
  double input_wait_seconds() const noexcept override { return input_wait_s_; }
  bool defers_step_values() const noexcept override { return true; }
  void gate_updates(bool on) override;
  void request_step_values() override;
  double take_step_values(std::vector<LossStats>& out) override;
  LossStats evaluate(const Batch& batch) override;
  int sample_value_bytes() const noexcept override { return bf16() ? 2 : 4; }
  void cache_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols) override;
  void map_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols) override;
  HeldSamples held_samples() const override;
  void prefetch_inputs(const Batch& batch) override;
  void drop_prefetched() override;
  std::shared_ptr<HostMemory> host_memory() override {
    return std::make_shared<PinnedHostMemory>();
  }
  void sync_from_host() override;
  void sync_to_host() override;
  void before_host_waits(std::function<void(void*)> settle) override {
    settle_ = settle;
    matmul_.set_before_wait(std::move(settle));
  }

 private:
  const ParamLayout& layout() const noexcept { return state_.model.layout(); }
  int layers() const noexcept { return layout().num_layers(); }
  int input_width() const noexcept { return layout().input_width(); }
  int output_width() const noexcept { return layout().output_width(); }
  bool bf16() const noexcept { return options_.precision == Precision::bf16; }
  // Training batches come as resident row indices, gathered on the device (device cache or
  // loader.gather = device); at bf16 the rows are gathered in bf16, into the slots' x_bf16.
  bool resident_batches() const noexcept {
    return cached_x_.size() > 0 || cached_bf16_.size() > 0 || mapped_x_ != nullptr ||
           mapped_bf16_ != nullptr;
  }
  bool bf16_inputs() const noexcept {
    return cached_bf16_.size() > 0 || mapped_bf16_ != nullptr;
  }
  DeviceParams device_params() const noexcept {
    return {dstate_.params(), dstate_.params_bf16(), dstate_.grads(), 0};
  }

  void ensure_capacity(int rows);
  void check_labels(const Batch& batch) const;
  // Copies the batch's inputs into slot on copy_ (after the slot's last reader), recording
  // slot.copied; forward_backward() makes compute_ wait for it.
  void upload_inputs(const Batch& batch, InputSlot& slot);
  static const void* identity(const Batch& b) noexcept {
    return b.x.empty() ? static_cast<const void*>(b.resident_rows.data()) : b.x.data();
  }
  // The step's first half on compute_ (capturable): inputs of slot -> grads_, loss -> stats_.
  // ready (may be null): called for each layer, last first, as soon as its gradient work is
  // enqueued (eager steps: a reducer starts on it while the layers below still compute).
  void issue_pass(StepBuffers& w, const InputSlot& slot, int rows, bool training,
                  const GradsReadyFn* ready = nullptr);
  void issue_update(bool clip);
  // Runs `issue` from a graph captured for `key` once it has run eagerly twice (cuBLASLt
  // chooses its algorithms on first use, which a capture must not include).
  template <class Issue>
  void run_graph(std::map<std::uint64_t, std::pair<int, GraphExec>>& graphs, std::uint64_t key,
                 Issue&& issue);
  void store_stats(int rows);
  void take_pending_stats(std::vector<LossStats>& out);
  // Adds the first `steps` timed input waits to input_wait_s_ (their events are complete) and
  // keeps the rest, recorded for a step whose LossStats are not stored yet.
  void take_input_waits(std::size_t steps);

  ComputeOptions options_;
  DeviceInfo device_;
  TrainState& state_;
  Loss loss_;
  Stream compute_, copy_;
  Matmul matmul_;
  std::size_t n_ = 0;  // parameters
  // Parameters, gradients, optimizer state; the host state page-locked while this backend
  // lives (the only stall of a background checkpoint is the device -> host copy).
  DeviceState dstate_;
  DeviceLayers layers_;
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
  // The device cache: the rank's resident rows, batches gathered from it by index; at bf16
  // their bf16 conversion instead (half the memory, no conversion per step).
  DeviceBuffer<float> cached_x_;
  DeviceBuffer<__nv_bfloat16> cached_bf16_;
  // loader.gather = device: the loader's resident block, page-locked in place (registered_,
  // unregistered last) and read by the device through mapped_x_; at bf16 its bf16 copy instead
  // (staged_bf16_, read through mapped_bf16_), half the bytes over the host link. A block that
  // something else page-locked already is copied into staged_x_ (mapped_x_ then points there).
  void* registered_ = nullptr;
  const float* mapped_x_ = nullptr;
  MappedBuffer<float> staged_x_;
  MappedBuffer<__nv_bfloat16> staged_bf16_;
  const __nv_bfloat16* mapped_bf16_ = nullptr;
  bool scale_is_one_ = false;
  // Loss sums of the steps not yet drained: pinned ring filled by D2H copies on compute_.
  PinnedBuffer<DeviceLossStats> stats_ring_;
  std::vector<std::int64_t> pending_rows_;
  std::vector<LossStats> overflow_;
  Event stats_copied_;  // after the latest copy into stats_ring_
  // The compute stream's stall for each step's inputs: from `begin`, recorded on it where it
  // waits for the slot, to `complete`, recorded on the copy stream after the slot's copies
  // (the slot's `arrived`); none when the inputs were complete first. Timing the wait itself
  // (an event on each side of it) counts the wait's and the events' own cost as data wait:
  // run 8 (an H200) read a constant 2-3 us a step in device-cached runs, loader included, of
  // which that cost is the suspect. One pair a step not yet taken (at most kStatsRing + 1),
  // spare timing events for reuse, and the sum so far.
  struct InputWait {
    Event begin, complete;
  };
  Event timing_event();  // a spare one, or a new one
  std::vector<InputWait> input_waits_;
  std::vector<Event> spare_timing_;
  double input_wait_s_ = 0;
  std::function<void(void*)> settle_;  // before_host_waits()
  // The step values of request_step_values(): the reduced gradient's sum of squares (also the
  // update's gate when gate_ is on), its pinned host copy and the event that marks both.
  DeviceBuffer<double> step_squares_;
  PinnedBuffer<double> step_squares_host_;
  Event values_ready_;
  bool gate_ = false;
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
      dstate_(state, options.precision == Precision::bf16),
      layers_(state.model.spec(), state.model.layout().all_layers(), options.precision, matmul_),
      grad_scale_(1),
      norm_(1),
      norm_scratch_(grad_norm_scratch(n_)),
      stats_(1),
      stats_ring_(kStatsRing),
      stats_copied_(make_event()),
      step_squares_(1),
      step_squares_host_(1),
      values_ready_(make_event()) {
  LOCUS_ASSERT(state.model.whole(),
               "the whole-model cuda backend trains whole models (a pipeline stage runs on "
               "cuda_layer_ops)");
  matmul_.set_measure(options.measure_gemms);
  sync_from_host();
}

CudaCompute::~CudaCompute() {
  // Work may still be queued: let it finish before the buffers go (never throw here).
  if (compute_) cudaStreamSynchronize(compute_.get());
  if (copy_) cudaStreamSynchronize(copy_.get());
  if (registered_ != nullptr) cudaHostUnregister(registered_);
  // A non-sticky error here would otherwise be reported by the next backend's first launch
  // check (cudaPeekAtLastError) in this process.
  cudaGetLastError();
}

void CudaCompute::sync_from_host() { dstate_.sync_from_host(compute_.get()); }

void CudaCompute::sync_to_host() { dstate_.sync_to_host(compute_.get()); }

void CudaCompute::cache_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols) {
  LOCUS_ASSERT(cols == input_width() && x.size() == static_cast<std::size_t>(rows * cols),
               "the cached block must be rows x input width");
  LOCUS_ASSERT(!resident_batches(), "a dataset is cached once, and not beside a mapped one");
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(copy_.get()));
  if (bf16()) {
    // Converted on the host exactly as the device would each batch (host_bf16.hpp), through a
    // page-locked staging buffer of at most 32 MiB (cudaMemcpy from it returns once copied).
    cached_bf16_ = DeviceBuffer<__nv_bfloat16>(x.size());
    constexpr std::size_t kChunk = std::size_t{1} << 24;
    PinnedBuffer<std::uint16_t> staging(std::min(kChunk, x.size()));
    for (std::size_t at = 0; at < x.size(); at += kChunk) {
      const std::size_t n = std::min(kChunk, x.size() - at);
      to_bf16_host(x.data() + at, staging.data(), n);
      LOCUS_CUDA_CHECK(cudaMemcpy(cached_bf16_.data() + at, staging.data(),
                                  n * sizeof(std::uint16_t), cudaMemcpyHostToDevice));
    }
  } else {
    cached_x_ = DeviceBuffer<float>(x.size());
    LOCUS_CUDA_CHECK(
        cudaMemcpy(cached_x_.data(), x.data(), x.size_bytes(), cudaMemcpyHostToDevice));
  }
  // From pageable memory cudaMemcpy may return before its DMA has landed, and the streams
  // that read the cache are not ordered after the legacy stream's copy.
  LOCUS_CUDA_CHECK(cudaDeviceSynchronize());
  // The slots and graphs are made again for the batches' new form at the next step.
  pass_graphs_.clear();
  slots_.clear();
  slot_capacity_ = 0;
}

void CudaCompute::map_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols) {
  LOCUS_ASSERT(cols == input_width() && x.size() == static_cast<std::size_t>(rows * cols),
               "the mapped block must be rows x input width");
  LOCUS_ASSERT(!resident_batches(), "a dataset is mapped once, and not beside a device cache");
  LOCUS_ASSERT(slot_capacity_ == 0, "a dataset is mapped before the first step");
  if (x.empty()) return;  // a rank without rows has no batches to gather
  auto refuse = [&](cudaError_t rc, std::string_view call) {
    cudaGetLastError();  // not sticky: clear it, or the next launch check would report it
    throw ConfigError(fmt::format(
        "loader.gather = device: {} of the {:.1f} MiB of samples this rank holds failed on "
        "device {}: {}{}; set loader.gather = host",
        call, static_cast<double>(x.size_bytes()) / (1 << 20), device_.index,
        cudaGetErrorString(rc),
        rc == cudaErrorHostMemoryAlreadyRegistered
            ? " (part of it is page-locked already: by the MPI library's CUDA transport, or "
              "a page it shares with a buffer this process page-locked)"
            : ""));
  };
  if (bf16()) {
    // The GEMMs read bf16 inputs: convert the rows once, exactly as the device would each
    // batch (host_bf16.hpp), into page-locked mapped memory, so a batch crosses the host link
    // in half the bytes. Costs host memory of half the block, beside the loader's.
    try {
      staged_bf16_ = MappedBuffer<__nv_bfloat16>(x.size());
    } catch (const CudaError& e) {
      cudaGetLastError();  // not sticky: clear it, or the next launch check would report it
      throw ConfigError(fmt::format(
          "loader.gather = device at train.precision = bf16 keeps a page-locked bf16 copy of "
          "the samples this rank holds ({:.1f} MiB), which could not be allocated: {}; set "
          "loader.gather = host, or raise the locked-memory limit (ulimit -l)",
          static_cast<double>(x.size() * sizeof(__nv_bfloat16)) / (1 << 20), e.what()));
    }
    to_bf16_host(x.data(), reinterpret_cast<std::uint16_t*>(staged_bf16_.data()), x.size());
    void* device = nullptr;
    if (const cudaError_t rc = cudaHostGetDevicePointer(&device, staged_bf16_.data(), 0);
        rc != cudaSuccess) {
      refuse(rc, "cudaHostGetDevicePointer");
    }
    mapped_bf16_ = static_cast<const __nv_bfloat16*>(device);
    return;
  }
  void* host = const_cast<float*>(x.data());  // the device only reads it
  // Plain mapped registration: cudaHostRegisterReadOnly is for pages the process itself maps
  // read-only, which this heap block is not.
  if (const cudaError_t rc = cudaHostRegister(host, x.size_bytes(), cudaHostRegisterMapped);
      rc == cudaErrorHostMemoryAlreadyRegistered) {
    // Some of it is page-locked already -- a CUDA-aware MPI transport registers the host
    // buffers of its transfers (the global shuffle's all-gather filled this one) and keeps
    // them registered until they are unmapped; CUDA locks whole pages, so a heap neighbour this
    // process page-locked (the TrainState's buffers) may hold its first or last page -- with
    // flags and a range this backend does not know. Gather from a mapped copy of the block
    // instead, at the cost of its size.
    cudaGetLastError();  // not sticky: clear it, or the next launch check would report it
    try {
      staged_x_ = MappedBuffer<float>(x.size());
    } catch (const CudaError& e) {
      cudaGetLastError();
      refuse(rc, fmt::format("cudaHostRegister (and a page-locked copy: {})", e.what()));
    }
    std::copy(x.begin(), x.end(), staged_x_.data());
    host = staged_x_.data();
  } else if (rc != cudaSuccess) {
    refuse(rc, "cudaHostRegister");
  } else {
    registered_ = host;  // unregistered by the destructor, whatever happens next
  }
  void* device = nullptr;
  if (const cudaError_t rc = cudaHostGetDevicePointer(&device, host, 0); rc != cudaSuccess)
    refuse(rc, "cudaHostGetDevicePointer");
  mapped_x_ = static_cast<const float*>(device);
}

Compute::HeldSamples CudaCompute::held_samples() const {
  constexpr const char* kOverLink = "gathered by the GPU over the host link";
  if (cached_bf16_.size() > 0) {
    return {"cached on the GPU as bf16", cached_bf16_.size() * sizeof(__nv_bfloat16), ""};
  }
  if (cached_x_.size() > 0) return {"cached on the GPU", cached_x_.size() * sizeof(float), ""};
  if (mapped_bf16_ != nullptr) {
    return {fmt::format("{} from a page-locked bf16 copy", kOverLink),
            staged_bf16_.size() * sizeof(__nv_bfloat16), ""};
  }
  if (mapped_x_ != nullptr && registered_ != nullptr) {
    return {fmt::format("{}, page-locked in place", kOverLink), 0, ""};
  }
  if (mapped_x_ != nullptr) {
    return {fmt::format("{} from a page-locked copy", kOverLink), staged_x_.size() * sizeof(float),
            "part of the block was page-locked already (by the MPI library's CUDA transport, or "
            "a page it shares with a buffer this process page-locked)"};
  }
  return {};
}

void CudaCompute::ensure_capacity(int rows) {
  // A first step without rows on this rank still needs its slots (capacity 1).
  if (!slots_.empty() && rows <= slot_capacity_) return;
  if (!slots_.empty() && settle_) settle_(compute_.get());  // it may wait for a reduction
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(copy_.get()));
  const int capacity = std::max(rows, 1);
  pass_graphs_.clear();  // they captured the old buffers' addresses
  slots_.clear();
  for (int i = 0; i < 2; ++i) {
    slots_.emplace_back(capacity, input_width(), output_width(), loss_ == Loss::mse,
                        bf16_inputs());
  }
  train_ws_.emplace(state_.model.spec(), capacity, true, bf16(), bf16_inputs());
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
  if (resident_batches()) {
    LOCUS_ASSERT(b.x.empty() && b.resident_rows.size() == static_cast<std::size_t>(b.rows),
                 "a cached or mapped dataset's batches come as resident row indices");
    h2d(slot.resident_rows.data(), b.resident_rows.data(), b.resident_rows.size_bytes());
  } else {
    h2d(slot.x.data(), b.x.data(), b.x.size_bytes());
  }
  h2d(slot.labels.data(), b.labels.data(), b.labels.size_bytes());
  if (state_.model.spec().dropout > 0.0f) {
    h2d(slot.sample_ids.data(), b.sample_ids.data(), b.sample_ids.size_bytes());
  }
  if (loss_ == Loss::mse) h2d(slot.targets.data(), b.targets.data(), b.targets.size_bytes());
  // The host batch is read by the copies above only: the loader may reuse it after them, while
  // a gather from mapped host memory may still run.
  LOCUS_CUDA_CHECK(cudaEventRecord(slot.uploaded.get(), s));
  if (resident_batches()) {
    // Mapped: the rows straight from host memory, on the copy stream while the previous step
    // computes; a capped grid leaves the compute kernels most of the SMs. A quarter of them:
    // on an H200 (132 SMs; locus_gather_bench, bench/RESULTS.md run 8) 32 blocks moved as many
    // GB/s as 66 or all (45-47, the link 51-54), and slowed a loop of GEMMs beside them by
    // 24-28% where 66 slowed it by 40-57%; 16 blocks moved 35. Measured on the H200 only.
    const int cap = std::max(8, device_.multiprocessors / 4);
    if (mapped_x_ != nullptr) {
      gather_rows(mapped_x_, slot.resident_rows.data(), slot.x.data(), b.rows, input_width(),
                  nullptr, nullptr, s, cap);
    } else if (mapped_bf16_ != nullptr) {
      gather_bf16_rows(mapped_bf16_, slot.resident_rows.data(), slot.x_bf16.data(), b.rows,
                       input_width(), s, cap);
    }
  }
  // The time the slot was complete, recorded before `copied`: a stream past its wait on
  // `copied` has passed this too, so the event is complete wherever the step's stats are.
  if (!slot.arrived) slot.arrived = timing_event();  // unless its last upload was never read
  LOCUS_CUDA_CHECK(cudaEventRecord(slot.arrived.get(), s));
  LOCUS_CUDA_CHECK(cudaEventRecord(slot.copied.get(), s));
}

Event CudaCompute::timing_event() {
  if (spare_timing_.empty()) return make_timing_event();
  Event e = std::move(spare_timing_.back());
  spare_timing_.pop_back();
  return e;
}

// The slot the next forward_backward() uses; its previous reader (two steps back) is waited
// for on copy_, not here.
void CudaCompute::prefetch_inputs(const Batch& b) {
  if (b.rows <= 0 || b.rows > slot_capacity_) return;  // a new capacity would synchronise
  InputSlot& slot = slots_[passes_ % 2];
  upload_inputs(b, slot);
  slot.prefetched = identity(b);
  slot.prefetched_rows = b.rows;
}

void CudaCompute::drop_prefetched() {
  for (InputSlot& slot : slots_) {
    if (slot.prefetched == nullptr) continue;
    LOCUS_CUDA_CHECK(cudaEventSynchronize(slot.uploaded.get()));
    slot.prefetched = nullptr;
    slot.prefetched_rows = -1;
  }
}

void CudaCompute::issue_pass(StepBuffers& w, const InputSlot& slot, int rows, bool training,
                             const GradsReadyFn* ready) {
  cudaStream_t s = compute_.get();
  const ModelSpec& spec = state_.model.spec();
  const float* x = slot.x.data();
  if (training && cached_x_.size() > 0) {  // the batch's rows from the device cache
    gather_rows(cached_x_.data(), slot.resident_rows.data(), slot.x.data(), rows, input_width(),
                nullptr, nullptr, s);
  } else if (training && cached_bf16_.size() > 0) {
    gather_bf16_rows(cached_bf16_.data(), slot.resident_rows.data(), slot.x_bf16.data(), rows,
                     input_width(), s);
  }
  DropoutArgs dropout;
  dropout.p = spec.dropout;
  dropout.seed = spec.seed;
  dropout.step = &pass_scalars_.device()->step;
  dropout.sample_ids = slot.sample_ids.data();
  // Training batches of a bf16 cached or mapped dataset are in bf16 now (evaluation's come as
  // fp32 from the host).
  const __nv_bfloat16* x_bf16 = training && bf16_inputs() ? slot.x_bf16.data() : nullptr;
  const DeviceParams p = device_params();
  layers_.forward(p, x, rows, w.acts, training, dropout, s, x_bf16);
  float* dlogits = training ? w.scratch.out_grad.data() : nullptr;
  layers_.loss(loss_, w.acts, slot.labels.data(), slot.targets.data(), dlogits,
               &pass_scalars_.device()->inv_divisor, w.scratch, stats_.data(), rows, s);
  if (training) {
    layers_.backward(p, x, w.acts, dlogits, rows, false, nullptr, w.scratch, ready, s, x_bf16);
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
  if (pending_rows_.size() == kStatsRing) {
    // Nobody drained for a long time: keep them. Waits for the last copy only, not for the
    // stream: that copy (the previous step's) follows the update before it, whose all-reduce
    // the reducer has waited for already (polling its peers), while the stream goes on to the
    // previous step's update, which waits for that step's all-reduce -- unwatched, were this
    // a wait for the stream and a peer dead.
    LOCUS_CUDA_CHECK(cudaEventSynchronize(stats_copied_.get()));
    std::vector<LossStats> kept;
    take_pending_stats(kept);  // the overflow so far, then the ring's
    overflow_ = std::move(kept);
  }
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(stats_ring_.data() + pending_rows_.size(), stats_.data(),
                                   sizeof(DeviceLossStats), cudaMemcpyDeviceToHost,
                                   compute_.get()));
  LOCUS_CUDA_CHECK(cudaEventRecord(stats_copied_.get(), compute_.get()));
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
  if (slot.prefetched != identity(batch) || slot.prefetched_rows != rows) upload_inputs(batch, slot);
  slot.prefetched = nullptr;
  slot.prefetched_rows = -1;
  // The wait for the inputs, timed on the device: how long the compute stream stalled there.
  LOCUS_ASSERT(slot.arrived, "a step's input slot was never uploaded");
  input_waits_.push_back(InputWait{timing_event(), std::move(slot.arrived)});
  try {  // a step that fails leaves no pair behind: each pair belongs to a step's LossStats
    LOCUS_CUDA_CHECK(cudaEventRecord(input_waits_.back().begin.get(), compute_.get()));
    LOCUS_CUDA_CHECK(cudaStreamWaitEvent(compute_.get(), slot.copied.get(), 0));
    if (rows == 0) {
      LOCUS_CUDA_CHECK(
          cudaMemsetAsync(dstate_.grads(), 0, dstate_.grads_bytes(), compute_.get()));
      LOCUS_CUDA_CHECK(
          cudaMemsetAsync(stats_.data(), 0, sizeof(DeviceLossStats), compute_.get()));
    } else if (!options_.graphs) {  // eager: each layer announced as its work is enqueued
      issue_pass(*train_ws_, slot, rows, true, &on_grads_ready);
      announced = true;
    } else {
      run_graph(pass_graphs_, (static_cast<std::uint64_t>(rows) << 1) | parity,
                [&] { issue_pass(*train_ws_, slot, rows, true); });
    }
    LOCUS_CUDA_CHECK(cudaEventRecord(slot.consumed.get(), compute_.get()));
    store_stats(rows);  // its stats pushed last: nothing after that can fail in it
  } catch (...) {
    spare_timing_.push_back(std::move(input_waits_.back().begin));
    input_waits_.pop_back();  // its copy-side event goes with it: the slot is uploaded again
    throw;
  }
  // The gradients' work is enqueued: announce every layer (a reducer orders itself after it
  // on grads().stream). Inside a graph the layers cannot be announced one by one.
  if (on_grads_ready && !announced) {
    for (int l = layers() - 1; l >= 0; --l) on_grads_ready(l);
  }
  // The loader may reuse the batch's host memory once we return (not waiting for a gather
  // from mapped host memory, which reads the samples, not the batch).
  LOCUS_CUDA_CHECK(cudaEventSynchronize(slot.uploaded.get()));
}

void CudaCompute::issue_update(bool clip) {
  cudaStream_t s = compute_.get();
  if (clip) {
    grad_norm_and_scale(dstate_.grads(), n_, options_clip_, norm_scratch_.data(), norm_.data(),
                        grad_scale_.data(), s);
  }
  dstate_.issue_update(opt_scalars_.device(), grad_scale_.data(), s,
                       gate_ ? step_squares_.data() : nullptr);
}

void CudaCompute::gate_updates(bool on) {
  if (on == gate_) return;
  gate_ = on;
  update_graphs_.clear();  // they captured the other gate
}

void CudaCompute::request_step_values() {
  cudaStream_t s = compute_.get();
  grad_sum_of_squares(dstate_.grads(), n_, norm_scratch_.data(), step_squares_.data(), s);
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(step_squares_host_.data(), step_squares_.data(),
                                   sizeof(double), cudaMemcpyDeviceToHost, s));
  LOCUS_CUDA_CHECK(cudaEventRecord(values_ready_.get(), s));
}

// Waits for the event of request_step_values() only: the update queued after it may still run.
// The stats copies of the steps since the last drain were queued before it on the same stream.
double CudaCompute::take_step_values(std::vector<LossStats>& out) {
  LOCUS_CUDA_CHECK(cudaEventSynchronize(values_ready_.get()));
  take_pending_stats(out);
  return step_squares_host_.data()[0];
}

void CudaCompute::optimizer_step(double lr, double clip_max_norm) {
  opt_scalars_.upload(dstate_.scalars(lr), compute_.get());
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

// The sum of squares of the reduced gradient (finish() ordered compute_ after the reduction),
// in the blocks and order of the clipping kernel, into norm_ (a clipped update rewrites it).
double CudaCompute::grad_squares() {
  grad_sum_of_squares(dstate_.grads(), n_, norm_scratch_.data(), norm_.data(), compute_.get());
  double sum = 0;
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(&sum, norm_.data(), sizeof(sum), cudaMemcpyDeviceToHost,
                                   compute_.get()));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  return sum;
}

void CudaCompute::drain_stats(std::vector<LossStats>& out) {
  if (!pending_rows_.empty()) LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
  take_pending_stats(out);
}

// The stats of the steps whose copies have completed (the caller waited for them).
void CudaCompute::take_pending_stats(std::vector<LossStats>& out) {
  take_input_waits(pending_rows_.size());
  out.insert(out.end(), overflow_.begin(), overflow_.end());
  overflow_.clear();
  for (std::size_t i = 0; i < pending_rows_.size(); ++i) {
    const DeviceLossStats& d = stats_ring_.data()[i];
    out.push_back(LossStats{d.loss_sum, static_cast<std::int64_t>(d.correct), pending_rows_[i]});
  }
  pending_rows_.clear();
}

// Each step records its input wait before its LossStats: the waits of the steps stored so far
// are complete wherever their stats are (the caller waited for those), a step's own may not be.
// A negative time (the inputs were complete before the stream reached its wait) is no wait.
// Every time is read before anything changes: a failed read leaves the pairs as they were.
void CudaCompute::take_input_waits(std::size_t steps) {
  steps = std::min(steps, input_waits_.size());
  double waited = 0;
  for (std::size_t i = 0; i < steps; ++i) {
    float ms = 0;
    LOCUS_CUDA_CHECK(
        cudaEventElapsedTime(&ms, input_waits_[i].begin.get(), input_waits_[i].complete.get()));
    waited += std::max(0.0, static_cast<double>(ms) * 1e-3);
  }
  input_wait_s_ += waited;
  for (std::size_t i = 0; i < steps; ++i) {
    spare_timing_.push_back(std::move(input_waits_[i].begin));
    spare_timing_.push_back(std::move(input_waits_[i].complete));
  }
  input_waits_.erase(input_waits_.begin(),
                     input_waits_.begin() + static_cast<std::ptrdiff_t>(steps));
}

LossStats CudaCompute::evaluate(const Batch& batch) {
  const int rows = batch.rows;
  LossStats stats;
  stats.rows = rows;
  if (rows == 0) return stats;
  check_labels(batch);
  if (!eval_ws_ || eval_ws_->acts.capacity < rows) {
    LOCUS_CUDA_CHECK(cudaStreamSynchronize(compute_.get()));
    eval_ws_.emplace(state_.model.spec(), rows, false, bf16());
    eval_slot_.reset();
    eval_slot_.emplace(rows, input_width(), output_width(), loss_ == Loss::mse, false);
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
