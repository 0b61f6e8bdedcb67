// Factories of the concrete optimizers (private; callers use make_optimizer).
#pragma once

#include <memory>

#include "locus/train/optim/optimizer.hpp"

namespace locus::train::detail {

std::unique_ptr<Optimizer> make_sgd(const OptimizerOptions& options, std::size_t size);
std::unique_ptr<Optimizer> make_adam(const OptimizerOptions& options, std::size_t size);

// One clone per ISA, chosen at load time (the optimizers' single pass is their whole cost).
// Not under ThreadSanitizer: the clone's resolver runs while the dynamic loader relocates the
// program, before the TSan run-time is up, and TSan's instrumentation of it crashes there.
#if defined(__SANITIZE_THREAD__)
#define LOCUS_TRAIN_CLONES
#else
#define LOCUS_TRAIN_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

}  // namespace locus::train::detail
