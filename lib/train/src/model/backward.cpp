// Back-propagation: per layer (last to first) dW = dZ^T X and dX = dZ W as sgemms with
// beta = 0 (grads are overwritten, never zeroed first), and one fused pass that applies the
// activation derivative to dX and sums the bias gradient of the layer below.
#include "locus/train/model/backward.hpp"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>

#include "model/kernels.hpp"
#include "locus/comm/error.hpp"
#include "model/workspace_access.hpp"

namespace locus::train {

using detail::WorkspaceAccess;

namespace {

// dZ of hidden layer l from dH (its output gradient, in place): relu reads its stored output,
// gelu/tanh the derivative kept by forward_train. Also writes layer l's bias gradient.
void through_activation(const Mlp& model, Workspace& ws, int l, float* g, float* db,
                        int batch) {
  const LayerLayout& ly = model.layout().layer(l);
  const float* deriv = WorkspaceAccess::deriv(ws, l);
  if (deriv != nullptr) {
    detail::deriv_backward(g, deriv, db, batch, ly.out);
  } else {
    const float p = model.spec().dropout;
    const float scale = p > 0.0f ? 1.0f / (1.0f - p) : 1.0f;
    detail::relu_backward(g, WorkspaceAccess::out(ws, l), scale, db, batch, ly.out);
  }
}

}  // namespace

void backward(const Mlp& model, Workspace& ws, std::span<float> grads,
              const GradsReadyFn& on_grads_ready) {
  const ParamLayout& layout = model.layout();
  LOCUS_ASSERT(ws.mode() == Mode::training, "backward() needs a training workspace");
  LOCUS_ASSERT(model.whole(), "backward() needs a whole model, not a pipeline stage's layers");
  LOCUS_ASSERT(std::ranges::equal(WorkspaceAccess::widths(ws), model.spec().widths),
               "the workspace was built for a model with different widths");
  LOCUS_ASSERT(grads.size() == layout.size(),
               fmt::format("grads hold {} floats, the model has {} parameters", grads.size(),
                           layout.size()));
  const int batch = ws.batch();
  const std::span<const float> x = WorkspaceAccess::input(ws);
  LOCUS_ASSERT(x.size() == static_cast<std::size_t>(batch) *
                               static_cast<std::size_t>(layout.input_width()),
               "backward() must follow forward_train() on the same workspace");
  const float* params = model.params().data();
  const int layers = layout.num_layers();

  float* dz = WorkspaceAccess::out_grad(ws);  // dZ of the current layer
  if (batch > 0) {
    detail::column_sums(dz, grads.data() + layout.layer(layers - 1).bias_offset, batch,
                        layout.output_width());
  }
  for (int l = layers - 1; l >= 0; --l) {
    const LayerLayout& ly = layout.layer(l);
    float* dw = grads.data() + ly.weight_offset;
    if (batch == 0) {
      std::fill(grads.begin() + static_cast<std::ptrdiff_t>(ly.begin()),
                grads.begin() + static_cast<std::ptrdiff_t>(ly.end()), 0.0f);
      if (on_grads_ready) on_grads_ready(l);
      continue;
    }
    const float* in = l == 0 ? x.data() : WorkspaceAccess::out(ws, l - 1);
    // dW[out, in] = dZ[b, out]^T * X[b, in]; the bias gradient is already complete.
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ly.out, ly.in, batch, 1.0f, dz,
                ly.out, in, ly.in, 0.0f, dw, ly.in);
    float* dx = nullptr;
    if (l > 0) {
      // dX[b, in] = dZ[b, out] * W[out, in], then through layer l-1's activation in place
      // (which also completes layer l-1's bias gradient). This reads W_l, so it comes before
      // on_grads_ready(l): the callback may then even update layer l's parameters.
      dx = WorkspaceAccess::scratch(ws, l % 2);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, ly.in, ly.out, 1.0f, dz,
                  ly.out, params + ly.weight_offset, ly.in, 0.0f, dx, ly.in);
      through_activation(model, ws, l - 1, dx, grads.data() + layout.layer(l - 1).bias_offset,
                         batch);
    }
    if (on_grads_ready) on_grads_ready(l);
    dz = dx;
  }
}

LossStats forward_backward(const Mlp& model, Workspace& ws, Loss loss, const Batch& batch,
                           std::uint64_t step, double grad_divisor, std::span<float> grads,
                           const GradsReadyFn& on_grads_ready) {
  const std::span<const float> logits =
      forward_train(model, batch.x, batch.rows, ws, DropoutKey{step, batch.sample_ids});
  const int outputs = model.layout().output_width();
  const LossStats stats =
      loss == Loss::softmax_cross_entropy
          ? softmax_cross_entropy(logits, batch.rows, outputs, batch.labels, ws.output_grad(),
                                  grad_divisor)
          : mean_squared_error(logits, batch.rows, outputs, batch.targets, ws.output_grad(),
                               grad_divisor);
  backward(model, ws, grads, on_grads_ready);
  return stats;
}

}  // namespace locus::train
