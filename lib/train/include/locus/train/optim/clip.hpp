// Gradient clipping by global L2 norm (torch.nn.utils.clip_grad_norm_), data-parallel: the
// local sum of squares is summed across ranks through a callback before scaling.
//
// Which grads to pass, and whether to pass the callback:
//   - after an all-reduce every rank holds the WHOLE gradient: pass it and NO callback (the
//     local norm is already the global one; summing over ranks would inflate it by sqrt(N));
//   - when each rank holds a disjoint shard of it (reduce-scatter, sharded optimizer state):
//     pass the shard and sum_across(comm).
#pragma once

#include <functional>
#include <span>

#include "locus/comm/mpi.hpp"

namespace locus::train {

// Returns the sum of its argument over all ranks. Empty means a single process.
using SumAcrossRanks = std::function<double(double)>;

// An all-reduce SUM over comm. Calling the result is collective over comm.
SumAcrossRanks sum_across(const mpi::Comm& comm);

// Local sum of squares (accumulated in double).
double sum_of_squares(std::span<const float> grads) noexcept;

// sqrt(sum over ranks of the local sums of squares), or the local norm without a callback.
// With a callback: collective over its communicator; every rank gets the same value.
double global_grad_norm(std::span<const float> grads, const SumAcrossRanks& allreduce_sum = {});

// PyTorch's factor: min(1, max_norm / (norm + 1e-6)). Pass it to Optimizer::step as
// grad_scale to clip inside the optimizer's pass instead of an extra pass over grads.
float clip_factor(double norm, double max_norm) noexcept;

// Convenience: global norm, then grads *= clip_factor in place when it is < 1. Returns the
// norm before clipping. Collective like global_grad_norm().
double clip_grad_norm(std::span<float> grads, double max_norm,
                      const SumAcrossRanks& allreduce_sum = {});

}  // namespace locus::train
