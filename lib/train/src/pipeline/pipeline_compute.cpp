// The pipeline as the trainer's compute backend: a PipelineStage over a TrainState that holds
// only the stage's layers, a gradient buffer of the same size and the optimizer applied to it.
// Nothing here is whole-model sized: checkpoints and model files are written by the stages.
#include <fmt/format.h>

#include <optional>

#include "locus/comm/agree.hpp"
#include "locus/train/optim/clip.hpp"
#include "layer_ops.hpp"
#include "locus/train/pipeline/pipeline.hpp"

namespace locus::train {

namespace {

PipelineBatch pipeline_batch(const Batch& b) {
  return PipelineBatch{b.x, b.rows, b.labels, b.targets, b.sample_ids};
}

// Collective over grid.world(): this rank's stage, or the same ConfigError, agreed, on every
// rank (before the first collective that depends on it). The state must hold exactly the
// stage's layers: a whole state would keep the full model on every rank.
StageRange agreed_range(const Grid& grid, const Mlp& model, const PipelineOptions& o) {
  std::optional<StageRange> r;
  mpi::agree_on(grid.world(), [&] {
    validate(o);
    r = StagePartition(model.layout(), grid.pipeline_stages(), o.stage_boundaries)
            .stage(grid.stage());
    if (model.held() != r->held()) {
      throw ConfigError(fmt::format(
          "the training state of stage {} holds layers [{}, {}) but the stage trains layers "
          "[{}, {}): build it as TrainState(spec, optimizer, StagePartition(...).stage({})."
          "held())",
          grid.stage(), model.held().first, model.held().end, r->first_layer, r->end_layer,
          grid.stage()));
    }
  });
  return *r;
}

}  // namespace

PipelineCompute::PipelineCompute(const Grid& grid, TrainState& state, Loss loss,
                                 const PipelineOptions& options, const ComputeOptions& compute)
    : name_(compute.backend + "-pipeline"), range_(agreed_range(grid, state.model, options)) {
  // Collective over the world (a device backend picks each rank's device); agreed, so its
  // errors (no device, ...) reach every rank.
  std::unique_ptr<detail::LayerOps> ops;
  mpi::agree_on(grid.world(), [&] { ops = detail::make_layer_ops(compute, grid.world(), state); });
  stage_ = std::make_unique<PipelineStage>(grid, state.model.spec(), loss, options,
                                           std::move(ops));
}

PipelineCompute::~PipelineCompute() = default;

std::string PipelineCompute::describe() const { return stage_->ops().describe(); }
comm::GradientBuffer PipelineCompute::grads() noexcept { return stage_->ops().grads(); }

void PipelineCompute::forward_backward(const Batch& batch, std::uint64_t step,
                                       double grad_divisor, const GradsReadyFn&) {
  pending_.push_back(stage_->train_step(pipeline_batch(batch), step, grad_divisor));
}

void PipelineCompute::optimizer_step(double lr, double clip_max_norm) {
  float scale = 1.0f;
  if (clip_max_norm > 0) {
    last_norm_ = stage_->grad_norm();
    scale = clip_factor(last_norm_, clip_max_norm);
  }
  stage_->ops().update(lr, scale);
}

double PipelineCompute::grad_squares() {
  stage_->settle_reduction();  // the sum waits for the step's all-reduce
  return stage_->ops().grad_sum_of_squares();
}

void PipelineCompute::drain_stats(std::vector<LossStats>& out) {
  out.insert(out.end(), pending_.begin(), pending_.end());
  pending_.clear();
}

LossStats PipelineCompute::evaluate(const Batch& batch) {
  return stage_->evaluate(pipeline_batch(batch));
}

void PipelineCompute::sync_from_host() { stage_->ops().sync_from_host(); }
void PipelineCompute::sync_to_host() {
  stage_->settle_reduction();  // the state's copy waits for the last step's all-reduce
  stage_->ops().sync_to_host();
}

}  // namespace locus::train
