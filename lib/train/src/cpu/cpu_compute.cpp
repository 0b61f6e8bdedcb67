// The CPU compute backend: the whole model through the cpu layer operations (cpu_layer_ops,
// the same ones a pipeline stage runs), training the TrainState's buffers in place: nothing is
// deferred, nothing to sync.
#include "cpu/cpu_compute.hpp"

#include <cmath>
#include <vector>

#include "cpu/cpu_layer_ops.hpp"
#include "locus/train/optim/clip.hpp"

namespace locus::train::detail {

namespace {

class CpuCompute final : public Compute {
 public:
  CpuCompute(TrainState& state, Loss loss)
      : loss_(loss),
        ops_(make_cpu_layer_ops(state)),
        train_(ops_->make_activations()),
        eval_(ops_->make_activations()) {}

  std::string_view name() const noexcept override { return "cpu"; }
  std::string describe() const override { return ops_->describe(); }
  comm::GradientBuffer grads() noexcept override { return ops_->grads(); }

  void forward_backward(const Batch& batch, std::uint64_t step, double grad_divisor,
                        const GradsReadyFn& on_grads_ready) override {
    ops_->prepare(*train_, batch.rows, false, false, true);
    ops_->forward(*train_, batch.x, true, DropoutKey{step, batch.sample_ids});
    pending_.push_back(
        ops_->loss(*train_, loss_, batch.labels, batch.targets, grad_divisor, true));
    ops_->backward(*train_, batch.x, true, false, nullptr, on_grads_ready);
  }

  void optimizer_step(double lr, double clip_max_norm) override {
    float scale = 1.0f;
    if (clip_max_norm > 0) {
      last_norm_ = std::sqrt(ops_->grad_sum_of_squares());
      scale = clip_factor(last_norm_, clip_max_norm);
    }
    ops_->update(lr, scale);
  }

  double last_grad_norm() override { return last_norm_; }

  void drain_stats(std::vector<LossStats>& out) override {
    out.insert(out.end(), pending_.begin(), pending_.end());
    pending_.clear();
  }

  LossStats evaluate(const Batch& batch) override {
    ops_->prepare(*eval_, batch.rows, false, false, false);
    ops_->forward(*eval_, batch.x, false, {});
    return ops_->loss(*eval_, loss_, batch.labels, batch.targets, 1.0, false);
  }

 private:
  Loss loss_;
  std::unique_ptr<LayerOps> ops_;
  // Grow to the largest batch seen (a rank's share of a global batch is not known before the
  // loader hands it out); steady-state steps allocate nothing.
  std::unique_ptr<LayerActivations> train_, eval_;
  std::vector<LossStats> pending_;
  double last_norm_ = -1;
};

}  // namespace

std::unique_ptr<Compute> make_cpu_compute(TrainState& state, Loss loss) {
  return std::make_unique<CpuCompute>(state, loss);
}

}  // namespace locus::train::detail
