// Factories of the concrete optimizers (private; callers use make_optimizer).
#pragma once

#include <memory>

#include "locus/train/optim/optimizer.hpp"

namespace locus::train::detail {

std::unique_ptr<Optimizer> make_sgd(const OptimizerOptions& options, std::size_t size);
std::unique_ptr<Optimizer> make_adam(const OptimizerOptions& options, std::size_t size);

// One clone per ISA, chosen at load time (the optimizers' single pass is their whole cost).
#define LOCUS_TRAIN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

}  // namespace locus::train::detail
