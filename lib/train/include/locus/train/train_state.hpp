// Everything a training run must carry to continue bit for bit: the step counters, the
// parameters and the optimizer state. The data order, the dropout masks and the learning rate
// are pure functions of (seed, epoch, step), so no RNG or scheduler state exists besides this.
// A checkpoint is exactly this struct (saved by name: ParamLayout::tensors(), state()).
#pragma once

#include <cstdint>
#include <memory>

#include "locus/train/model.hpp"
#include "locus/train/optimizer.hpp"

namespace locus::train {

struct TrainState {
  TrainState(const ModelSpec& spec, const OptimizerOptions& optimizer_options);

  Mlp model;                             // parameters (initialised from spec.seed)
  std::unique_ptr<Optimizer> optimizer;  // state spans by PyTorch name + its step counter
  std::int64_t step = 0;           // optimizer steps taken: the schedule's position
  std::int64_t epoch = 0;          // the epoch in progress (== epochs once training is done)
  std::int64_t step_in_epoch = 0;  // batches of `epoch` already trained on (resume point)

  // Throws DataError unless the counters are consistent (non-negative, optimizer->steps() ==
  // step): a restored state is checked before training continues from it.
  void check() const;
  // Copies counters, parameters and optimizer state from `other` (same spec and optimizer);
  // what a restore from a checkpoint does.
  void assign(const TrainState& other);
};

}  // namespace locus::train
