// The compute backend of the training loop: forward, loss, backward, the optimizer update
// (with global-norm clipping) and scoring, behind a small interface chosen once at start-up
// (cpu: OpenBLAS and the fused kernels of src/model; cuda: cuBLASLt and the kernels of
// src/cuda, parameters on the device). The loop itself never branches on the backend.
//
// Asynchronous backends. A device backend only enqueues work: forward_backward() and
// optimizer_step() return before the device is done, and nothing in a step waits for the
// device. What the loop needs back -- the loss sums of each step, the gradient norm -- stays
// on the device until drain_stats() / last_grad_norm() fetch it (one wait per log interval,
// not per step). The CPU backend is the same interface with nothing deferred.
//
// Host and device copies of the state. The TrainState (host) is authoritative between
// Trainer calls: sync_from_host() loads it into the backend before training or scoring,
// sync_to_host() copies the backend's state back for checkpoints and model files. The CPU
// backend trains the TrainState in place, so both are no-ops there.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/comm/reducer.hpp"
#include "locus/train/model/backward.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/model/precision.hpp"
#include "locus/train/train_state.hpp"

namespace locus::train {

struct HostMemory;  // data/loader.hpp
class Compute;

// Precision (fp32 | tf32 | bf16): locus/train/model/precision.hpp.

struct ComputeOptions {
  std::string backend = "cpu";  // "cpu" | "cuda"
  Precision precision = Precision::fp32;
  int device = -1;              // cuda: -1 = node-local rank modulo the visible devices
  bool graphs = true;           // cuda: replay each step shape from a captured CUDA graph
  bool measure_gemms = true;    // cuda: time cuBLASLt's candidates once per shape (matmul.hpp)
  // Tests only: builds the whole-model backend in place of make_compute()'s choice by name
  // (`backend` is still validated), e.g. the cpu backend behind a model of a device's
  // asynchronous input copies (tests/train/test_trainer_prefetch.cpp). Pipeline stages refuse
  // it (they build layer operations, not a Compute). Null: by name.
  std::function<std::unique_ptr<Compute>(TrainState&, Loss)> factory;
};

// ConfigError naming what this build and host have when the backend cannot run here (cuda in
// a build without CUDA or on a host without a device; a precision the cpu backend lacks).
void validate(const ComputeOptions& options);

// Which backends this build has and this host can run ("cpu", "cuda (1 device: ...)"), for
// messages.
std::string available_backends();

class Compute {
 public:
  Compute() = default;
  Compute(const Compute&) = delete;
  Compute& operator=(const Compute&) = delete;
  virtual ~Compute() = default;

  virtual std::string_view name() const noexcept = 0;
  // What computes, for the start-up line and checkpoint provenance: "cpu (OpenBLAS)", or
  // "cuda fp32 on NVIDIA H100 80GB HBM3 (cc 9.0), CUDA runtime 13000, driver 13000, cuBLASLt
  // 130000".
  virtual std::string describe() const = 0;

  // The gradient buffer (as many floats as the state's model.params(): the whole layout, or a
  // pipeline stage's layers), where it lives and the stream that writes it: what the gradient
  // reducer binds to. Valid for the backend's lifetime.
  virtual comm::GradientBuffer grads() noexcept = 0;

  // forward + loss + backward of this rank's rows of one global batch into grads(), calling
  // on_grads_ready(l) for l = layers-1 .. 0 as each layer's gradient work has been issued
  // (done on a host backend; enqueued on grads().stream on a device backend: see
  // comm::GradientBuffer). loss.hpp has the grad_divisor convention. For mse, batch.targets
  // are the targets; correct counts argmax hits against batch.labels whenever labels are
  // given. The step's LossStats are kept for drain_stats().
  virtual void forward_backward(const Batch& batch, std::uint64_t step, double grad_divisor,
                                const GradsReadyFn& on_grads_ready) = 0;

  // One optimizer step over the whole buffer at learning rate lr, after the gradients are
  // reduced. clip_max_norm > 0 first clips the gradient's global L2 norm to it (the factor is
  // applied inside the optimizer's pass, as clip.hpp describes).
  virtual void optimizer_step(double lr, double clip_max_norm) = 0;

  // The gradient norm of the last optimizer_step() that clipped; -1 before any (waits for the
  // device on a device backend).
  virtual double last_grad_norm() = 0;

  // The sum of squares of grads() after the gradient reduction (in double, fixed order): the
  // anomaly detector's gradient norm, taken before optimizer_step(). Host buffers are read
  // directly; a device backend computes it on the device and waits for it.
  virtual double grad_squares();

  // The LossStats of every forward_backward() since the last call, in step order, appended to
  // out (waits for the device on a device backend).
  virtual void drain_stats(std::vector<LossStats>& out) = 0;

  // Seconds the device's compute waited for training inputs in flight -- a batch's copy to the
  // device, or its gather from mapped host memory -- over the steps whose LossStats were taken
  // so far (drain_stats(), take_step_values()): the data wait the loader's next() does not see.
  // 0 on a host backend, whose compute waits only in next().
  virtual double input_wait_seconds() const noexcept { return 0.0; }

  // The anomaly detector's step values without a wait for the whole step (a device backend):
  // request_step_values() after the reduction enqueues grad_squares() and sends it and the
  // step's LossStats on their way to the host; gate_updates(true) makes optimizer_step() skip
  // its update ON THE DEVICE when that sum of squares is not finite; take_step_values() then
  // waits for those values only (the update may still run) and returns the sum of squares,
  // the LossStats going to out as drain_stats() would. So the host judges a step while its
  // update runs, and a diverged step still leaves the state before it. Backends that do not
  // defer (the default: defers_step_values() false) compute both when taken.
  virtual bool defers_step_values() const noexcept { return false; }
  virtual void gate_updates(bool) {}
  virtual void request_step_values() {}
  virtual double take_step_values(std::vector<LossStats>& out);

  // A device backend starts copying the inputs of `batch` -- what the next forward_backward()
  // gets -- while the current step computes, and forward_backward() then finds them there.
  // The batch's memory must stay as it is until then (Loader::peek() gives such a batch).
  // drop_prefetched() waits for such a copy and forgets it: call it before the loader may
  // reuse that memory (start_epoch(), the end of training). No-ops on a host backend.
  virtual void prefetch_inputs(const Batch&) {}
  virtual void drop_prefetched() {}

  // Loss and argmax hits of the current parameters on a batch, without dropout (synchronous).
  virtual LossStats evaluate(const Batch& batch) = 0;

  // Keeps x (rows x cols, row-major: the loader's resident block) in the backend's memory for
  // the rest of its life; batches then come as Batch::resident_rows instead of x. ConfigError
  // from a backend without such a cache, or when it does not fit.
  virtual void cache_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols);
  // Bytes a feature takes where the backend keeps the samples of cache_dataset() or its copy
  // of map_dataset()'s (4; a backend whose GEMMs read a narrower type may keep them so).
  virtual int sample_value_bytes() const noexcept { return 4; }
  // loader.gather = device: x (the loader's resident block, rows x cols, which outlives the
  // backend and never moves) is page-locked and mapped into the device's address space; batches
  // then come as Batch::resident_rows and the device gathers their rows from host memory over
  // the host link, ahead of their step; a backend whose first GEMM reads a narrower type (bf16)
  // may page-lock a converted copy instead, read in fewer bytes. ConfigError from a backend
  // without a device, or when the memory cannot be page-locked.
  virtual void map_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols);
  // What the backend holds of the samples given to cache_dataset() or map_dataset(), read from
  // its buffers (not from its options): the start-up line 'data:' says where they went.
  struct HeldSamples {
    std::string where;        // e.g. "cached on the GPU as bf16"; empty: nothing held
    std::uint64_t bytes = 0;  // the backend's copy; 0 where it reads the loader's block in place
    std::string why;          // why it holds a copy it would not otherwise need (or empty)
  };
  virtual HeldSamples held_samples() const { return {}; }

  // Where the loader should put its batch buffers so this backend copies them at full speed
  // and asynchronously (page-locked memory on a device backend); null: the ordinary heap.
  virtual std::shared_ptr<HostMemory> host_memory() { return nullptr; }

  // Loads the TrainState's parameters and optimizer state into the backend (host -> device).
  virtual void sync_from_host() {}
  // Makes the TrainState's parameters and optimizer state current (device -> host).
  virtual void sync_to_host() {}

  // settle(stream) waits, watching their peers, for what the backend's stream may wait for
  // from other ranks (the trainer's: its reducer's settle()). A device backend calls it before
  // a host wait of its own inside a step -- its buffers growing for a larger batch, the first
  // GEMM of a new shape (a short last batch, an evaluation batch) timing cuBLASLt's
  // candidates -- so a peer that died then ends the job in the reducer's NcclError, not in a
  // wait inside CUDA. Host backends: ignored.
  virtual void before_host_waits(std::function<void(void*)> settle) { (void)settle; }
};

// The backend options.backend names; ConfigError naming what this build and host have
// otherwise (e.g. cuda in a build without CUDA, or on a host without a device). The backend
// trains state.model / state.optimizer (which must outlive it) with `loss`. Collective over
// world only in what it agrees on: call it on every rank.
std::unique_ptr<Compute> make_compute(const ComputeOptions& options, const mpi::Comm& world,
                                      TrainState& state, Loss loss);

// Rows whose argmax over `classes` outputs equals the label.
std::int64_t count_correct(std::span<const float> outputs, int rows, int classes,
                           std::span<const std::int32_t> labels) noexcept;

}  // namespace locus::train
