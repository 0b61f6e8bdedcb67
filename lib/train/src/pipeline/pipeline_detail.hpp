// Private to lib/train: what one micro-batch keeps on a pipeline stage until its backward --
// its activations in the backend's memory (the backend's layer operations made them, see
// layer_ops.hpp) and its transfers to and from the neighbouring stages.
#pragma once

#include <memory>

#include "layer_ops.hpp"
#include "locus/comm/link.hpp"

namespace locus::train::detail {

// Slots are reused across micro-batches and steps: steady-state steps allocate nothing.
struct ActivationSlot {
  int micro_batch = -1;
  std::unique_ptr<LayerActivations> act;
  comm::LinkRequest recv_input, send_output, recv_grad;  // through the stage link
};

}  // namespace locus::train::detail
