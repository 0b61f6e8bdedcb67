// The compute backend of the training loop: forward, loss, backward, the optimizer update and
// scoring, behind a small interface chosen once at start-up (CPU/OpenBLAS now; a GPU backend
// later keeps its parameters on the device and copies them back in sync_to_host()). The loop
// itself never branches on the backend.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "locus/train/model/backward.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/train_state.hpp"

namespace locus::train {

class Compute {
 public:
  Compute() = default;
  Compute(const Compute&) = delete;
  Compute& operator=(const Compute&) = delete;
  virtual ~Compute() = default;

  virtual std::string_view name() const noexcept = 0;

  // The gradient buffer (as many floats as the state's model.params(): the whole layout, or a
  // pipeline stage's layers, where the backend computes): what the gradient reducer binds to.
  // Valid for the backend's lifetime.
  virtual std::span<float> grads() noexcept = 0;

  // forward + loss + backward of this rank's rows of one global batch into grads(), calling
  // on_grads_ready(l) for l = layers-1 .. 0 as each layer's gradient is final (loss.hpp has the
  // grad_divisor convention). For mse, batch.targets are the targets; correct counts argmax
  // hits against batch.labels whenever labels are given.
  virtual LossStats forward_backward(const Batch& batch, std::uint64_t step,
                                     double grad_divisor, const GradsReadyFn& on_grads_ready) = 0;

  // L2 norm of grads() (after the reduction every rank holds the whole gradient).
  virtual double grad_norm() = 0;

  // One optimizer step over the whole buffer with grads() * grad_scale at learning rate lr.
  virtual void optimizer_step(double lr, float grad_scale) = 0;

  // Loss and argmax hits of the current parameters on a batch, without dropout.
  virtual LossStats evaluate(const Batch& batch) = 0;

  // Makes the TrainState's parameters and optimizer state current (for checkpoints and model
  // files). The CPU backends work on them in place; a device backend copies them back.
  virtual void sync_to_host() {}
};

// The backend for `name` ("cpu"); ConfigError naming the available ones otherwise. The backend
// trains state.model / state.optimizer (which must outlive it) with `loss`.
std::unique_ptr<Compute> make_compute(std::string_view name, TrainState& state, Loss loss);

// Rows whose argmax over `classes` outputs equals the label.
std::int64_t count_correct(std::span<const float> outputs, int rows, int classes,
                           std::span<const std::int32_t> labels) noexcept;

}  // namespace locus::train
