// The pipeline as the trainer's compute backend: a PipelineStage over the stage's slice of the
// TrainState's buffers, the optimizer applied to that slice, and the gather of every stage's
// slices when the state must be whole (checkpoints, model files, the end of training).
#include <fmt/format.h>

#include <optional>

#include "locus/comm/agree.hpp"
#include "locus/train/pipeline.hpp"

namespace locus::train {

namespace {

PipelineBatch pipeline_batch(const Batch& b) {
  return PipelineBatch{b.x, b.rows, b.labels, b.targets, b.sample_ids};
}

// Collective over grid.world(): this rank's stage, or the same ConfigError, agreed, on every
// rank (before the first collective that depends on it).
StageRange agreed_range(const Grid& grid, const ModelSpec& spec, const PipelineOptions& o) {
  std::optional<StageRange> r;
  mpi::agree_on(grid.world(), [&] {
    validate(o);
    r = StagePartition(ParamLayout(spec.widths), grid.pipeline_stages(), o.stage_boundaries)
            .stage(grid.stage());
  });
  return *r;
}

}  // namespace

PipelineCompute::PipelineCompute(const Grid& grid, TrainState& state, Loss loss,
                                 const PipelineOptions& options)
    : state_(state),
      range_(agreed_range(grid, state.model.spec(), options)),
      pp_(grid.pp().dup()),
      grads_(state.model.layout().size(), 0.0f) {
  stage_ = std::make_unique<PipelineStage>(
      grid, state.model.spec(), loss, options,
      StageBuffers{state.model.params().subspan(range_.begin, range_.size()),
                   std::span<float>(grads_).subspan(range_.begin, range_.size())});
}

PipelineCompute::~PipelineCompute() = default;

LossStats PipelineCompute::forward_backward(const Batch& batch, std::uint64_t step,
                                            double grad_divisor, const GradsReadyFn&) {
  return stage_->train_step(pipeline_batch(batch), step, grad_divisor);
}

double PipelineCompute::grad_norm() { return stage_->grad_norm(); }

void PipelineCompute::optimizer_step(double lr, float grad_scale) {
  state_.optimizer->update(state_.model.params(), grads_, lr, grad_scale, range_.begin,
                           range_.end);
  state_.optimizer->finish_step();
}

LossStats PipelineCompute::evaluate(const Batch& batch) {
  return stage_->evaluate(pipeline_batch(batch));
}

void PipelineCompute::sync_to_host() {
  // Stage s owns [begin, end) of every buffer; each broadcasts its slices to its pipeline.
  std::vector<std::span<float>> buffers{state_.model.params()};
  for (auto& s : state_.optimizer->state()) buffers.push_back(s.data);
  for (int s = 0; s < stage_->stages(); ++s) {
    const StageRange& r = stage_->partition().stage(s);
    for (const std::span<float> b : buffers) pp_.bcast(b.subspan(r.begin, r.size()), s);
  }
}

}  // namespace locus::train
