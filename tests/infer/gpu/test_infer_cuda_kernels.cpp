// The CUDA engine's kernel (finish_rows: softmax, argmax, top-k, log-loss terms) against a
// float64 reference and against the CPU's Scorer::finish -- the same argmax and top-k classes
// bit for bit (ties to the lower class), probabilities within 1e-6 -- and lib/train's
// DeviceModel against the CPU forward pass. Skipped (with the reason) without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/memory.hpp"
#include "cuda/score_kernels.hpp"
#include "locus/infer/scorer.hpp"
#include "locus/train/cuda/device_model.hpp"
#include "locus/train/model/forward.hpp"

using namespace locus;
namespace tc = locus::train::cuda;

namespace {

std::string no_gpu() {
  return tc::device_count() == 0 ? tc::describe_devices() : std::string();
}
#define LOCUS_SKIP_WITHOUT_GPU()                                  \
  do {                                                            \
    if (const std::string why = no_gpu(); !why.empty()) {         \
      GTEST_SKIP() << why;                                        \
    }                                                             \
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);                     \
  } while (0)

template <class T> std::vector<T> download(const tc::DeviceBuffer<T>& d, std::size_t n) {
  std::vector<T> h(n);
  if (n > 0) {
    EXPECT_EQ(cudaMemcpy(h.data(), d.data(), n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return h;
}
template <class T> tc::DeviceBuffer<T> upload(const std::vector<T>& h) {
  tc::DeviceBuffer<T> d(h.size());
  if (!h.empty()) {
    EXPECT_EQ(cudaMemcpy(d.data(), h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  return d;
}

// Logits with ties: every 5th row repeats its first value in some classes, every 11th row is
// constant, every 13th holds -0 and +0 at its top; labels include out-of-range ones.
std::vector<float> logits_with_ties(int rows, int classes, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> z(static_cast<std::size_t>(rows) * static_cast<std::size_t>(classes));
  for (float& v : z) v = normal(gen);
  for (int r = 0; r < rows; ++r) {
    float* row = z.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(classes);
    if (r % 5 == 0) {
      const float top = *std::max_element(row, row + classes) + 1.0f;
      for (int j = 0; j < classes; j += 2) row[j] = top;  // a tie at the top
      row[classes - 1] = top;
    }
    if (r % 11 == 0) std::fill(row, row + classes, 0.25f);
    if (r % 13 == 0) {
      std::fill(row, row + classes, -1.0f);
      row[classes / 2] = 0.0f;
      row[classes - 1] = -0.0f;
    }
  }
  return z;
}

struct DeviceFinish {
  std::vector<float> values, topk_value;
  std::vector<std::int32_t> predicted, topk_index;
  std::vector<double> loss;
};

// finish_rows over rows [first, first + rows) of z (a batch with leading rows to skip).
DeviceFinish run_device(const std::vector<float>& z, int first, int rows, int classes, int k,
                        bool probs, const std::vector<std::int32_t>& labels) {
  const auto n = static_cast<std::size_t>(rows), c = static_cast<std::size_t>(classes),
             kk = static_cast<std::size_t>(k);
  tc::DeviceBuffer<float> dz = upload(z), values(n * c), topk_value(n * kk);
  tc::DeviceBuffer<std::int32_t> predicted(n), topk_index(n * kk);
  tc::DeviceBuffer<std::int32_t> dl = upload(labels);
  tc::DeviceBuffer<double> loss(n);
  infer::cuda::FinishArgs a;
  a.logits = dz.data();
  a.first = first;
  a.rows = rows;
  a.classes = classes;
  a.top_k = k;
  a.probabilities = probs;
  a.labels = labels.empty() ? nullptr : dl.data();
  a.values = values.data();
  a.predicted = predicted.data();
  a.topk_index = k > 0 ? topk_index.data() : nullptr;
  a.topk_value = k > 0 ? topk_value.data() : nullptr;
  a.loss = loss.data();
  infer::cuda::finish_rows(a, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return {download(values, n * c), download(topk_value, n * kk), download(predicted, n),
          download(topk_index, n * kk), download(loss, labels.empty() ? 0 : n)};
}

}  // namespace

TEST(InferCudaKernels, FinishRowsMatchesTheScorerAndFloat64) {
  LOCUS_SKIP_WITHOUT_GPU();
  constexpr int kRows = 700, kFirst = 3;
  for (int classes : {2, 6, 10, 37}) {
    for (int k : {0, 1, 3, classes}) {
      if (k > classes) continue;
      SCOPED_TRACE("classes " + std::to_string(classes) + ", top_k " + std::to_string(k));
      const auto c = static_cast<std::size_t>(classes), kk = static_cast<std::size_t>(k);
      const std::vector<float> z = logits_with_ties(kRows + kFirst, classes, 7u + static_cast<std::uint32_t>(classes));
      std::vector<std::int32_t> labels(kRows);
      for (int r = 0; r < kRows; ++r) labels[static_cast<std::size_t>(r)] = r % 17 == 0 ? -1 : r % 19 == 0 ? classes : r % classes;
      const DeviceFinish d = run_device(z, kFirst, kRows, classes, k, true, labels);
      // The CPU: the same rows through Scorer::finish (the model only gives the width).
      const train::Mlp model(train::ModelSpec{.widths = {1, classes}});
      const infer::Scorer scorer(model, {.kind = infer::OutputKind::probabilities, .top_k = k,
                                         .batch_rows = 8});
      infer::Scores cpu;
      scorer.finish(std::span<const float>(z).subspan(kFirst * c), labels, cpu);
      ASSERT_EQ(d.predicted, cpu.predicted) << "argmax differs from the CPU (ties: the first max)";
      ASSERT_EQ(d.topk_index, cpu.topk_index) << "top-k classes differ from the CPU";
      double worst_cpu = 0, worst_ref = 0, worst_loss = 0, loss_sum = 0;
      for (int r = 0; r < kRows; ++r) {
        const float* row = z.data() + static_cast<std::size_t>(r + kFirst) * c;
        const double m = *std::max_element(row, row + classes);
        double sum = 0;
        for (int j = 0; j < classes; ++j) sum += std::exp(static_cast<double>(row[j]) - m);
        for (std::size_t j = 0; j < c; ++j) {
          const std::size_t i = static_cast<std::size_t>(r) * c + j;
          worst_cpu = std::max(worst_cpu, std::abs(static_cast<double>(d.values[i]) - cpu.values[i]));
          worst_ref = std::max(worst_ref, std::abs(d.values[i] - std::exp(row[j] - m) / sum));
        }
        for (std::size_t t = 0; t < kk; ++t) {  // the values of the chosen classes, exactly
          const std::size_t i = static_cast<std::size_t>(r) * kk + t;
          ASSERT_EQ(std::memcmp(&d.topk_value[i], &d.values[static_cast<std::size_t>(r) * c + static_cast<std::size_t>(d.topk_index[i])], sizeof(float)), 0);
        }
        const std::int32_t y = labels[static_cast<std::size_t>(r)];
        if (y < 0 || y >= classes) {
          EXPECT_EQ(d.loss[static_cast<std::size_t>(r)], 0.0) << "row " << r;
          continue;
        }
        const double want = m + std::log(sum) - static_cast<double>(row[y]);
        worst_loss = std::max(worst_loss, std::abs(d.loss[static_cast<std::size_t>(r)] - want));
        loss_sum += d.loss[static_cast<std::size_t>(r)];
      }
      EXPECT_LE(worst_cpu, 1e-6) << "probabilities vs the CPU's";
      EXPECT_LE(worst_ref, 1e-6) << "probabilities vs float64";
      EXPECT_LE(worst_loss, 1e-6) << "log-loss terms vs float64";
      EXPECT_NEAR(loss_sum, cpu.metrics.log_loss_sum, 1e-6 * kRows);
      // Bitwise repeatable.
      const DeviceFinish again = run_device(z, kFirst, kRows, classes, k, true, labels);
      EXPECT_EQ(std::memcmp(again.values.data(), d.values.data(), d.values.size() * sizeof(float)), 0);
      EXPECT_EQ(again.loss, d.loss);
    }
  }
}

TEST(InferCudaKernels, RawOutputsAreTheLogits) {
  LOCUS_SKIP_WITHOUT_GPU();
  const std::vector<float> z = logits_with_ties(300, 3, 5u);
  const DeviceFinish d = run_device(z, 10, 290, 3, 0, false, {});
  ASSERT_EQ(d.values.size(), 290u * 3u);
  EXPECT_EQ(std::memcmp(d.values.data(), z.data() + 30, d.values.size() * sizeof(float)), 0);
}

// The forward-only device model against the CPU forward pass, each activation and precision;
// the same bits on every call and from any 256-byte aligned input address.
TEST(InferCudaKernels, DeviceModelForwardMatchesTheCpu) {
  LOCUS_SKIP_WITHOUT_GPU();
  constexpr int kBatch = 64, kIn = 20;
  std::mt19937 gen(3);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<float> x(static_cast<std::size_t>(kBatch) * kIn);
  for (float& v : x) v = uni(gen);
  for (train::Activation act : {train::Activation::relu, train::Activation::gelu, train::Activation::tanh}) {
    const train::Mlp model(train::ModelSpec{.widths = {kIn, 48, 32, 7}, .activation = act, .seed = 5});
    train::Workspace ws(model, kBatch, train::Mode::inference);
    const std::span<const float> z = train::forward(model, x, kBatch, ws);
    const std::vector<float> cpu(z.begin(), z.end());
    double scale = 0;
    for (float v : cpu) scale = std::max(scale, static_cast<double>(std::abs(v)));
    for (auto [precision, tol] : {std::pair{train::Precision::fp32, 1e-5},
                                  std::pair{train::Precision::tf32, 3e-3},
                                  std::pair{train::Precision::bf16, 3e-2}}) {
      SCOPED_TRACE(std::string(train::to_string(act)) + " " + std::string(train::to_string(precision)));
      tc::DeviceModel dm(model, precision, kBatch);
      ASSERT_EQ(dm.inputs(), kIn);
      ASSERT_EQ(dm.outputs(), 7);
      // Two inputs at different 256-byte aligned addresses.
      tc::DeviceBuffer<float> a(x.size()), b(x.size() + 64 * 3);
      ASSERT_EQ(cudaMemcpy(a.data(), x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(b.data() + 64 * 3, x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
      std::vector<float> first(cpu.size()), second(cpu.size()), third(cpu.size());
      ASSERT_EQ(cudaMemcpy(first.data(), dm.forward(a.data(), kBatch, nullptr), first.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(second.data(), dm.forward(a.data(), kBatch, nullptr), second.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(third.data(), dm.forward(b.data() + 64 * 3, kBatch, nullptr), third.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      double worst = 0;
      for (std::size_t i = 0; i < cpu.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(first[i]) - cpu[i]));
      EXPECT_LE(worst, tol * std::max(scale, 1.0)) << "logits vs the CPU forward pass (scale " << scale << ")";
      EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * 4), 0) << "not repeatable";
      EXPECT_EQ(std::memcmp(first.data(), third.data(), first.size() * 4), 0) << "depends on the address";
    }
  }
}
