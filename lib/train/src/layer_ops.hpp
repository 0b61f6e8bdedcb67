// Private to lib/train: what a compute backend does on a contiguous range of the model's
// layers -- forward, loss, backward (gradients written or accumulated over micro-batches), the
// gradient's sum of squares and the optimizer update -- with parameters, gradients and
// activations in the backend's memory. One implementation per backend (cpu/, cuda/) serves
// both the whole model (every layer, one batch: the cpu backend's Compute) and a pipeline
// stage (its layers, in micro-batches: the engine of pipeline/, whichever the backend).
//
// Buffers in the backend's memory are described as comm::GradientBuffer (pointer, length,
// memory space, the stream that orders them): what the gradient reducer and the stage link
// (comm/link.hpp) bind to. On a device backend every operation only enqueues work on that
// stream, except where a result comes back to the host (loss, grad_sum_of_squares).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "locus/comm/link.hpp"
#include "locus/comm/mpi.hpp"
#include "locus/comm/reducer.hpp"
#include "locus/train/compute.hpp"
#include "locus/train/model/backward.hpp"
#include "locus/train/model/forward.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/train_state.hpp"

namespace locus::train::detail {

// What one (micro-)batch leaves on the range between its forward and its backward, and the
// endpoints of its stage-to-stage transfers, in the backend's memory. Made by
// LayerOps::make_activations(), sized by LayerOps::prepare(); buffers keep their capacity
// between uses, so steady-state steps allocate nothing.
class LayerActivations {
 public:
  LayerActivations() = default;
  LayerActivations(const LayerActivations&) = delete;
  LayerActivations& operator=(const LayerActivations&) = delete;
  virtual ~LayerActivations() = default;

  int rows() const noexcept { return rows_; }
  // The range's input as received from the previous stage, [rows, input width] (prepared
  // with receives_input).
  virtual comm::GradientBuffer input() = 0;
  // The range's output after its activation, [rows, output width]: the logits when the range
  // ends at the model's last layer.
  virtual comm::GradientBuffer output() = 0;
  // d(loss)/d(output) as received from the next stage, [rows, output width] (prepared with
  // receives_grad).
  virtual comm::GradientBuffer grad_in() = 0;

 protected:
  int rows_ = 0;
};

// A float buffer in the backend's memory that grows on demand (the pipeline's input-gradient
// send buffers).
class LayerBuffer {
 public:
  LayerBuffer() = default;
  LayerBuffer(const LayerBuffer&) = delete;
  LayerBuffer& operator=(const LayerBuffer&) = delete;
  virtual ~LayerBuffer() = default;
  // Its first n floats (the buffer grows to hold them; contents are not kept when it grows).
  virtual comm::GradientBuffer view(std::size_t n) = 0;
};

class LayerOps {
 public:
  LayerOps() = default;
  LayerOps(const LayerOps&) = delete;
  LayerOps& operator=(const LayerOps&) = delete;
  virtual ~LayerOps() = default;

  // "cpu (OpenBLAS)", "cuda fp32 on ...": the backend's Compute::describe().
  virtual std::string describe() const = 0;
  // The layers this computes (model layer indices) and the model's widths.
  virtual LayerRange range() const noexcept = 0;
  // The range's gradients (ParamLayout elements [begin_of(range), end_of(range)), element 0 is
  // the first layer's weight), where they live and their stream: what a reducer binds to.
  virtual comm::GradientBuffer grads() noexcept = 0;

  virtual std::unique_ptr<LayerActivations> make_activations() const = 0;
  virtual std::unique_ptr<LayerBuffer> make_buffer() const = 0;
  // Collective over pp (duplicated): the stage link (comm/link.hpp) for buffers of this
  // backend's memory -- MPI for host memory, host-staged MPI for a device.
  virtual std::unique_ptr<comm::StageLink> make_link(const mpi::Comm& pp) const = 0;
  // Makes `a` hold a (micro-)batch of `rows` rows: the outputs of every layer of the range,
  // with `training` what backward needs, with receives_input / receives_grad the buffers the
  // transfers from the neighbouring stages land in. Returns the bytes of activations it keeps
  // (what the pipeline engine accounts).
  virtual std::size_t prepare(LayerActivations& a, int rows, bool receives_input,
                              bool receives_grad, bool training) = 0;

  // Forward of a.rows() rows. host_x: the range's input in host memory ([rows, input width],
  // from the loader: the first stage, or the whole model), which must stay unchanged until
  // the backward of `a`; empty: a.input() (received from the previous stage). Dropout
  // (training only) is keyed by the MODEL's layer index and key, so masks do not depend on
  // the cut.
  virtual void forward(LayerActivations& a, std::span<const float> host_x, bool training,
                       const DropoutKey& key) = 0;

  // The loss of the logits in a.output() (the range ends at the model's last layer), labels
  // and targets in host memory for a's rows (loss.hpp: labels for cross-entropy and for the
  // argmax hits of mse, targets for mse). want_grad: d(loss)/d(logits) / grad_divisor is kept
  // for the next backward(from_loss = true) of `a`. Returns the sums (waits for a device).
  virtual LossStats loss(LayerActivations& a, Loss loss, std::span<const std::int32_t> labels,
                         std::span<const float> targets, double grad_divisor,
                         bool want_grad) = 0;

  // Backward of the (micro-)batch in `a` whose forward read host_x (as given to forward()).
  // The gradient of the range's output is the loss's (from_loss) or a.grad_in(); it may be
  // overwritten. Parameter gradients are written into grads() (accumulate = false) or added
  // to it (accumulate = true). dx (backend memory, [rows, input width]; null at the model's
  // first layer) receives d(loss)/d(input). on_layer(l) (model layer index, last first)
  // follows each layer's final contribution (enqueued, on a device backend: grads().stream).
  // A batch of 0 rows adds nothing (written: zeros).
  virtual void backward(LayerActivations& a, std::span<const float> host_x, bool from_loss,
                        bool accumulate, float* dx, const GradsReadyFn& on_layer) = 0;

  // Sum of the squares of grads() in double (waits for a device).
  virtual double grad_sum_of_squares() = 0;
  // One optimizer step over the range at learning rate lr, reading grads() * grad_scale.
  virtual void update(double lr, float grad_scale) = 0;

  // Host <-> backend copies of the parameters and the optimizer state (no-ops on the host).
  virtual void sync_from_host() {}
  virtual void sync_to_host() {}
  // As Compute::before_host_waits (a pipeline stage's: its reducer's and its link's settle()).
  virtual void before_host_waits(std::function<void(void*)> settle) { (void)settle; }
  // Frees the buffers that grew during the step (a device backend keeps the old ones until
  // here: freeing them mid-step would wait for the whole device, the link's transfers in
  // flight included, which may wait for a peer that waits for this stage). Called once the
  // step's transfers are done; settles first where it frees anything.
  virtual void free_replaced() {}
};

// The layer operations of the backend options.backend names on the held layers of `state`
// (which must outlive them): its parameters and optimizer state (loaded into the backend's
// memory), a gradient buffer of the backend's own, update() steps state.optimizer's state and
// counter. ConfigError where the backend cannot run here (validate(options)). Collective over
// world (a device backend picks each rank's device): call it on every rank.
std::unique_ptr<LayerOps> make_layer_ops(const ComputeOptions& options, const mpi::Comm& world,
                                         TrainState& state);

}  // namespace locus::train::detail
