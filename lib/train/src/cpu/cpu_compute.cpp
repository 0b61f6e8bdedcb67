// The CPU compute backend (OpenBLAS sgemm + the fused kernels of lib/train), training the
// TrainState's buffers in place, and the backend factory.
#include <fmt/format.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/train/optim/clip.hpp"
#include "locus/train/compute.hpp"
#include "locus/train/model/forward.hpp"

namespace locus::train {

namespace {

class CpuCompute final : public Compute {
 public:
  CpuCompute(TrainState& state, Loss loss)
      : state_(state), loss_(loss), grads_(state.model.layout().size()) {}

  std::string_view name() const noexcept override { return "cpu"; }
  std::span<float> grads() noexcept override { return grads_; }

  LossStats forward_backward(const Batch& batch, std::uint64_t step, double grad_divisor,
                             const GradsReadyFn& on_grads_ready) override {
    Workspace& ws = workspace(train_ws_, batch.rows, Mode::training);
    LossStats stats = train::forward_backward(state_.model, ws, loss_, batch, step,
                                              grad_divisor, grads_, on_grads_ready);
    if (loss_ == Loss::mse && !batch.labels.empty()) {
      stats.correct = count_correct(ws.output(), batch.rows, output_width(), batch.labels);
    }
    return stats;
  }

  double grad_norm() override { return global_grad_norm(grads_); }

  void optimizer_step(double lr, float grad_scale) override {
    state_.optimizer->step(state_.model.params(), grads_, lr, grad_scale);
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
};

}  // namespace

std::unique_ptr<Compute> make_compute(std::string_view name, TrainState& state, Loss loss) {
  if (name == "cpu") return std::make_unique<CpuCompute>(state, loss);
  throw ConfigError(fmt::format("train.backend = '{}' is not available in this build: use cpu",
                                name));
}

std::int64_t count_correct(std::span<const float> outputs, int rows, int classes,
                           std::span<const std::int32_t> labels) noexcept {
  std::int64_t correct = 0;
  for (int r = 0; r < rows; ++r) {
    const float* z = outputs.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(classes);
    int best = 0;
    for (int j = 1; j < classes; ++j) best = z[j] > z[best] ? j : best;  // first max, as the loss
    correct += best == labels[static_cast<std::size_t>(r)] ? 1 : 0;
  }
  return correct;
}

}  // namespace locus::train
