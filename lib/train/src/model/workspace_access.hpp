// Private access to a Workspace's buffers for the forward and backward passes.
#pragma once

#include "locus/train/model/forward.hpp"

namespace locus::train::detail {

struct WorkspaceAccess {
  static std::span<const int> widths(const Workspace& ws) { return ws.widths_; }
  static float* out(Workspace& ws, int l) { return ws.out_[static_cast<std::size_t>(l)].data(); }
  static float* deriv(Workspace& ws, int l) {
    auto& d = ws.deriv_[static_cast<std::size_t>(l)];
    return d.empty() ? nullptr : d.data();
  }
  static float* out_grad(Workspace& ws) { return ws.out_grad_.data(); }
  static float* scratch(Workspace& ws, int i) { return ws.scratch_[i].data(); }
  static std::span<const float> input(const Workspace& ws) { return ws.input_; }
  static void set_batch(Workspace& ws, int batch, std::span<const float> input) {
    ws.batch_ = batch;
    ws.input_ = input;
  }
};

}  // namespace locus::train::detail
