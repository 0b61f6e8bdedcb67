// Back-propagation through the MLP, layer by layer from the last, announcing each layer's
// finished gradient slice so a reducer can all-reduce it while earlier layers compute.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "locus/train/model/forward.hpp"
#include "locus/train/model/loss.hpp"

namespace locus::train {

// Called with layer index l (num_layers()-1 down to 0) as soon as the gradients of layer l's
// weight and bias -- the slice [layout.layer(l).begin(), end()) of grads -- are final and
// backward no longer reads layer l's parameters: the callback may all-reduce that slice in
// place (blocking, or start a non-blocking reduction it completes later), and may even apply
// the optimizer to layer l (Optimizer::update) when no clipping needs the whole gradient.
using GradsReadyFn = std::function<void(int layer)>;

// Parameter gradients of the batch last run through forward_train(model, ..., ws), given
// ws.output_grad() filled by a loss (which already applied the 1/grad_divisor, see loss.hpp).
// grads (layout.size() floats) is OVERWRITTEN, not accumulated: no zeroing pass is needed.
// A batch of 0 rows yields zero gradients (a rank with no rows still joins the all-reduce).
void backward(const Mlp& model, Workspace& ws, std::span<float> grads,
              const GradsReadyFn& on_grads_ready = {});

// One batch for forward_backward(): x [rows, input width]; labels (cross-entropy) or targets
// [rows, output width] (mse); the global sample ids of the rows (needed only with dropout).
struct Batch {
  std::span<const float> x;
  int rows = 0;
  std::span<const std::int32_t> labels;
  std::span<const float> targets;
  std::span<const std::uint64_t> sample_ids;
  // A backend that caches the dataset (Compute::cache_dataset) gathers x itself: then x is
  // empty and each row's index in the cached block is given instead.
  std::span<const std::int64_t> resident_rows;
};

// forward_train + loss + backward for one step. grad_divisor is the GLOBAL batch size in
// data-parallel training (see loss.hpp); step keys the dropout masks.
LossStats forward_backward(const Mlp& model, Workspace& ws, Loss loss, const Batch& batch,
                           std::uint64_t step, double grad_divisor, std::span<float> grads,
                           const GradsReadyFn& on_grads_ready = {});

}  // namespace locus::train
