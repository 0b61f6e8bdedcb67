// The CUDA backend's forward/backward epilogues, column sums, losses, gather and bf16 copy
// (src/cuda/kernels.cu) against float64 references on random inputs: every output element
// written (NaN poison), nothing written out of bounds (guards), bitwise repeatable, dropout
// decisions equal to the CPU's (model/kernels.cpp), float4 and scalar paths both exercised.
// Optimizers, norm and graph capture: test_cuda_kernels_optim.cpp.
#include <cuda_bf16.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <numbers>
#include <random>
#include <utility>
#include <vector>

#include "cuda/cublaslt_api.hpp"
#include "cuda/host_bf16.hpp"
#include "cuda/kernels.hpp"
#include "cuda/matmul.hpp"
#include "cuda_kernels_util.hpp"
#include "locus/train/model/loss.hpp"
#include "model/hash.hpp"
#include "model/kernels.hpp"

namespace locus::train::cuda::test {
namespace {

using Bf16Bits = std::uint16_t;
__nv_bfloat16* bf(const Dev<Bf16Bits>& d) { return reinterpret_cast<__nv_bfloat16*>(d.get()); }

constexpr Act kActs[] = {Act::relu, Act::gelu, Act::tanh, Act::none};
const std::vector<std::pair<int, int>> kShapes = {{1, 10},   {7, 257},  {128, 128}, {3, 4},
                                                  {1000, 784}, {1030, 10}, {33, 256}};

// act(v) and act'(v) in float64 (gelu: the tanh approximation, as model/kernels.hpp).
void act_ref(Act act, double v, double& y, double& dy) {
  switch (act) {
    case Act::relu: y = v > 0 ? v : 0; dy = v > 0 ? 1 : 0; break;
    case Act::gelu: {
      const double a = std::sqrt(2.0 / std::numbers::pi), b = 0.044715;
      const double t = std::tanh(a * (v + b * v * v * v));
      y = 0.5 * v * (1 + t);
      dy = 0.5 * (1 + t) + 0.5 * v * (1 - t * t) * a * (1 + 3 * b * v * v);
      break;
    }
    case Act::tanh: y = std::tanh(v); dy = 1 - y * y; break;
    case Act::none: y = v; dy = 1; break;
  }
}

struct ForwardCase {
  int rows, cols;
  Act act;
  bool dropout;
  bool outputs;        // deriv and bf16 copies requested
  std::size_t offset;  // 1: misaligned, the scalar path
};

class ForwardRun {
 public:
  ForwardRun(const ForwardCase& c, std::uint64_t seed)
      : c_(c),
        n_(static_cast<std::size_t>(c.rows) * static_cast<std::size_t>(c.cols)),
        z0_(uniform(n_, -3.0f, 3.0f, seed)),
        bias_(uniform(static_cast<std::size_t>(c.cols), -1.0f, 1.0f, seed + 1)),
        ids_(static_cast<std::size_t>(c.rows)),
        z_(n_, c.offset), deriv_(n_, c.offset), out16_(n_, c.offset),
        dbias_(bias_, c.offset), dids_(ids_.size()), step_(1) {
    std::mt19937_64 gen(seed + 2);
    for (auto& id : ids_) id = gen() % 100000;
    dids_.upload(ids_);
  }

  // Launches with the device step = `step`; returns z, deriv, bf16 bits.
  struct Out {
    std::vector<float> z, deriv;
    std::vector<Bf16Bits> b16;
  };
  Out run(std::uint64_t step, cudaStream_t s) {
    z_.upload(z0_);
    deriv_.poison();
    out16_.poison();
    step_.set(step);
    bias_act_forward(z_.get(), c_.outputs ? deriv_.get() : nullptr,
                     c_.outputs ? bf(out16_) : nullptr, dbias_.get(), c_.rows, c_.cols, c_.act,
                     dropout(), s);
    LOCUS_TEST_CUDA(cudaStreamSynchronize(s));
    EXPECT_TRUE(z_.intact() && deriv_.intact() && out16_.intact()) << "write out of bounds";
    return {z_.download(), deriv_.download(), out16_.download()};
  }

  DropoutArgs dropout() const {
    DropoutArgs d;
    d.enabled = c_.dropout;
    d.p = kP;
    d.seed = 0x5eed;
    d.layer = 2;
    d.step = step_.get();
    d.sample_ids = dids_.get();
    return d;
  }
  bool keep(std::uint64_t step, int r, int j) const {
    if (!c_.dropout) return true;
    const std::uint64_t key = detail::dropout_row_key(0x5eed, step, 2, ids_[static_cast<std::size_t>(r)]);
    return detail::keep_unit(key, j, detail::drop_threshold(kP));
  }
  void reference(std::uint64_t step, std::vector<double>& y, std::vector<double>& dy) const {
    y.resize(n_);
    dy.resize(n_);
    const double scale = c_.dropout ? 1.0 / (1.0 - static_cast<double>(kP)) : 1.0;
    for (int r = 0; r < c_.rows; ++r) {
      for (int j = 0; j < c_.cols; ++j) {
        const std::size_t i = static_cast<std::size_t>(r) * static_cast<std::size_t>(c_.cols) +
                              static_cast<std::size_t>(j);
        act_ref(c_.act, static_cast<double>(z0_[i]) + bias_[static_cast<std::size_t>(j)], y[i], dy[i]);
        const double f = keep(step, r, j) ? scale : 0.0;
        y[i] *= f;
        dy[i] *= f;
      }
    }
  }
  // z + bias is exactly 0 (tanh gives 0 there whether or not the unit is kept).
  bool zero_input(int r, int j) const {
    const std::size_t i = static_cast<std::size_t>(r) * static_cast<std::size_t>(c_.cols) +
                          static_cast<std::size_t>(j);
    return z0_[i] + bias_[static_cast<std::size_t>(j)] == 0.0f;
  }
  // The CPU's own float epilogue (model/kernels.cpp), for its dropout decisions.
  std::vector<float> cpu(std::uint64_t step, int activation) const {
    std::vector<float> z = z0_, deriv(n_);
    detail::DropoutRows d;
    d.enabled = c_.dropout;
    d.p = kP;
    d.seed = 0x5eed;
    d.step = step;
    d.layer = 2;
    d.sample_ids = ids_.data();
    detail::add_bias_activate(z.data(), deriv.data(), bias_.data(), c_.rows, c_.cols, activation, d);
    return z;
  }

  static constexpr float kP = 0.3f;

 private:
  ForwardCase c_;
  std::size_t n_;
  std::vector<float> z0_, bias_;
  std::vector<std::uint64_t> ids_;
  Dev<float> z_, deriv_;
  Dev<Bf16Bits> out16_;
  Dev<float> dbias_;
  Dev<std::uint64_t> dids_, step_;
};

TEST_F(CudaKernels, BiasActForwardMatchesFloat64) {
  std::uint64_t seed = 100;
  for (const auto& [rows, cols] : kShapes) {
    for (const Act act : kActs) {
      for (const bool dropout : {false, true}) {
        for (const auto& [outputs, offset] :
             std::vector<std::pair<bool, int>>{{true, 0}, {false, 0}, {true, 1}}) {
          const ForwardCase c{rows, cols, act, dropout, outputs, static_cast<std::size_t>(offset)};
          SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " act " << static_cast<int>(act)
                                            << " dropout " << dropout << " outputs " << outputs
                                            << " offset " << offset);
          ForwardRun f(c, ++seed);
          const auto out = f.run(7, stream_);
          std::vector<double> y, dy;
          f.reference(7, y, dy);
          EXPECT_TRUE(matches(out.z, y, 1e-5));
          if (outputs) {
            EXPECT_TRUE(matches(out.deriv, dy, 1e-5));
            EXPECT_TRUE(bf16_of(out.b16, out.z));
          } else {
            EXPECT_EQ(count_nan(out.deriv), out.deriv.size()) << "deriv written though null";
          }
          const auto again = f.run(7, stream_);
          EXPECT_TRUE(same_bytes(out.z, again.z) && same_bytes(out.deriv, again.deriv) &&
                      same_bytes(out.b16, again.b16))
              << "not bitwise repeatable";
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// Keep/drop decisions are the CPU's (same hash, threshold and key), dropped units are exactly 0,
// and the step is read from device memory at launch.
TEST_F(CudaKernels, DropoutMasksAreTheCpus) {
  for (const auto& [rows, cols] : kShapes) {
    SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
    ForwardRun f(ForwardCase{rows, cols, Act::tanh, true, true, 0}, 7 * static_cast<std::uint64_t>(rows) + cols);
    std::size_t dropped = 0, changed = 0;
    std::vector<float> previous;
    for (const std::uint64_t step : {0ull, 1ull, 12345ull}) {
      const auto out = f.run(step, stream_);
      const std::vector<float> cpu = f.cpu(step, 2);  // 2: tanh, zero only where dropped
      for (int r = 0; r < rows; ++r) {
        for (int j = 0; j < cols; ++j) {
          const std::size_t i = static_cast<std::size_t>(r) * static_cast<std::size_t>(cols) +
                                static_cast<std::size_t>(j);
          const bool kept = f.keep(step, r, j);
          if (f.zero_input(r, j)) continue;
          ASSERT_EQ(kept, cpu[i] != 0.0f) << "reference disagrees with the CPU at " << r << "," << j;
          ASSERT_EQ(kept, out.z[i] != 0.0f) << "row " << r << " unit " << j << " step " << step;
          if (!kept) {
            ASSERT_EQ(out.deriv[i], 0.0f);
            ++dropped;
          }
          EXPECT_NEAR(out.z[i], cpu[i], 1e-6 * (1 + std::abs(cpu[i])));
        }
      }
      if (!previous.empty()) {
        for (std::size_t i = 0; i < previous.size(); ++i) {
          changed += (previous[i] == 0.0f) != (out.z[i] == 0.0f) ? 1 : 0;
        }
      }
      previous = out.z;
    }
    const double total = 3.0 * rows * cols;
    if (total >= 1000) {
      EXPECT_NEAR(static_cast<double>(dropped) / total, ForwardRun::kP, 0.05);
      EXPECT_GT(changed, 0u) << "the mask does not follow the device step";
    }
  }
}

TEST_F(CudaKernels, ActBackwardMatchesFloat64) {
  std::uint64_t seed = 900;
  for (const auto& [rows, cols] : kShapes) {
    for (const bool with_deriv : {true, false}) {
      for (const std::size_t offset : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " deriv " << with_deriv
                                          << " offset " << offset);
        const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
        const auto g0 = uniform(n, -2.0f, 2.0f, ++seed);
        auto deriv = uniform(n, 0.0f, 1.5f, ++seed);
        auto h = uniform(n, -1.0f, 1.0f, ++seed);
        for (std::size_t i = 0; i < n; i += 5) deriv[i] = 0.0f;  // dropped units
        for (std::size_t i = 1; i < n; i += 7) h[i] = 0.0f;      // h > 0 is strict
        const float scale = 1.0f / 0.7f;
        Dev<float> g(n, offset), dd(deriv, offset), dh(h, offset);
        Dev<Bf16Bits> g16(n, offset);
        std::vector<double> ref(n);
        for (std::size_t i = 0; i < n; ++i) {
          ref[i] = with_deriv ? static_cast<double>(g0[i]) * deriv[i]
                              : (h[i] > 0 ? static_cast<double>(g0[i]) * scale : 0.0);
        }
        std::vector<float> first;
        std::vector<Bf16Bits> first16;
        for (int rep = 0; rep < 2; ++rep) {
          g.upload(g0);
          g16.poison();
          act_backward(g.get(), with_deriv ? dd.get() : nullptr, with_deriv ? nullptr : dh.get(),
                       scale, bf(g16), rows, cols, stream_);
          sync();
          const auto out = g.download();
          const auto out16 = g16.download();
          EXPECT_TRUE(matches(out, ref, 1e-6));
          EXPECT_TRUE(bf16_of(out16, out));
          EXPECT_TRUE(g.intact() && g16.intact());
          if (rep == 0) {
            first = out;
            first16 = out16;
          } else {
            EXPECT_TRUE(same_bytes(first, out) && same_bytes(first16, out16));
          }
        }
      }
    }
  }
}

TEST_F(CudaKernels, ColumnSumsMatchFloat64) {
  std::uint64_t seed = 2000;
  for (const int rows : {1, 7, 128, 256, 257, 1000, 2049}) {
    for (const int cols : {1, 10, 128, 257, 784}) {
      SCOPED_TRACE(::testing::Message() << rows << "x" << cols);
      const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
      const auto g = uniform(n, -1.0f, 2.0f, ++seed);
      std::vector<double> ref(static_cast<std::size_t>(cols), 0.0), mag(ref.size(), 0.0);
      for (std::size_t i = 0; i < n; ++i) {
        ref[i % static_cast<std::size_t>(cols)] += g[i];
        mag[i % static_cast<std::size_t>(cols)] += std::abs(g[i]);
      }
      const std::size_t scratch_n = column_sums_scratch(rows, cols);
      EXPECT_EQ(scratch_n > 0, rows > kColumnBlock);
      Dev<float> dg(g), db(ref.size()), scratch(std::max<std::size_t>(scratch_n, 1));
      std::vector<float> first;
      for (int rep = 0; rep < 2; ++rep) {
        db.poison();
        scratch.poison();
        column_sums(dg.get(), db.get(), scratch_n > 0 ? scratch.get() : nullptr, rows, cols, stream_);
        sync();
        const auto out = db.download();
        EXPECT_TRUE(matches(out, ref, 1e-5));
        for (std::size_t j = 0; j < ref.size(); ++j) {  // per column, against its condition
          EXPECT_LE(std::abs(out[j] - ref[j]), 1e-6 * mag[j]) << "column " << j;
        }
        EXPECT_TRUE(db.intact() && scratch.intact());
        if (rep == 0) {
          first = out;
        } else {
          EXPECT_TRUE(same_bytes(first, out)) << "not bitwise repeatable";
        }
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// Logits with a clear winner in half the rows (so correct counts are not ~1/classes) and exact
// ties in some rows (the FIRST argmax counts, as on the CPU).
std::vector<float> logits_for(int rows, int classes, std::vector<std::int32_t>& labels,
                              std::uint64_t seed) {
  auto z = uniform(static_cast<std::size_t>(rows) * static_cast<std::size_t>(classes), -3.0f, 3.0f, seed);
  std::mt19937_64 gen(seed + 1);
  labels.resize(static_cast<std::size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    float* row = z.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(classes);
    auto& label = labels[static_cast<std::size_t>(r)];
    label = static_cast<std::int32_t>(gen() % static_cast<std::uint64_t>(classes));
    if (r % 2 == 0) row[label] += 4.0f;
    if (r % 5 == 1 && classes > 1) {  // a tie for the maximum at a and b > a
      const int a = static_cast<int>(gen() % static_cast<std::uint64_t>(classes - 1));
      const int b = a + 1 + static_cast<int>(gen() % static_cast<std::uint64_t>(classes - 1 - a));
      row[a] = row[b] = 10.0f;
      label = r % 10 == 1 ? a : b;
    }
  }
  return z;
}

struct LossRef {
  double loss = 0;
  long long correct = 0;
  std::vector<double> grad;
};

int first_argmax(const float* z, int n) {
  int best = 0;
  for (int j = 1; j < n; ++j) best = z[j] > z[best] ? j : best;
  return best;
}

LossRef cross_entropy_ref(const std::vector<float>& z, const std::vector<std::int32_t>& labels,
                          int rows, int classes, double inv) {
  LossRef ref;
  ref.grad.resize(z.size());
  for (int r = 0; r < rows; ++r) {
    const std::size_t base = static_cast<std::size_t>(r) * static_cast<std::size_t>(classes);
    const int label = labels[static_cast<std::size_t>(r)];
    const int best = first_argmax(z.data() + base, classes);
    const double m = z[base + static_cast<std::size_t>(best)];
    double sum = 0;
    for (int j = 0; j < classes; ++j) sum += std::exp(z[base + static_cast<std::size_t>(j)] - m);
    ref.loss += m + std::log(sum) - z[base + static_cast<std::size_t>(label)];
    ref.correct += best == label ? 1 : 0;
    for (int j = 0; j < classes; ++j) {
      const double p = std::exp(z[base + static_cast<std::size_t>(j)] - m) / sum;
      ref.grad[base + static_cast<std::size_t>(j)] = (p - (j == label ? 1.0 : 0.0)) * inv;
    }
  }
  return ref;
}

TEST_F(CudaKernels, SoftmaxCrossEntropyMatchesFloat64AndCpu) {
  std::uint64_t seed = 3000;
  for (const int classes : {1, 2, 10, 31, 32, 33, 100, 257, 1000, 1500}) {
    for (const int rows : {1, 7, 128, 1000}) {
      SCOPED_TRACE(::testing::Message() << rows << " rows x " << classes << " classes");
      std::vector<std::int32_t> labels;
      const auto z = logits_for(rows, classes, labels, ++seed);
      const double divisor = 1024.0;
      const float inv = static_cast<float>(1.0 / divisor);
      const LossRef ref = cross_entropy_ref(z, labels, rows, classes, inv);
      const LossStats cpu = locus::train::softmax_cross_entropy(z, rows, classes, labels, {}, divisor);
      Dev<float> dz(z), dg(z.size()), dinv(std::vector<float>{inv});
      Dev<std::int32_t> dl(labels);
      Dev<double> row_scratch(static_cast<std::size_t>(rows));
      Dev<DeviceLossStats> stats(1);
      std::vector<float> first;
      DeviceLossStats first_stats{};
      for (int rep = 0; rep < 3; ++rep) {
        const bool grad = rep < 2;
        dg.poison();
        row_scratch.poison();
        stats.poison();
        softmax_cross_entropy(dz.get(), dl.get(), grad ? dg.get() : nullptr, dinv.get(),
                              row_scratch.get(), stats.get(), rows, classes, stream_);
        sync();
        const DeviceLossStats st = stats.download()[0];
        const auto g = dg.download();
        EXPECT_NEAR(st.loss_sum, ref.loss, 1e-5 * std::abs(ref.loss) + 1e-9);
        EXPECT_EQ(st.correct, ref.correct);
        EXPECT_EQ(st.correct, cpu.correct) << "first-argmax rule differs from the CPU";
        EXPECT_NEAR(st.loss_sum, cpu.loss_sum, 1e-5 * std::abs(cpu.loss_sum) + 1e-9);
        EXPECT_TRUE(dg.intact() && row_scratch.intact() && stats.intact());
        if (grad) {
          EXPECT_TRUE(matches(g, ref.grad, 1e-5));
        } else {
          EXPECT_EQ(count_nan(g), g.size()) << "dlogits written though null";
        }
        if (rep == 0) {
          first = g;
          first_stats = st;
        } else {
          if (grad) {
            EXPECT_TRUE(same_bytes(first, g)) << "dlogits not bitwise repeatable";
          }
          EXPECT_EQ(std::memcmp(&first_stats, &st, sizeof(st)), 0) << "stats not repeatable";
        }
      }
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST_F(CudaKernels, MeanSquaredErrorMatchesFloat64) {
  std::uint64_t seed = 4000;
  for (const int width : {1, 3, 10, 32, 33, 100}) {
    for (const int rows : {1, 7, 128, 1000}) {
      for (const bool with_labels : {false, true}) {
        SCOPED_TRACE(::testing::Message() << rows << "x" << width << " labels " << with_labels);
        const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(width);
        const auto out = uniform(n, -2.0f, 2.0f, ++seed);
        const auto t = uniform(n, -1.0f, 1.0f, ++seed);
        std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
        std::mt19937_64 gen(seed);
        for (auto& l : labels) l = static_cast<std::int32_t>(gen() % static_cast<std::uint64_t>(width));
        const float inv = static_cast<float>(1.0 / 512.0);
        double loss = 0;
        long long correct = 0;
        std::vector<double> grad(n);
        for (int r = 0; r < rows; ++r) {
          const std::size_t base = static_cast<std::size_t>(r) * static_cast<std::size_t>(width);
          double row = 0;
          for (std::size_t j = base; j < base + static_cast<std::size_t>(width); ++j) {
            const double d = static_cast<double>(out[j]) - t[j];
            row += d * d;
            grad[j] = d * 2.0 / width * inv;
          }
          loss += row / width;
          correct += first_argmax(out.data() + base, width) == labels[static_cast<std::size_t>(r)];
        }
        Dev<float> dout(out), dt(t), dg(n), dinv(std::vector<float>{inv});
        Dev<std::int32_t> dl(labels);
        Dev<double> row_scratch(static_cast<std::size_t>(rows));
        Dev<DeviceLossStats> stats(1);
        std::vector<float> first;
        for (int rep = 0; rep < 2; ++rep) {
          dg.poison();
          row_scratch.poison();
          stats.poison();
          mean_squared_error(dout.get(), dt.get(), with_labels ? dl.get() : nullptr, dg.get(),
                             dinv.get(), row_scratch.get(), stats.get(), rows, width, stream_);
          sync();
          const DeviceLossStats st = stats.download()[0];
          EXPECT_NEAR(st.loss_sum, loss, 1e-5 * loss);
          EXPECT_EQ(st.correct, with_labels ? correct : 0);
          const auto g = dg.download();
          EXPECT_TRUE(matches(g, grad, 1e-5));
          EXPECT_TRUE(dg.intact() && stats.intact() && row_scratch.intact());
          if (rep == 0) {
            first = g;
          } else {
            EXPECT_TRUE(same_bytes(first, g));
          }
        }
      }
    }
  }
}

TEST_F(CudaKernels, GatherRowsIsExact) {
  const int src_rows = 5000;
  std::uint64_t seed = 5000;
  for (const int cols : {1, 10, 257, 784}) {
    for (const int rows : {1, 7, 1000}) {
      for (const std::size_t offset : {0, 1}) {
        for (const bool with_labels : {true, false}) {
          SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " offset " << offset
                                            << " labels " << with_labels);
          const auto src = uniform(static_cast<std::size_t>(src_rows) * static_cast<std::size_t>(cols), -1, 1, ++seed);
          std::vector<std::int32_t> labels(static_cast<std::size_t>(src_rows));
          std::mt19937_64 gen(seed);
          for (auto& l : labels) l = static_cast<std::int32_t>(gen() % 1000);
          std::vector<std::int64_t> index(static_cast<std::size_t>(rows));
          for (auto& i : index) i = static_cast<std::int64_t>(gen() % src_rows);
          index.front() = src_rows - 1;  // the last row, and a repeat
          if (rows > 2) index[1] = index.front();
          Dev<float> dsrc(src, offset), ddst(index.size() * static_cast<std::size_t>(cols), offset);
          Dev<std::int64_t> didx(index);
          Dev<std::int32_t> dlab(labels), dout_lab(index.size());
          ddst.poison();
          dout_lab.poison();
          gather_rows(dsrc.get(), didx.get(), ddst.get(), rows, cols,
                      with_labels ? dlab.get() : nullptr, dout_lab.get(), stream_);
          sync();
          const auto dst = ddst.download();
          const auto got_labels = dout_lab.download();
          for (std::size_t r = 0; r < index.size(); ++r) {
            const auto from = static_cast<std::size_t>(index[r]);
            ASSERT_EQ(std::memcmp(dst.data() + r * static_cast<std::size_t>(cols),
                                  src.data() + from * static_cast<std::size_t>(cols),
                                  static_cast<std::size_t>(cols) * sizeof(float)), 0)
                << "row " << r;
            ASSERT_EQ(got_labels[r], with_labels ? labels[from] : -1) << "label of row " << r;
          }
          EXPECT_TRUE(ddst.intact() && dout_lab.intact());
        }
      }
    }
  }
}

// loader.gather = device: the source is page-locked host memory read through its mapped
// device pointer, 8192 rows at once (several row blocks per column block, so the grid cap and
// the row-stride loop both run), vector and scalar paths (src offset by one float), the grid
// capped at 8 blocks or not, and 0 rows.
TEST_F(CudaKernels, GatherRowsFromMappedHostMemoryIsExact) {
  const int src_rows = 20000, rows = 8192;
  for (const int cols : {13, 784}) {
    for (const std::size_t offset : {0, 1}) {
      for (const int max_blocks : {0, 8}) {
        SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " offset " << offset
                                          << " max_blocks " << max_blocks);
        const std::size_t width = static_cast<std::size_t>(cols);
        std::vector<float> host(offset + static_cast<std::size_t>(src_rows) * width);
        const auto values = uniform(static_cast<std::size_t>(src_rows) * width, -1, 1,
                                    static_cast<std::uint64_t>(cols) * 10 + offset);
        std::copy(values.begin(), values.end(), host.begin() + static_cast<std::ptrdiff_t>(offset));
        ASSERT_EQ(cudaHostRegister(host.data(), host.size() * sizeof(float),
                                   cudaHostRegisterMapped), cudaSuccess);
        void* mapped = nullptr;
        ASSERT_EQ(cudaHostGetDevicePointer(&mapped, host.data(), 0), cudaSuccess);
        // Offset 0 must take the vector path: the block's start is 16-byte aligned.
        ASSERT_EQ(reinterpret_cast<std::uintptr_t>(mapped) % 16, 0u);
        std::mt19937_64 gen(static_cast<std::uint64_t>(cols));
        std::vector<std::int64_t> index(static_cast<std::size_t>(rows));
        for (auto& i : index) i = static_cast<std::int64_t>(gen() % src_rows);
        index.front() = 0;
        index.back() = src_rows - 1;
        Dev<float> ddst(index.size() * width);
        Dev<std::int64_t> didx(index);
        ddst.poison();
        gather_rows(static_cast<const float*>(mapped) + offset, didx.get(), ddst.get(), rows, cols,
                    nullptr, nullptr, stream_, max_blocks);
        gather_rows(static_cast<const float*>(mapped) + offset, didx.get(), ddst.get(), 0, cols,
                    nullptr, nullptr, stream_, max_blocks);
        sync();
        const auto dst = ddst.download();
        for (std::size_t r = 0; r < index.size(); ++r) {
          const auto from = static_cast<std::size_t>(index[r]);
          ASSERT_EQ(std::memcmp(dst.data() + r * width, values.data() + from * width,
                                width * sizeof(float)), 0) << "row " << r;
        }
        EXPECT_TRUE(ddst.intact());
        ASSERT_EQ(cudaHostUnregister(host.data()), cudaSuccess);
      }
    }
  }
}

// The bf16 gather of loader.gather = device at bf16: rows of bf16 bits in page-locked mapped
// host memory copied exactly, by 16-byte units (784 columns, aligned), 4-byte units (14) and
// single values (13 columns, or the source one value off alignment); capped grid or not; 0
// rows writes nothing.
TEST_F(CudaKernels, GatherBf16RowsFromMappedHostMemoryIsExact) {
  const int src_rows = 20000, rows = 8192;
  for (const int cols : {13, 14, 784}) {
    for (const std::size_t offset : {0, 1}) {
      for (const int max_blocks : {0, 8}) {
        SCOPED_TRACE(::testing::Message() << rows << "x" << cols << " offset " << offset
                                          << " max_blocks " << max_blocks);
        const std::size_t width = static_cast<std::size_t>(cols);
        const std::size_t count = static_cast<std::size_t>(src_rows) * width;
        std::vector<Bf16Bits> host(offset + count);
        std::mt19937_64 bits(static_cast<std::uint64_t>(cols) * 10 + offset);
        for (std::size_t i = 0; i < count; ++i) {
          // Never the poison's 0xFFFF: an element left unwritten must differ from its source.
          do {
            host[offset + i] = static_cast<Bf16Bits>(bits());
          } while (host[offset + i] == 0xFFFF);
        }
        ASSERT_EQ(cudaHostRegister(host.data(), host.size() * sizeof(Bf16Bits),
                                   cudaHostRegisterMapped), cudaSuccess);
        void* mapped = nullptr;
        ASSERT_EQ(cudaHostGetDevicePointer(&mapped, host.data(), 0), cudaSuccess);
        // Offset 0 must take the vector path: the block's start is 16-byte aligned.
        ASSERT_EQ(reinterpret_cast<std::uintptr_t>(mapped) % 16, 0u);
        const auto* src = static_cast<const __nv_bfloat16*>(mapped) + offset;
        std::mt19937_64 gen(static_cast<std::uint64_t>(cols));
        std::vector<std::int64_t> index(static_cast<std::size_t>(rows));
        for (auto& i : index) i = static_cast<std::int64_t>(gen() % src_rows);
        index.front() = 0;
        index.back() = src_rows - 1;
        Dev<Bf16Bits> ddst(index.size() * width);
        Dev<std::int64_t> didx(index);
        ddst.poison();
        gather_bf16_rows(src, didx.get(), bf(ddst), rows, cols, stream_, max_blocks);
        gather_bf16_rows(src, didx.get(), bf(ddst), 0, cols, stream_, max_blocks);
        sync();
        const auto dst = ddst.download();
        for (std::size_t r = 0; r < index.size(); ++r) {
          const std::size_t from = offset + static_cast<std::size_t>(index[r]) * width;
          ASSERT_EQ(std::memcmp(dst.data() + r * width, host.data() + from,
                                width * sizeof(Bf16Bits)), 0) << "row " << r;
        }
        EXPECT_TRUE(ddst.intact());
        ASSERT_EQ(cudaHostUnregister(host.data()), cudaSuccess);
      }
    }
  }
}

TEST_F(CudaKernels, ToBf16RoundsToNearestEven) {
  std::vector<float> special = {0.0f, -0.0f, 1.0f, -1.0f, INFINITY, -INFINITY, NAN,
                                3.4028235e38f,   // rounds up to inf
                                1e-40f,          // subnormal
                                1.00390625f,     // 1 + 2^-8: exactly half, ties to even (down)
                                1.01171875f,     // 1 + 3 * 2^-8: half, ties to even (up)
                                1.0039063f, -2.5e-3f};
  for (const std::size_t n : {std::size_t{1}, std::size_t{3}, std::size_t{4}, std::size_t{1001},
                              std::size_t{(1u << 20) + 1}}) {
    for (const std::size_t offset : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << n << " values, offset " << offset);
      auto v = uniform(n, -1e3f, 1e3f, n + offset);
      for (std::size_t i = 0; i < std::min(n, special.size()); ++i) v[i] = special[i];
      Dev<float> src(v, offset);
      Dev<Bf16Bits> dst(n, offset);
      dst.poison();
      to_bf16(src.get(), bf(dst), n, stream_);
      sync();
      EXPECT_TRUE(bf16_of(dst.download(), v));
      EXPECT_TRUE(dst.intact());
    }
  }
}

// The device's conversion gives exactly the host's (host_bf16.hpp, which the bf16 device cache
// and loader.gather = device use in its place): the same bits for every number (ties,
// subnormals, overflow to infinity among them), a NaN for every NaN (its bits are the
// hardware's: a NaN feature makes the loss NaN on either path).
TEST_F(CudaKernels, ToBf16GivesTheHostConversionsBits) {
  std::vector<float> v = uniform(4096, -1e3f, 1e3f, 99);
  const std::uint32_t specials[] = {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u,
                                    0x7fbfffffu, 0x7f80ffffu, 0x00000001u, 0x807fffffu,
                                    0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0xff7fffffu};
  for (std::size_t i = 0; i < std::size(specials); ++i) {
    v[i] = std::bit_cast<float>(specials[i]);
  }
  Dev<float> src(v);
  Dev<Bf16Bits> dst(v.size());
  dst.poison();
  to_bf16(src.get(), bf(dst), v.size(), stream_);
  sync();
  const auto got = dst.download();
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (std::isnan(v[i])) {
      EXPECT_GT(got[i] & 0x7fffu, 0x7f80u) << "element " << i << " is NaN: bf16 bits 0x"
                                           << std::hex << got[i];
      continue;
    }
    ASSERT_EQ(got[i], locus::train::cuda::bf16_bits(v[i]))
        << "element " << i << ", float bits 0x" << std::hex << std::bit_cast<std::uint32_t>(v[i]);
  }
}

// Size 0 launches nothing and reports nothing; the loss and norm still write their outputs.
TEST_F(CudaKernels, ZeroSizesAreNoOps) {
  Dev<DeviceLossStats> stats(1);
  Dev<double> norm(1);
  Dev<float> scale(1);
  stats.poison();
  bias_act_forward(nullptr, nullptr, nullptr, nullptr, 0, 16, Act::gelu, DropoutArgs{}, stream_);
  bias_act_forward(nullptr, nullptr, nullptr, nullptr, 16, 0, Act::relu, DropoutArgs{}, stream_);
  act_backward(nullptr, nullptr, nullptr, 1.0f, nullptr, 0, 8, stream_);
  column_sums(nullptr, nullptr, nullptr, 8, 0, stream_);
  softmax_cross_entropy(nullptr, nullptr, nullptr, nullptr, nullptr, stats.get(), 0, 10, stream_);
  sgd_update(nullptr, nullptr, nullptr, nullptr, 0, SgdConfig{}, nullptr, nullptr, stream_);
  adam_update(nullptr, nullptr, nullptr, nullptr, nullptr, 0, AdamConfig{}, nullptr, nullptr, stream_);
  gather_rows(nullptr, nullptr, nullptr, 0, 4, nullptr, nullptr, stream_);
  gather_bf16_rows(nullptr, nullptr, nullptr, 0, 8, stream_);
  to_bf16(nullptr, nullptr, 0, stream_);
  grad_norm_and_scale(nullptr, 0, 1.0, nullptr, norm.get(), scale.get(), stream_);
  sync();
  const DeviceLossStats st = stats.download()[0];
  EXPECT_EQ(st.loss_sum, 0.0);
  EXPECT_EQ(st.correct, 0);
  EXPECT_EQ(norm.download()[0], 0.0);
  EXPECT_EQ(scale.download()[0], 1.0f);
}

// cuBLASLt is opened at run time (not linked): it loads, with every function the backend calls,
// on a machine without a GPU too (no device needed: this test never skips).
TEST(CublasLt, LoadsAtRunTimeWithEveryFunction) {
  const CublasLt& f = lt();
  for (const void* fn :
       {reinterpret_cast<const void*>(f.Create), reinterpret_cast<const void*>(f.Destroy),
        reinterpret_cast<const void*>(f.GetVersion), reinterpret_cast<const void*>(f.GetStatusName),
        reinterpret_cast<const void*>(f.GetStatusString), reinterpret_cast<const void*>(f.Matmul),
        reinterpret_cast<const void*>(f.MatmulAlgoGetHeuristic),
        reinterpret_cast<const void*>(f.MatmulDescCreate),
        reinterpret_cast<const void*>(f.MatmulDescDestroy),
        reinterpret_cast<const void*>(f.MatmulDescSetAttribute),
        reinterpret_cast<const void*>(f.MatmulPreferenceCreate),
        reinterpret_cast<const void*>(f.MatmulPreferenceDestroy),
        reinterpret_cast<const void*>(f.MatmulPreferenceSetAttribute),
        reinterpret_cast<const void*>(f.MatrixLayoutCreate),
        reinterpret_cast<const void*>(f.MatrixLayoutDestroy)}) {
    EXPECT_NE(fn, nullptr);
  }
  EXPECT_GE(f.GetVersion(), 130000u) << "the cuBLASLt of CUDA 13";
  EXPECT_EQ(Matmul::version(), "cuBLASLt " + std::to_string(f.GetVersion()));
  EXPECT_STREQ(f.GetStatusName(CUBLAS_STATUS_SUCCESS), "CUBLAS_STATUS_SUCCESS");
}

}  // namespace
}  // namespace locus::train::cuda::test
