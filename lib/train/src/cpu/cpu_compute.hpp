// Private to lib/train: the CPU compute backend (OpenBLAS sgemm + the fused kernels of
// src/model), training the TrainState's buffers in place.
#pragma once

#include <memory>

#include "locus/train/compute.hpp"

namespace locus::train::detail {

std::unique_ptr<Compute> make_cpu_compute(TrainState& state, Loss loss);

}  // namespace locus::train::detail
