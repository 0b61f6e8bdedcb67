// Everything a training run must carry to continue bit for bit: the step counters, the
// parameters and the optimizer state. The data order, the dropout masks and the learning rate
// are pure functions of (seed, epoch, step), so no RNG or scheduler state exists besides this.
// A checkpoint is exactly this struct (saved by name: ParamLayout::tensors(), state()).
// With pipeline stages a rank's state holds only its stage's layers (model.held()): its
// parameters, and optimizer state of the same size; a checkpoint still stores the whole model,
// each stage writing and reading its layers.
#pragma once

#include <cstdint>
#include <memory>

#include "locus/train/model/model.hpp"
#include "locus/train/optim/optimizer.hpp"

namespace locus::train {

struct TrainState {
  // Every layer.
  TrainState(const ModelSpec& spec, const OptimizerOptions& optimizer_options);
  // Layers `held` only (a pipeline stage's: StageRange::held()).
  TrainState(const ModelSpec& spec, const OptimizerOptions& optimizer_options, LayerRange held);

  Mlp model;  // the held layers' parameters (initialised from spec.seed)
  // State spans (model.params()'s size) by PyTorch name + its step counter.
  std::unique_ptr<Optimizer> optimizer;
  std::int64_t step = 0;           // optimizer steps taken: the schedule's position
  std::int64_t epoch = 0;          // the epoch in progress (== epochs once training is done)
  std::int64_t step_in_epoch = 0;  // batches of `epoch` already trained on (resume point)

  // Throws DataError unless the counters are consistent (non-negative, optimizer->steps() ==
  // step): a restored state is checked before training continues from it.
  void check() const;
  // Copies counters, parameters and optimizer state from `other` (same spec, held layers and
  // optimizer); what a restore from a checkpoint does.
  void assign(const TrainState& other);
};

}  // namespace locus::train
