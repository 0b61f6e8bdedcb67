// Losses on logits [rows, classes] row-major: softmax cross-entropy (numerically stable
// log-softmax) and mean squared error, each optionally writing d(loss)/d(logits).
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

namespace locus::train {

enum class Loss { softmax_cross_entropy, mse };
Loss parse_loss(std::string_view name);  // "cross_entropy" | "mse"; ConfigError otherwise
std::string_view to_string(Loss loss) noexcept;

// Per-batch sums, so ranks can add them up: the mean loss of a global batch is
// allreduce(loss_sum) / global rows.
struct LossStats {
  double loss_sum = 0.0;      // sum over rows of the per-sample loss
  std::int64_t correct = 0;   // rows whose argmax equals the label (cross-entropy only)
  std::int64_t rows = 0;
};

// The gradient convention (read this once): dlogits receives
//     d(loss_sum) / d(logits) / grad_divisor.
// With grad_divisor = rows this is the gradient of the batch-mean loss (PyTorch's
// reduction='mean'). In data-parallel training each rank passes its local rows but the GLOBAL
// batch size as grad_divisor, so summing the parameter gradients over ranks (all-reduce SUM,
// no further division) yields exactly the gradient of the global-batch mean. Pass an empty
// dlogits to evaluate the loss only.

// Per-sample loss: logsumexp(z) - z[label]. Labels must be in [0, classes) (DataError).
LossStats softmax_cross_entropy(std::span<const float> logits, int rows, int classes,
                                std::span<const std::int32_t> labels, std::span<float> dlogits,
                                double grad_divisor);

// Per-sample loss: sum_j (z_j - t_j)^2 / outputs (mean over outputs, so the batch mean equals
// torch.nn.MSELoss()). targets is [rows, outputs].
LossStats mean_squared_error(std::span<const float> outputs, int rows, int width,
                             std::span<const float> targets, std::span<float> doutputs,
                             double grad_divisor);

}  // namespace locus::train
