// Private to lib/infer's CUDA engine: what Scorer::finish computes per row (scorer.cpp), on the
// device, from a batch's logits: softmax probabilities (or the raw outputs), the argmax, the
// top-k classes and each labelled row's log-loss term. Launchers enqueue on the given stream,
// check the launch and never synchronise. tests/infer/gpu checks them against a float64
// reference and against Scorer::finish.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace locus::infer::cuda {

// Rows [first, first + rows) of logits [*, classes] (row-major), written to row i = r - first
// of each output. One thread per row, the CPU's operations in the CPU's order:
//   argmax: the first maximum (best = z[j] > z[best] ? j : best);
//   softmax: v[j] = expf(z[j] - max) (float), summed in double in class order, then each v[j]
//     multiplied by float(1 / sum) -- within an ulp or two of glibc's expf, i.e. ~1e-7;
//   top-k: classes by descending logit, ties to the lower class (top-1 is the argmax), with
//     their probabilities; O(k * classes) per row. For rows with NaN logits the order is
//     unspecified, as on the CPU (std::partial_sort with a NaN);
//   loss (labels != null): double(max) + log(sum) - double(z[label]) in double for labels in
//     [0, classes), else 0 (the host counts those rows as out of range and skips them).
// probabilities == false: values = the logits, nothing else is written.
struct FinishArgs {
  const float* logits = nullptr;
  int first = 0, rows = 0, classes = 0, top_k = 0;
  bool probabilities = true;
  const std::int32_t* labels = nullptr;   // [rows] or null
  float* values = nullptr;                // [rows, classes]
  std::int32_t* predicted = nullptr;      // [rows] (probabilities)
  std::int32_t* topk_index = nullptr;     // [rows, top_k] (top_k > 0)
  float* topk_value = nullptr;            // [rows, top_k] (top_k > 0)
  double* loss = nullptr;                 // [rows] (labels != null)
};
void finish_rows(const FinishArgs& a, cudaStream_t s);

}  // namespace locus::infer::cuda
