// Private to lib/train: one stage's slice of the MLP (layers [first, end) computed with the
// same sgemms and fused kernels as forward.cpp / backward.cpp, gradients accumulated over
// micro-batches) and the activations one micro-batch leaves on a stage until its backward.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "locus/train/model/forward.hpp"
#include "locus/train/pipeline/pipeline.hpp"

namespace locus::train::detail {

// What forward leaves for backward, plus the stage's transfer buffers of that micro-batch.
// Buffers keep their capacity between uses: steady-state steps allocate nothing.
struct ActivationSlot {
  int micro_batch = -1;
  int rows = 0;
  std::vector<float> input;               // stage > 0: the received activations [rows, w_first]
  std::vector<std::vector<float>> out;    // per stage layer: [rows, w_{l+1}] (post-activation)
  std::vector<std::vector<float>> deriv;  // per hidden gelu/tanh layer: act'(z) * dropout factor
  std::vector<float> grad_in;             // stage < last: received d(loss)/d(stage output)
  MPI_Request recv_input = MPI_REQUEST_NULL;
  MPI_Request send_output = MPI_REQUEST_NULL;
  MPI_Request recv_grad = MPI_REQUEST_NULL;
};

class StageModel {
 public:
  StageModel(const ModelSpec& spec, const StageRange& range, StageBuffers buffers);

  const StageRange& range() const noexcept { return range_; }
  int input_width() const noexcept { return width(range_.first_layer); }
  int output_width() const noexcept { return width(range_.end_layer); }
  bool has_input_grad() const noexcept { return range_.first_layer > 0; }
  bool holds_logits() const noexcept { return range_.end_layer == num_layers_; }

  // Makes slot hold micro-batch m of `rows` rows (grows its buffers; receive-side buffers only
  // where this stage receives). Returns the bytes of activations the micro-batch keeps.
  std::size_t prepare(ActivationSlot& slot, int m, int rows, bool receives_input,
                      bool receives_grad, bool training) const;

  // Forward of slot.rows rows of x ([rows, input_width()]) into slot.out (and slot.deriv when
  // training). Dropout is keyed by the MODEL's layer index, so masks match a 1-stage run.
  void forward(const float* x, ActivationSlot& slot, bool training, const DropoutKey& key) const;
  std::span<const float> output(const ActivationSlot& slot) const;

  // Backward of the micro-batch in slot, whose forward input was x. g is d(loss)/d(output):
  // d/d(logits) on the last stage, d/d(post-activation output) elsewhere; it is overwritten.
  // Gradients are written (accumulate = false) or added (accumulate = true) into the grads
  // buffer. dx (has_input_grad() only) receives d(loss)/d(x) [rows, input_width()].
  // on_layer(l) (model layer index, last first) follows each layer's final contribution.
  void backward(const float* x, ActivationSlot& slot, float* g, bool accumulate, float* dx,
                const std::function<void(int)>& on_layer) const;

 private:
  int width(int model_layer_boundary) const noexcept {
    return widths_[static_cast<std::size_t>(model_layer_boundary)];
  }
  // The stage's buffers hold the slice [range.begin, range.end): these take model offsets.
  const float* param(std::size_t model_offset) const noexcept {
    return buffers_.params.data() + (model_offset - range_.begin);
  }
  float* grad(std::size_t model_offset) const noexcept {
    return buffers_.grads.data() + (model_offset - range_.begin);
  }
  bool stores_deriv(int l) const noexcept;  // model layer l keeps act'(z) for backward
  // dZ of hidden model layer l from dH (in place) and its bias gradient.
  void through_activation(const ActivationSlot& slot, int l, float* g, bool accumulate) const;
  // Writes or adds the column sums held in bias_scratch_ into layer l's bias gradient.
  float* bias_target(int l, bool accumulate) const;
  void finish_bias(int l, bool accumulate) const;

  ModelSpec spec_;
  ParamLayout layout_;
  std::vector<int> widths_;
  int num_layers_ = 0;
  StageRange range_;
  StageBuffers buffers_;
  mutable std::vector<float> scratch_[2];  // back-propagated gradients inside the stage
  mutable std::vector<float> bias_scratch_;
};

}  // namespace locus::train::detail
