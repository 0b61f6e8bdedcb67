// locus_mlp_bench: samples/s of MLP training steps (forward, softmax cross-entropy, backward,
// optimizer) on synthetic in-memory batches, next to the sgemm-only bound: the time of just
// the sgemm calls one step makes, with the same shapes and transposes. Figures by the wall
// clock and by CPU time (see StepTime).
//   locus_mlp_bench [--widths 784,256,128,10] [--batch 128] [--optimizer sgd|adam|adamw]
//                   [--steps 200] [--repeats 7] [--threads 1]
#include <cblas.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/train/model/backward.hpp"
#include "locus/train/model/blas.hpp"
#include "locus/train/optim/optimizer.hpp"

namespace {

using namespace locus::train;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string widths = "784,256,128,10";
  int batch = 128;
  std::string optimizer = "sgd";
  int steps = 200;
  int repeats = 7;
  int threads = 1;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view key = argv[i];
    const char* value = argv[i + 1];
    if (key == "--widths") a.widths = value;
    else if (key == "--batch") a.batch = std::atoi(value);
    else if (key == "--optimizer") a.optimizer = value;
    else if (key == "--steps") a.steps = std::atoi(value);
    else if (key == "--repeats") a.repeats = std::atoi(value);
    else if (key == "--threads") a.threads = std::atoi(value);
    else throw locus::ConfigError("unknown option " + std::string(key) + ": see the file header");
  }
  if (argc % 2 == 0) throw locus::ConfigError("options come in --key value pairs");
  if (a.batch < 1 || a.steps < 1 || a.repeats < 1) {
    throw locus::ConfigError("batch, steps and repeats must be >= 1");
  }
  return a;
}

// Per-step seconds, median over repeats, by the wall clock and by the process's CPU clock.
// On a shared machine the CPU clock leaves out the time other jobs hold the core (with one
// BLAS thread, CPU time == busy time of this step); the wall clock is what a user sees.
struct StepTime {
  double wall = 0.0;
  double cpu = 0.0;
};

double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

StepTime median_step_time(const Args& a, const std::function<void(int)>& fn) {
  fn(std::max(5, a.steps / 10));  // warm-up: caches, page faults, BLAS buffers
  std::vector<double> wall, cpu;
  for (int r = 0; r < a.repeats; ++r) {
    const auto t0 = Clock::now();
    const double c0 = cpu_seconds();
    fn(a.steps);
    cpu.push_back((cpu_seconds() - c0) / a.steps);
    wall.push_back(std::chrono::duration<double>(Clock::now() - t0).count() / a.steps);
  }
  return {median(wall), median(cpu)};
}

// Exactly the sgemms of one training step (forward NT, weight gradient TN, input gradient NN
// except for the first layer), on buffers of the same sizes.
struct SgemmOnly {
  std::vector<int> w;
  int b;
  std::vector<std::vector<float>> act, dact, weight, dweight;

  SgemmOnly(std::vector<int> widths, int batch) : w(std::move(widths)), b(batch) {
    for (std::size_t l = 0; l < w.size(); ++l) {
      act.emplace_back(static_cast<std::size_t>(b * w[l]), 0.01f);
      dact.emplace_back(static_cast<std::size_t>(b * w[l]), 0.01f);
      if (l + 1 < w.size()) {
        weight.emplace_back(static_cast<std::size_t>(w[l] * w[l + 1]), 0.01f);
        dweight.emplace_back(static_cast<std::size_t>(w[l] * w[l + 1]), 0.0f);
      }
    }
  }
  void step() {
    const int layers = static_cast<int>(w.size()) - 1;
    for (int l = 0; l < layers; ++l) {
      const auto i = static_cast<std::size_t>(l);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, b, w[i + 1], w[i], 1.0f,
                  act[i].data(), w[i], weight[i].data(), w[i], 0.0f, act[i + 1].data(), w[i + 1]);
    }
    for (int l = layers - 1; l >= 0; --l) {
      const auto i = static_cast<std::size_t>(l);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, w[i + 1], w[i], b, 1.0f,
                  dact[i + 1].data(), w[i + 1], act[i].data(), w[i], 0.0f, dweight[i].data(),
                  w[i]);
      if (l > 0) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, b, w[i], w[i + 1], 1.0f,
                    dact[i + 1].data(), w[i + 1], weight[i].data(), w[i], 0.0f, dact[i].data(),
                    w[i]);
      }
    }
  }
};

int run(const Args& a) {
  set_blas_threads(a.threads);
  Mlp model(ModelSpec{parse_widths(a.widths), Activation::relu, Init::he, 0.0f, 1});
  OptimizerOptions o;
  o.kind = parse_optimizer_kind(a.optimizer);
  o.momentum = o.kind == OptimizerKind::sgd ? 0.9 : 0.0;
  const double lr = o.kind == OptimizerKind::sgd ? 0.01 : 1e-3;
  auto opt = make_optimizer(o, model.layout().size());
  Workspace ws(model, a.batch);
  std::vector<float> grads(model.layout().size());

  // Eight distinct batches cycled, as an in-memory loader hands them out.
  const int in = model.layout().input_width();
  const int classes = model.layout().output_width();
  const int pool = 8;
  std::vector<float> x(static_cast<std::size_t>(pool * a.batch * in));
  std::vector<std::int32_t> y(static_cast<std::size_t>(pool * a.batch));
  std::uint64_t s = 88172645463325252ull;
  for (float& v : x) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    v = static_cast<float>(static_cast<double>(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
  }
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>((i * 7) % classes);

  std::int64_t step = 0;
  const auto batch_of = [&](std::int64_t k) {
    const auto p = static_cast<std::size_t>(k % pool);
    return Batch{std::span<const float>(x).subspan(p * a.batch * in,
                                                   static_cast<std::size_t>(a.batch * in)),
                 a.batch,
                 std::span<const std::int32_t>(y).subspan(p * a.batch,
                                                          static_cast<std::size_t>(a.batch)),
                 {},
                 {}};
  };
  const StepTime train = median_step_time(a, [&](int n) {
    for (int k = 0; k < n; ++k, ++step) {
      forward_backward(model, ws, Loss::softmax_cross_entropy, batch_of(step),
                       static_cast<std::uint64_t>(step), a.batch, grads);
      opt->step(model.params(), grads, lr);
    }
  });
  // The optimizer applied per layer from on_grads_ready, while each gradient slice is hot.
  const GradsReadyFn update_layer = [&](int l) {
    const LayerLayout& ly = model.layout().layer(l);
    opt->update(model.params(), grads, lr, 1.0f, ly.begin(), ly.end());
  };
  const StepTime in_backward = median_step_time(a, [&](int n) {
    for (int k = 0; k < n; ++k, ++step) {
      forward_backward(model, ws, Loss::softmax_cross_entropy, batch_of(step),
                       static_cast<std::uint64_t>(step), a.batch, grads, update_layer);
      opt->finish_step();
    }
  });
  const StepTime fwd_bwd = median_step_time(a, [&](int n) {
    for (int k = 0; k < n; ++k, ++step) {
      forward_backward(model, ws, Loss::softmax_cross_entropy, batch_of(step),
                       static_cast<std::uint64_t>(step), a.batch, grads);
    }
  });
  const StepTime optimizer = median_step_time(a, [&](int n) {
    for (int k = 0; k < n; ++k) opt->step(model.params(), grads, lr);
  });
  SgemmOnly sg(model.spec().widths, a.batch);
  const StepTime bound = median_step_time(a, [&](int n) {
    for (int k = 0; k < n; ++k) sg.step();
  });

  std::printf("locus widths=%s batch=%d optimizer=%s threads=%d blas=%s\n", a.widths.c_str(),
              a.batch, a.optimizer.c_str(), a.threads, openblas_get_corename());
  std::printf("samples_per_s %.1f\n", a.batch / train.wall);
  std::printf("sgemm_bound_samples_per_s %.1f\n", a.batch / bound.wall);
  std::printf("cpu_samples_per_s %.1f\n", a.batch / train.cpu);
  std::printf("cpu_sgemm_bound_samples_per_s %.1f\n", a.batch / bound.cpu);
  std::printf("fraction_of_bound wall %.3f cpu %.3f\n", bound.wall / train.wall,
              bound.cpu / train.cpu);
  std::printf("update_in_backward samples_per_s %.1f cpu_samples_per_s %.1f\n",
              a.batch / in_backward.wall, a.batch / in_backward.cpu);
  std::printf("cpu_ms_per_step train %.3f fwd_bwd %.3f optimizer %.3f sgemm_only %.3f\n",
              train.cpu * 1e3, fwd_bwd.cpu * 1e3, optimizer.cpu * 1e3, bound.cpu * 1e3);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "locus_mlp_bench: error: %s\n", e.what());
    return 1;
  }
}
