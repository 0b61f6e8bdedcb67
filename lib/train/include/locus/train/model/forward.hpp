// The forward pass and the workspace that holds its activations: everything inference needs
// (no optimizer, no backward). Activations are row-major [batch, features].
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "locus/train/model/model.hpp"

namespace locus::train {

namespace detail {
struct WorkspaceAccess;
}

// inference: keeps only the layer outputs. training: also keeps what backward needs (the
// activation derivative of each hidden layer for gelu/tanh, the output gradient and scratch).
enum class Mode { inference, training };

// Preallocated buffers for batches of up to max_batch rows, so a training step allocates
// nothing. One workspace per thread; it remembers the input of the last forward_train (the
// caller keeps that input alive and unchanged until backward returns).
class Workspace {
 public:
  Workspace(const Mlp& model, int max_batch, Mode mode = Mode::training);

  int max_batch() const noexcept { return max_batch_; }
  Mode mode() const noexcept { return mode_; }
  int batch() const noexcept { return batch_; }  // rows of the last forward
  // Output of layer l (0-based) for the last forward: [batch(), widths[l + 1]]; for hidden
  // layers this is after activation and dropout, for the last layer it is the logits.
  std::span<const float> layer_output(int l) const;
  std::span<const float> output() const { return layer_output(num_layers() - 1); }
  // Training mode: where the loss writes d(loss)/d(logits), [batch(), output width].
  std::span<float> output_grad();

 private:
  friend struct detail::WorkspaceAccess;
  int num_layers() const noexcept { return static_cast<int>(widths_.size()) - 1; }

  std::vector<int> widths_;
  int max_batch_ = 0;
  Mode mode_ = Mode::training;
  int batch_ = 0;
  std::span<const float> input_;            // x of the last forward_train
  std::vector<std::vector<float>> out_;     // per layer [max_batch, widths[l + 1]]
  std::vector<std::vector<float>> deriv_;   // per hidden layer: act'(z) * dropout scale/mask
  std::vector<float> out_grad_;             // [max_batch, output width]
  std::vector<float> scratch_[2];           // back-propagated gradients, ping-pong
};

// Identifies the dropout masks of one batch: mask element (layer l, row r, unit j) is a pure
// function of (spec.seed, step, l, sample_ids[r], j) -- see dropout.hpp. Passing the global
// sample ids makes masks independent of how a global batch is split across ranks, and resume
// needs no RNG state. Ignored (sample_ids may be empty) when spec.dropout == 0.
struct DropoutKey {
  std::uint64_t step = 0;
  std::span<const std::uint64_t> sample_ids;
};

// Inference forward (no dropout): x is [batch, input width] row-major, batch <= max_batch.
// Returns the logits [batch, output width], a view into ws valid until its next forward.
std::span<const float> forward(const Mlp& model, std::span<const float> x, int batch,
                               Workspace& ws);

// Training forward: as forward(), plus dropout and what backward() needs. ws must be a
// training workspace; x must outlive the following backward().
std::span<const float> forward_train(const Mlp& model, std::span<const float> x, int batch,
                                     Workspace& ws, const DropoutKey& dropout = {});

}  // namespace locus::train
