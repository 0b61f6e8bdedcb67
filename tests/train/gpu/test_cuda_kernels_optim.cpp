// The CUDA optimizer, gradient-norm and clipping kernels (src/cuda/kernels.cu) against the CPU
// Optimizer classes and clip functions run on the same data for several steps, and a training
// step's kernels captured into a CUDA graph against the same kernels launched eagerly.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda/kernels.hpp"
#include "cuda_kernels_util.hpp"
#include "locus/train/optim/clip.hpp"
#include "locus/train/optim/optimizer.hpp"

namespace locus::train::cuda::test {
namespace {

using Bf16Bits = std::uint16_t;
__nv_bfloat16* bf(const Dev<Bf16Bits>& d) { return reinterpret_cast<__nv_bfloat16*>(d.get()); }

// The scalars exactly as CudaCompute::optimizer_step forms them from the CPU's formulas.
OptimizerScalars scalars_for(const OptimizerOptions& o, std::int64_t steps, double lr) {
  OptimizerScalars sc{};
  sc.neg_lr = static_cast<float>(-lr);
  sc.first_step = steps == 0 ? 1 : 0;
  sc.grad_coef = steps == 0 ? 1.0f : static_cast<float>(1.0 - o.dampening);
  const double t = static_cast<double>(steps + 1);
  sc.decay_factor = static_cast<float>(1.0 - lr * o.weight_decay);
  sc.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, t)));
  sc.neg_step_size = static_cast<float>(-lr / (1.0 - std::pow(o.beta1, t)));
  return sc;
}

std::vector<double> widen(std::span<const float> v) { return {v.begin(), v.end()}; }

std::size_t bit_mismatches(const std::vector<float>& a, std::span<const float> b) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return n;
}

// One fused update of options o's kind through the kernels (momentum buffer a; Adam's moments
// a and b), as DeviceState::issue_update calls them.
void device_update(const OptimizerOptions& o, float* p, const float* g, float* a, float* b,
                   __nv_bfloat16* p16, std::size_t n, const OptimizerScalars* sc,
                   const float* scale, cudaStream_t stream, const double* gate = nullptr) {
  if (o.kind == OptimizerKind::sgd) {
    SgdConfig cfg;
    cfg.weight_decay = static_cast<float>(o.weight_decay);
    cfg.momentum = static_cast<float>(o.momentum);
    cfg.nesterov = o.nesterov;
    sgd_update(p, g, o.momentum != 0.0 ? a : nullptr, p16, n, cfg, sc, scale, stream, gate);
  } else {
    AdamConfig cfg;
    cfg.weight_decay = static_cast<float>(o.weight_decay);
    cfg.decoupled = o.kind == OptimizerKind::adamw;
    cfg.beta1 = o.beta1;
    cfg.beta2 = o.beta2;
    cfg.eps = o.eps;
    adam_update(p, g, a, b, p16, n, cfg, sc, scale, stream, gate);
  }
}

struct OptimCase {
  std::string name;
  OptimizerOptions options;
};

std::vector<OptimCase> optim_cases() {
  std::vector<OptimCase> cases;
  auto sgd = [](double wd, double momentum, double dampening, bool nesterov) {
    OptimizerOptions o;
    o.kind = OptimizerKind::sgd;
    o.weight_decay = wd;
    o.momentum = momentum;
    o.dampening = dampening;
    o.nesterov = nesterov;
    return o;
  };
  auto adam = [](OptimizerKind kind, double wd, double b1, double b2, double eps) {
    OptimizerOptions o;
    o.kind = kind;
    o.weight_decay = wd;
    o.beta1 = b1;
    o.beta2 = b2;
    o.eps = eps;
    return o;
  };
  cases.push_back({"sgd", sgd(0, 0, 0, false)});
  cases.push_back({"sgd wd", sgd(1e-2, 0, 0, false)});
  cases.push_back({"sgd momentum", sgd(0, 0.9, 0, false)});
  cases.push_back({"sgd momentum dampening wd", sgd(5e-4, 0.9, 0.1, false)});
  cases.push_back({"sgd nesterov", sgd(0, 0.9, 0, true)});
  cases.push_back({"sgd nesterov wd", sgd(1e-3, 0.8, 0, true)});
  cases.push_back({"adam", adam(OptimizerKind::adam, 0, 0.9, 0.999, 1e-8)});
  cases.push_back({"adam l2", adam(OptimizerKind::adam, 1e-2, 0.9, 0.999, 1e-8)});
  cases.push_back({"adamw", adam(OptimizerKind::adamw, 1e-2, 0.9, 0.999, 1e-8)});
  cases.push_back({"adamw betas", adam(OptimizerKind::adamw, 0.1, 0.95, 0.98, 1e-6)});
  return cases;
}

// Five steps on fresh gradients with a varying lr and clipping factor; after every step the
// parameters and state match the CPU optimizer's to 1e-5 (the operation order is the same, so
// they are expected to be bitwise equal: mismatching bits are counted and printed).
TEST_F(CudaKernels, OptimizersMatchCpuOverSeveralSteps) {
  std::uint64_t seed = 7000;
  for (const OptimCase& c : optim_cases()) {
    for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{4099},
                                std::size_t{(1u << 20) + 3}}) {
      for (const std::size_t offset : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << c.name << ", " << n << " params, offset " << offset);
        const OptimizerOptions& o = c.options;
        const bool sgd = o.kind == OptimizerKind::sgd;
        auto cpu = make_optimizer(o, n);
        std::vector<float> params = uniform(n, -1.0f, 1.0f, ++seed);
        Dev<float> p(params, offset), g(n, offset), a(n, offset), b(n, offset), scale(1);
        Dev<Bf16Bits> p16(n, offset);
        Dev<OptimizerScalars> sc(1);
        a.set(0.0f);
        b.set(0.0f);
        if (sgd) a.poison();  // the first step must not read the momentum buffer
        const bool momentum = sgd && o.momentum != 0.0;
        std::size_t mismatched = 0;
        for (int step = 0; step < 5; ++step) {
          const double lr = 0.05 * (1.0 + 0.3 * step);
          const float grad_scale = step % 2 == 1 ? 0.625f : 1.0f;
          const auto grads = uniform(n, -2.0f, 2.0f, ++seed);
          g.upload(grads);
          sc.upload({scalars_for(o, cpu->steps(), lr)});
          scale.set(grad_scale);
          p16.poison();
          device_update(o, p.get(), g.get(), a.get(), b.get(), bf(p16), n, sc.get(), scale.get(),
                        stream_);
          sync();
          cpu->step(params, grads, lr, grad_scale);
          const auto got = p.download();
          ASSERT_TRUE(matches(got, widen(params), 1e-5)) << "params after step " << step + 1;
          EXPECT_TRUE(bf16_of(p16.download(), got));
          mismatched += bit_mismatches(got, params);
          const std::vector<NamedSpan<float>> state = cpu->state();
          ASSERT_EQ(state.size(), sgd ? (momentum ? 1u : 0u) : 2u);
          for (std::size_t k = 0; k < state.size(); ++k) {
            const auto dev = (k == 0 ? a : b).download();
            ASSERT_TRUE(matches(dev, widen(state[k].data), 1e-5))
                << state[k].name << " after step " << step + 1;
            mismatched += bit_mismatches(dev, state[k].data);
          }
          ASSERT_TRUE(p.intact() && g.intact() && a.intact() && b.intact() && p16.intact());
        }
        if (mismatched > 0) {
          std::cout << "[ info ] " << c.name << ", n " << n << ": " << mismatched
                    << " values differ in their bits from the CPU optimizer (within 1e-5)\n";
        }
      }
    }
  }
}

// The update's gate (kernels.hpp): a finite *gate changes nothing (the same bits as no gate);
// a non-finite one (NaN, +-inf: a diverged step's sum of squares) leaves the parameters, their
// bf16 copy and the optimizer state exactly as they were.
TEST_F(CudaKernels, OptimizersSkipTheUpdateBehindANonFiniteGate) {
  std::uint64_t seed = 7500;
  for (const OptimCase& c : optim_cases()) {
    for (const std::size_t n : {std::size_t{7}, std::size_t{4099}}) {
      for (const std::size_t offset : {0, 1}) {
        SCOPED_TRACE(::testing::Message() << c.name << ", " << n << " params, offset " << offset);
        const OptimizerOptions& o = c.options;
        const auto params = uniform(n, -1.0f, 1.0f, ++seed);
        const auto grads = uniform(n, -2.0f, 2.0f, ++seed);
        const auto state_a = uniform(n, -0.5f, 0.5f, ++seed);
        const auto state_b = uniform(n, 0.0f, 0.5f, ++seed);
        auto cpu = make_optimizer(o, n);
        cpu->set_steps(3);  // not the first step: the momentum buffer is read
        // One update per gate value, each from the same starting point.
        auto run = [&](const double* gate_value) {
          Dev<float> p(params, offset), g(grads, offset), a(state_a, offset), b(state_b, offset);
          Dev<float> scale(1);
          Dev<Bf16Bits> p16(n, offset);
          Dev<OptimizerScalars> sc(1);
          Dev<double> gate(1);
          p16.poison();
          scale.set(1.0f);
          sc.upload({scalars_for(o, cpu->steps(), 0.05)});
          if (gate_value != nullptr) gate.set(*gate_value);
          device_update(o, p.get(), g.get(), a.get(), b.get(), bf(p16), n, sc.get(), scale.get(),
                        stream_, gate_value != nullptr ? gate.get() : nullptr);
          sync();
          EXPECT_TRUE(p.intact() && g.intact() && a.intact() && b.intact() && p16.intact());
          return std::vector<std::vector<float>>{p.download(), a.download(), b.download()};
        };
        const auto plain = run(nullptr);
        EXPECT_NE(bit_mismatches(plain[0], params), 0u) << "the ungated update changed nothing";
        const double finite = 123.25;
        EXPECT_EQ(run(&finite), plain) << "a finite gate changed the update";
        for (const double bad : {std::numeric_limits<double>::quiet_NaN(),
                                 std::numeric_limits<double>::infinity(),
                                 -std::numeric_limits<double>::infinity()}) {
          const auto gated = run(&bad);
          EXPECT_EQ(bit_mismatches(gated[0], params), 0u) << "parameters updated behind " << bad;
          EXPECT_EQ(bit_mismatches(gated[1], state_a), 0u) << "state updated behind " << bad;
          EXPECT_EQ(bit_mismatches(gated[2], state_b), 0u) << "state updated behind " << bad;
        }
      }
    }
  }
}

TEST_F(CudaKernels, GradNormAndClipFactor) {
  std::uint64_t seed = 8000;
  for (const std::size_t n : {std::size_t{1}, std::size_t{7}, std::size_t{4095}, std::size_t{4096},
                              std::size_t{4097}, std::size_t{3 * 4096 + 5}, std::size_t{1} << 20,
                              std::size_t{10000019}}) {
    const auto grads = uniform(n, -1.0f, 1.0f, ++seed);
    long double exact = 0;
    for (const float x : grads) exact += static_cast<long double>(x) * x;
    const double ref = std::sqrt(static_cast<double>(exact));
    const double cpu = global_grad_norm(grads);
    double aligned_norm = -1;
    for (const std::size_t offset : {0, 1}) {
      for (const double max_norm : {0.0, -1.0, 0.5 * ref, 2.0 * ref}) {
        SCOPED_TRACE(::testing::Message() << n << " grads, offset " << offset << ", max_norm "
                                          << max_norm);
        Dev<float> g(grads, offset);
        Dev<double> scratch(grad_norm_scratch(n)), norm(1);
        Dev<float> scale(1);
        double first = -1;
        for (int rep = 0; rep < 2; ++rep) {
          scratch.poison();
          norm.poison();
          scale.poison();
          grad_norm_and_scale(g.get(), n, max_norm, scratch.get(), norm.get(), scale.get(), stream_);
          sync();
          const double got = norm.download()[0];
          const float factor = scale.download()[0];
          EXPECT_NEAR(got, ref, 1e-12 * ref);
          EXPECT_NEAR(got, cpu, 1e-12 * ref);
          EXPECT_EQ(factor, max_norm > 0 ? clip_factor(got, max_norm) : 1.0f);
          if (max_norm == 0.5 * ref) {
            EXPECT_NEAR(factor, 0.5f, 1e-6f);
          }
          EXPECT_TRUE(norm.intact() && scale.intact() && scratch.intact());
          if (rep == 0) {
            first = got;
          } else {
            EXPECT_EQ(std::memcmp(&first, &got, sizeof(got)), 0) << "not bitwise repeatable";
          }
          // The summation order depends on n only, not on the pointer's alignment.
          if (aligned_norm < 0) aligned_norm = got;
          EXPECT_EQ(std::memcmp(&aligned_norm, &got, sizeof(got)), 0) << "depends on alignment";
        }
      }
    }
  }
}

// A pipeline stage's share of the norm: the sum of squares (no root, no factor), the same
// blocks and order as grad_norm_and_scale (its sqrt is that norm, bit for bit), against the
// float64 reference and the CPU's sum_of_squares; independent of the alignment.
TEST_F(CudaKernels, GradSumOfSquares) {
  std::uint64_t seed = 8500;
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{4097},
                              std::size_t{3 * 4096 + 5}, std::size_t{1} << 20}) {
    const auto grads = uniform(std::max<std::size_t>(n, 1), -1.0f, 1.0f, ++seed);
    long double exact = 0;
    for (std::size_t i = 0; i < n; ++i) exact += static_cast<long double>(grads[i]) * grads[i];
    const double cpu = sum_of_squares(std::span<const float>(grads).first(n));
    double aligned = -1;
    for (const std::size_t offset : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << n << " grads, offset " << offset);
      Dev<float> g(grads, offset);
      Dev<double> scratch(grad_norm_scratch(n)), sum(1), norm(1);
      Dev<float> scale(1);
      sum.poison();
      grad_sum_of_squares(g.get(), n, scratch.get(), sum.get(), stream_);
      grad_norm_and_scale(g.get(), n, 0.0, scratch.get(), norm.get(), scale.get(), stream_);
      sync();
      const double got = sum.download()[0];
      EXPECT_NEAR(got, static_cast<double>(exact), 1e-12 * static_cast<double>(exact) + 1e-300);
      EXPECT_NEAR(got, cpu, 1e-12 * cpu + 1e-300);
      const double root = std::sqrt(got), norm_got = norm.download()[0];
      EXPECT_EQ(std::memcmp(&root, &norm_got, sizeof(root)), 0) << "not the norm's sum";
      EXPECT_TRUE(sum.intact() && scratch.intact());
      if (aligned < 0) aligned = got;
      EXPECT_EQ(std::memcmp(&aligned, &got, sizeof(got)), 0) << "depends on alignment";
    }
  }
}

// Micro-batch bias gradients added into the accumulated ones: dst += src in float, every
// element (poisoned guards intact), float4 and scalar paths alike.
TEST_F(CudaKernels, AddIntoMatchesTheCpu) {
  std::uint64_t seed = 8600;
  for (const std::size_t n : {std::size_t{1}, std::size_t{10}, std::size_t{4099}}) {
    for (const std::size_t offset : {0, 1}) {
      SCOPED_TRACE(::testing::Message() << n << " elements, offset " << offset);
      const auto a = uniform(n, -2.0f, 2.0f, ++seed);
      const auto b = uniform(n, -2.0f, 2.0f, ++seed);
      Dev<float> dst(a, offset), src(b, offset);
      add_into(dst.get(), src.get(), n, stream_);
      sync();
      const auto got = dst.download();
      for (std::size_t i = 0; i < n; ++i) {
        const float want = a[i] + b[i];
        ASSERT_EQ(std::memcmp(&got[i], &want, sizeof(float)), 0) << "element " << i;
      }
      EXPECT_TRUE(dst.intact() && src.intact());
    }
  }
}

// Forward epilogue (dropout, step from device memory), loss, column sums, backward, norm and
// adam captured once into a graph; replays with new device-side step and scalars give the
// bits of the same kernels launched eagerly.
TEST_F(CudaKernels, StepKernelsReplayFromAGraph) {
  const int rows = 300, hidden = 64, classes = 10;
  const std::size_t nh = static_cast<std::size_t>(rows) * hidden, nz = static_cast<std::size_t>(rows) * classes;
  const auto h0 = uniform(nh, -2, 2, 1), z0 = uniform(nz, -3, 3, 2), bias = uniform(hidden, -1, 1, 3);
  const auto params0 = uniform(hidden, -1, 1, 4);
  std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
  std::vector<std::uint64_t> ids(static_cast<std::size_t>(rows));
  for (int r = 0; r < rows; ++r) {
    labels[static_cast<std::size_t>(r)] = (r * 7) % classes;
    ids[static_cast<std::size_t>(r)] = static_cast<std::uint64_t>(r) * 31 + 5;
  }
  Dev<float> h(nh), deriv(nh), z(nz), dz(nz), dbias(bias), db(hidden), col(column_sums_scratch(rows, hidden));
  Dev<float> params(static_cast<std::size_t>(hidden)), m(static_cast<std::size_t>(hidden)), v(static_cast<std::size_t>(hidden));
  Dev<float> inv(std::vector<float>{1.0f / 512}), scale(1);
  Dev<std::int32_t> dl(labels);
  Dev<std::uint64_t> did(ids), step(1);
  Dev<double> rows_scratch(static_cast<std::size_t>(rows)), norm_scratch(grad_norm_scratch(hidden)), norm(1);
  Dev<DeviceLossStats> stats(1);
  Dev<OptimizerScalars> sc(1);
  OptimizerOptions o;
  o.kind = OptimizerKind::adam;
  DropoutArgs drop;
  drop.enabled = true;
  drop.p = 0.25f;
  drop.seed = 99;
  drop.layer = 0;
  drop.step = step.get();
  drop.sample_ids = did.get();
  auto issue = [&] {
    bias_act_forward(h.get(), deriv.get(), nullptr, dbias.get(), rows, hidden, Act::gelu, drop, stream_);
    softmax_cross_entropy(z.get(), dl.get(), dz.get(), inv.get(), rows_scratch.get(), stats.get(),
                          rows, classes, stream_);
    act_backward(h.get(), deriv.get(), nullptr, 1.0f, nullptr, rows, hidden, stream_);
    column_sums(h.get(), db.get(), col.get(), rows, hidden, stream_);
    grad_norm_and_scale(db.get(), static_cast<std::size_t>(hidden), 1.0, norm_scratch.get(), norm.get(),
                        scale.get(), stream_);
    adam_update(params.get(), db.get(), m.get(), v.get(), nullptr, static_cast<std::size_t>(hidden),
                AdamConfig{}, sc.get(), scale.get(), stream_);
  };
  auto reset = [&](std::uint64_t s, std::int64_t steps) {
    h.upload(h0);
    z.upload(z0);
    params.upload(params0);
    m.set(0.0f);
    v.set(0.0f);
    step.set(s);
    sc.upload({scalars_for(o, steps, 1e-3)});
  };
  auto results = [&] {
    return std::vector<std::vector<float>>{h.download(), deriv.download(), dz.download(),
                                           db.download(), params.download(), m.download(),
                                           v.download(), scale.download()};
  };
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  LOCUS_TEST_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
  issue();
  LOCUS_TEST_CUDA(cudaStreamEndCapture(stream_, &graph));
  LOCUS_TEST_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<std::vector<float>> previous;
  for (const std::uint64_t s : {3u, 4u}) {
    SCOPED_TRACE(::testing::Message() << "step " << s);
    reset(s, static_cast<std::int64_t>(s));
    issue();
    sync();
    const auto eager = results();
    reset(s, static_cast<std::int64_t>(s));
    LOCUS_TEST_CUDA(cudaGraphLaunch(exec, stream_));
    sync();
    const auto replayed = results();
    for (std::size_t k = 0; k < eager.size(); ++k) {
      EXPECT_TRUE(same_bytes(eager[k], replayed[k])) << "output " << k << " differs from eager";
      EXPECT_EQ(count_nan(eager[k]), 0u) << "output " << k;
    }
    if (!previous.empty()) {
      EXPECT_FALSE(same_bytes(previous[0], replayed[0])) << "step not read";
    }
    previous = replayed;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

}  // namespace
}  // namespace locus::train::cuda::test
