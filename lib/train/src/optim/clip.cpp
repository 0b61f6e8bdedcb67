// Global-norm gradient clipping with the cross-rank sum behind a callback.
#include "locus/train/optim/clip.hpp"

#include <cmath>

namespace locus::train {

SumAcrossRanks sum_across(const mpi::Comm& comm) {
  const MPI_Comm c = comm.get();
  return [c](double local) {
    double global = 0.0;
    LOCUS_MPI_CHECK(MPI_Allreduce(&local, &global, 1, MPI_DOUBLE, MPI_SUM, c));
    return global;
  };
}

double sum_of_squares(std::span<const float> grads) noexcept {
  // Four partial sums: independent chains run in parallel, and the result stays the same
  // whatever the ISA (the order is fixed, not left to the vectoriser).
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  std::size_t i = 0;
  for (; i + 4 <= grads.size(); i += 4) {
    for (int k = 0; k < 4; ++k) {
      const double g = grads[i + static_cast<std::size_t>(k)];
      s[k] += g * g;
    }
  }
  for (; i < grads.size(); ++i) s[0] += static_cast<double>(grads[i]) * grads[i];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

double global_grad_norm(std::span<const float> grads, const SumAcrossRanks& allreduce_sum) {
  const double local = sum_of_squares(grads);
  return std::sqrt(allreduce_sum ? allreduce_sum(local) : local);
}

float clip_factor(double norm, double max_norm) noexcept {
  const double coef = max_norm / (norm + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

double clip_grad_norm(std::span<float> grads, double max_norm,
                      const SumAcrossRanks& allreduce_sum) {
  const double norm = global_grad_norm(grads, allreduce_sum);
  const float factor = clip_factor(norm, max_norm);
  if (factor < 1.0f) {
    for (float& g : grads) g *= factor;
  }
  return norm;
}

}  // namespace locus::train
