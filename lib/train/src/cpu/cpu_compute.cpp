// The CPU compute backend (OpenBLAS sgemm + the fused kernels of src/model), training the
// TrainState's buffers in place: nothing is deferred, nothing to sync.
#include "cpu/cpu_compute.hpp"

#include <algorithm>
#include <optional>
#include <vector>

#include "locus/train/model/forward.hpp"
#include "locus/train/optim/clip.hpp"

namespace locus::train::detail {

namespace {

class CpuCompute final : public Compute {
 public:
  CpuCompute(TrainState& state, Loss loss)
      : state_(state), loss_(loss), grads_(state.model.params().size()) {}

  std::string_view name() const noexcept override { return "cpu"; }
  std::string describe() const override { return "cpu (OpenBLAS)"; }
  comm::GradientBuffer grads() noexcept override {
    return {grads_.data(), grads_.size(), comm::MemorySpace::host, nullptr};
  }

  void forward_backward(const Batch& batch, std::uint64_t step, double grad_divisor,
                        const GradsReadyFn& on_grads_ready) override {
    Workspace& ws = workspace(train_ws_, batch.rows, Mode::training);
    LossStats stats = train::forward_backward(state_.model, ws, loss_, batch, step,
                                              grad_divisor, grads_, on_grads_ready);
    if (loss_ == Loss::mse && !batch.labels.empty()) {
      stats.correct = count_correct(ws.output(), batch.rows, output_width(), batch.labels);
    }
    pending_.push_back(stats);
  }

  void optimizer_step(double lr, double clip_max_norm) override {
    float scale = 1.0f;
    if (clip_max_norm > 0) {
      last_norm_ = global_grad_norm(grads_);
      scale = clip_factor(last_norm_, clip_max_norm);
    }
    state_.optimizer->step(state_.model.params(), grads_, lr, scale);
  }

  double last_grad_norm() override { return last_norm_; }

  void drain_stats(std::vector<LossStats>& out) override {
    out.insert(out.end(), pending_.begin(), pending_.end());
    pending_.clear();
  }

  LossStats evaluate(const Batch& batch) override {
    Workspace& ws = workspace(eval_ws_, batch.rows, Mode::inference);
    const std::span<const float> out = forward(state_.model, batch.x, batch.rows, ws);
    if (loss_ == Loss::softmax_cross_entropy) {
      return softmax_cross_entropy(out, batch.rows, output_width(), batch.labels, {}, 1.0);
    }
    LossStats stats = mean_squared_error(out, batch.rows, output_width(), batch.targets, {}, 1.0);
    if (!batch.labels.empty()) {
      stats.correct = count_correct(out, batch.rows, output_width(), batch.labels);
    }
    return stats;
  }

 private:
  int output_width() const noexcept { return state_.model.layout().output_width(); }

  // Workspaces grow to the largest batch seen (a rank's share of a global batch is not known
  // before the loader hands it out); steady-state steps allocate nothing.
  Workspace& workspace(std::optional<Workspace>& ws, int rows, Mode mode) {
    if (!ws || ws->max_batch() < rows) ws.emplace(state_.model, std::max(rows, 1), mode);
    return *ws;
  }

  TrainState& state_;
  Loss loss_;
  std::vector<float> grads_;
  std::optional<Workspace> train_ws_, eval_ws_;
  std::vector<LossStats> pending_;
  double last_norm_ = -1;
};

}  // namespace

std::unique_ptr<Compute> make_cpu_compute(TrainState& state, Loss loss) {
  return std::make_unique<CpuCompute>(state, loss);
}

}  // namespace locus::train::detail
