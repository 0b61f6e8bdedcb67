// The per-row post-processing of a batch's logits on the device (contract: score_kernels.hpp).
// nvcc runs with --fmad=false (no contraction), so the only difference from Scorer::finish is
// CUDA's expf/log against glibc's.
#include "score_kernels.hpp"

#include <cmath>

#include "cuda/cuda_check.hpp"

namespace locus::infer::cuda {

namespace {

constexpr int kThreads = 128;

__global__ void finish_rows_kernel(FinishArgs a) {
  const int i = static_cast<int>(blockIdx.x) * kThreads + static_cast<int>(threadIdx.x);
  if (i >= a.rows) return;
  const int c = a.classes;
  const float* z = a.logits + static_cast<std::size_t>(a.first + i) * static_cast<std::size_t>(c);
  float* v = a.values + static_cast<std::size_t>(i) * static_cast<std::size_t>(c);
  if (!a.probabilities) {
    for (int j = 0; j < c; ++j) v[j] = z[j];
    return;
  }
  int best = 0;
  for (int j = 1; j < c; ++j) best = z[j] > z[best] ? j : best;
  const float m = z[best];
  double sum = 0.0;
  for (int j = 0; j < c; ++j) {
    const float e = expf(z[j] - m);
    v[j] = e;
    sum += static_cast<double>(e);
  }
  const auto inv = static_cast<float>(1.0 / sum);
  for (int j = 0; j < c; ++j) v[j] *= inv;
  a.predicted[i] = best;
  if (a.top_k > 0) {
    // Selection in the CPU's strict order (higher logit first, then lower class): round t takes
    // the greatest class ranked after round t-1's pick.
    const std::size_t base = static_cast<std::size_t>(i) * static_cast<std::size_t>(a.top_k);
    float prev_z = 0.0f;
    int prev = -1;
    for (int t = 0; t < a.top_k; ++t) {
      int pick = -1;
      for (int j = 0; j < c; ++j) {
        const float zj = z[j];
        if (prev >= 0 && !(zj < prev_z || (zj == prev_z && j > prev))) continue;
        if (pick < 0 || zj > z[pick]) pick = j;
      }
      if (pick < 0) pick = 0;  // only with NaN logits (unspecified order)
      a.topk_index[base + static_cast<std::size_t>(t)] = pick;
      a.topk_value[base + static_cast<std::size_t>(t)] = v[pick];
      prev = pick;
      prev_z = z[pick];
    }
  }
  if (a.labels != nullptr) {
    const std::int32_t label = a.labels[i];
    a.loss[i] = label >= 0 && label < c
                    ? static_cast<double>(m) + log(sum) - static_cast<double>(z[label])
                    : 0.0;
  }
}

}  // namespace

void finish_rows(const FinishArgs& a, cudaStream_t s) {
  if (a.rows <= 0) return;
  const unsigned blocks = static_cast<unsigned>((a.rows + kThreads - 1) / kThreads);
  finish_rows_kernel<<<blocks, kThreads, 0, s>>>(a);
  LOCUS_CUDA_CHECK_LAUNCH("finish_rows");
}

}  // namespace locus::infer::cuda
