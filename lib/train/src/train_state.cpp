// The training state: construction, consistency checks and copying (resume).
#include "locus/train/train_state.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "locus/comm/error.hpp"

namespace locus::train {

TrainState::TrainState(const ModelSpec& spec, const OptimizerOptions& optimizer_options)
    : model(spec), optimizer(make_optimizer(optimizer_options, model.params().size())) {}

TrainState::TrainState(const ModelSpec& spec, const OptimizerOptions& optimizer_options,
                       LayerRange held)
    : model(spec, held), optimizer(make_optimizer(optimizer_options, model.params().size())) {}

void TrainState::check() const {
  if (step < 0 || epoch < 0 || step_in_epoch < 0) {
    throw DataError(fmt::format("training state has negative counters (step {}, epoch {}, "
                                "step in epoch {}): the checkpoint is corrupt",
                                step, epoch, step_in_epoch));
  }
  if (optimizer->steps() != step) {
    throw DataError(fmt::format("training state is at step {} but its optimizer has taken {} "
                                "steps: the checkpoint is corrupt or mixes two runs",
                                step, optimizer->steps()));
  }
}

void TrainState::assign(const TrainState& other) {
  LOCUS_ASSERT(model.spec().widths == other.model.spec().widths &&
                   model.held() == other.model.held() &&
                   optimizer->options().kind == other.optimizer->options().kind,
               "TrainState::assign between different models or optimizers");
  std::ranges::copy(other.model.params(), model.params().begin());
  const auto from = std::as_const(*other.optimizer).state();
  auto to = optimizer->state();
  LOCUS_ASSERT(from.size() == to.size(), "optimizer state buffers differ in number");
  for (std::size_t i = 0; i < from.size(); ++i) {
    LOCUS_ASSERT(from[i].name == to[i].name && from[i].data.size() == to[i].data.size(),
                 fmt::format("optimizer state '{}' does not match '{}'", from[i].name,
                             to[i].name));
    std::ranges::copy(from[i].data, to[i].data.begin());
  }
  optimizer->set_steps(other.optimizer->steps());
  step = other.step;
  epoch = other.epoch;
  step_in_epoch = other.step_in_epoch;
}

}  // namespace locus::train
