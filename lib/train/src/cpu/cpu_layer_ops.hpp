// Private to lib/train: the cpu backend's layer operations (layer_ops.hpp) -- OpenBLAS sgemms
// and the fused kernels of src/model, in the order of forward.cpp / backward.cpp, so a range
// of every layer computes the bits of the whole-model functions and one micro-batch on any cut
// the bits of the uncut model; weight gradients accumulate across micro-batches by sgemm with
// beta = 1.
#pragma once

#include <memory>
#include <span>

#include "layer_ops.hpp"
#include "locus/train/model/model.hpp"
#include "locus/train/train_state.hpp"

namespace locus::train::detail {

// The held layers of `state` (which must outlive the ops): its parameters in place, a
// gradient buffer of the ops' own, update() steps state.optimizer.
std::unique_ptr<LayerOps> make_cpu_layer_ops(TrainState& state);

// Layers `range` of a model of `spec` over the caller's buffers (their slice of the layout,
// host memory, outliving the ops): params read only, grads written. update() is an error
// (the caller steps its own optimizer).
std::unique_ptr<LayerOps> make_cpu_layer_ops(const ModelSpec& spec, LayerRange range,
                                             std::span<const float> params,
                                             std::span<float> grads);

}  // namespace locus::train::detail
