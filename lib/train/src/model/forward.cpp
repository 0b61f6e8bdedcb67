// The workspace and the forward pass: per layer one sgemm (beta = 0, so no zeroing pass)
// followed by one fused epilogue pass (bias + activation [+ dropout + derivative]).
#include "locus/train/model/forward.hpp"

#include <cblas.h>
#include <fmt/format.h>

#include <algorithm>

#include "model/kernels.hpp"
#include "locus/comm/error.hpp"
#include "model/workspace_access.hpp"

namespace locus::train {

using detail::WorkspaceAccess;

Workspace::Workspace(const Mlp& model, int max_batch, Mode mode)
    : widths_(model.spec().widths), max_batch_(max_batch), mode_(mode) {
  if (max_batch < 1) {
    throw ConfigError(fmt::format("workspace for a batch of at most {} rows: the batch size "
                                  "must be >= 1",
                                  max_batch));
  }
  const auto rows = static_cast<std::size_t>(max_batch);
  const int layers = num_layers();
  out_.resize(static_cast<std::size_t>(layers));
  deriv_.resize(static_cast<std::size_t>(layers));
  int max_hidden = 0;
  for (int l = 0; l < layers; ++l) {
    const auto width = static_cast<std::size_t>(widths_[static_cast<std::size_t>(l) + 1]);
    out_[static_cast<std::size_t>(l)].assign(rows * width, 0.0f);
    const bool hidden = l + 1 < layers;
    if (hidden) max_hidden = std::max(max_hidden, static_cast<int>(width));
    // relu's derivative is read off its output; gelu and tanh keep act'(z) from the forward.
    if (mode == Mode::training && hidden && model.spec().activation != Activation::relu) {
      deriv_[static_cast<std::size_t>(l)].assign(rows * width, 0.0f);
    }
  }
  if (mode == Mode::training) {
    out_grad_.assign(rows * static_cast<std::size_t>(widths_.back()), 0.0f);
    for (auto& s : scratch_) s.assign(rows * static_cast<std::size_t>(max_hidden), 0.0f);
  }
}

std::span<const float> Workspace::layer_output(int l) const {
  LOCUS_ASSERT(l >= 0 && l < num_layers(), fmt::format("layer {} of {}", l, num_layers()));
  const auto n = static_cast<std::size_t>(batch_) *
                 static_cast<std::size_t>(widths_[static_cast<std::size_t>(l) + 1]);
  return std::span<const float>(out_[static_cast<std::size_t>(l)]).first(n);
}

std::span<float> Workspace::output_grad() {
  LOCUS_ASSERT(mode_ == Mode::training, "output_grad() needs a training workspace");
  return std::span<float>(out_grad_).first(static_cast<std::size_t>(batch_) *
                                           static_cast<std::size_t>(widths_.back()));
}

namespace {

void check_call(const Mlp& model, std::span<const float> x, int batch, const Workspace& ws) {
  LOCUS_ASSERT(model.whole(), "forward() needs a whole model, not a pipeline stage's layers");
  const std::span<const int> widths = WorkspaceAccess::widths(ws);
  LOCUS_ASSERT(std::ranges::equal(widths, model.spec().widths),
               "the workspace was built for a model with different widths");
  LOCUS_ASSERT(batch >= 0 && batch <= ws.max_batch(),
               fmt::format("batch of {} rows for a workspace of at most {}", batch,
                           ws.max_batch()));
  LOCUS_ASSERT(x.size() == static_cast<std::size_t>(batch) * static_cast<std::size_t>(widths[0]),
               fmt::format("input holds {} floats, expected {} rows x {} features", x.size(),
                           batch, widths[0]));
}

std::span<const float> run_forward(const Mlp& model, std::span<const float> x, int batch,
                                   Workspace& ws, bool training, const DropoutKey& key) {
  check_call(model, x, batch, ws);
  WorkspaceAccess::set_batch(ws, batch, training ? x : std::span<const float>());
  const ModelSpec& spec = model.spec();
  const ParamLayout& layout = model.layout();
  const std::span<const float> params = model.params();
  const bool dropout = training && spec.dropout > 0.0f;
  if (dropout) {
    LOCUS_ASSERT(key.sample_ids.size() == static_cast<std::size_t>(batch),
                 fmt::format("dropout needs one sample id per row: got {} for {} rows",
                             key.sample_ids.size(), batch));
  }
  const int layers = layout.num_layers();
  for (int l = 0; l < layers && batch > 0; ++l) {
    const LayerLayout& ly = layout.layer(l);
    const float* in = l == 0 ? x.data() : WorkspaceAccess::out(ws, l - 1);
    float* z = WorkspaceAccess::out(ws, l);
    // Z[b, out] = X[b, in] * W^T with W stored [out, in] row-major.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, ly.out, ly.in, 1.0f, in, ly.in,
                params.data() + ly.weight_offset, ly.in, 0.0f, z, ly.out);
    const float* bias = params.data() + ly.bias_offset;
    if (l + 1 == layers) {
      detail::add_bias(z, bias, batch, ly.out);
    } else if (spec.activation == Activation::relu && !dropout) {
      detail::add_bias_relu(z, bias, batch, ly.out);
    } else {
      detail::DropoutRows rows;
      rows.enabled = dropout;
      rows.p = spec.dropout;
      rows.seed = spec.seed;
      rows.step = key.step;
      rows.layer = l;
      rows.sample_ids = key.sample_ids.data();
      float* deriv = training ? WorkspaceAccess::deriv(ws, l) : nullptr;
      detail::add_bias_activate(z, deriv, bias, batch, ly.out, static_cast<int>(spec.activation),
                                rows);
    }
  }
  return ws.output();
}

}  // namespace

std::span<const float> forward(const Mlp& model, std::span<const float> x, int batch,
                               Workspace& ws) {
  return run_forward(model, x, batch, ws, false, {});
}

std::span<const float> forward_train(const Mlp& model, std::span<const float> x, int batch,
                                     Workspace& ws, const DropoutKey& dropout) {
  LOCUS_ASSERT(ws.mode() == Mode::training, "forward_train() needs a training workspace");
  return run_forward(model, x, batch, ws, true, dropout);
}

}  // namespace locus::train
