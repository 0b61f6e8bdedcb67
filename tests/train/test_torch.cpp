// locus against PyTorch: the same initial weights (raw little-endian float32 in state_dict
// order) and batches, a few steps of SGD momentum / Nesterov / Adam / AdamW with schedules
// and clipping, on both sides; the final weights and every step's loss must agree to
// rounding. Skipped when /usr/bin/python3 cannot import torch.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "locus/train/model/backward.hpp"
#include "locus/train/optim/clip.hpp"
#include "locus/train/optim/optimizer.hpp"
#include "locus/train/optim/schedule.hpp"
#include "reference.hpp"

namespace locus::train {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string name;
  std::vector<int> widths;
  Activation activation;
  Loss loss;
  OptimizerOptions opt;
  ScheduleOptions sched;
  double max_norm;  // 0: no clipping
};

template <class T> void write_raw(const fs::path& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  ASSERT_TRUE(f.good()) << path;
}

template <class T> std::vector<T> read_raw(const fs::path& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  std::vector<T> v(static_cast<std::size_t>(f.tellg()) / sizeof(T));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
  return v;
}

std::string config_json(const Case& c, int batch, int steps) {
  std::ostringstream j;
  j.precision(17);
  j << "{\"widths\": [";
  for (std::size_t i = 0; i < c.widths.size(); ++i) j << (i ? ", " : "") << c.widths[i];
  j << "], \"activation\": \"" << to_string(c.activation) << "\", \"loss\": \""
    << to_string(c.loss) << "\", \"batch\": " << batch << ", \"steps\": " << steps
    << ", \"optimizer\": \"" << to_string(c.opt.kind) << "\", \"weight_decay\": "
    << c.opt.weight_decay << ", \"momentum\": " << c.opt.momentum << ", \"dampening\": "
    << c.opt.dampening << ", \"nesterov\": " << (c.opt.nesterov ? "true" : "false")
    << ", \"beta1\": " << c.opt.beta1 << ", \"beta2\": " << c.opt.beta2 << ", \"eps\": "
    << c.opt.eps << ", \"schedule\": \"" << to_string(c.sched.kind) << "\", \"base_lr\": "
    << c.sched.base_lr << ", \"warmup_steps\": " << c.sched.warmup_steps
    << ", \"step_size\": " << c.sched.step_size << ", \"gamma\": " << c.sched.gamma
    << ", \"total_steps\": " << c.sched.total_steps << ", \"min_lr\": " << c.sched.min_lr
    << ", \"max_norm\": " << c.max_norm << "}";
  return j.str();
}

class AgainstTorch : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() {
    have_torch_ = std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") == 0;
  }
  static inline bool have_torch_ = false;
};

TEST_P(AgainstTorch, SameWeightsAfterTraining) {
  if (!have_torch_) GTEST_SKIP() << "/usr/bin/python3 cannot import torch";
  const Case& c = GetParam();
  const int batch = 16;
  const int steps = 8;
  Mlp model(ModelSpec{c.widths, c.activation, Init::he, 0.0f, 3});
  const fs::path dir = fs::temp_directory_path() /
                       ("locus_train_torch_" + c.name + "_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  write_raw(dir / "params0.f32", std::vector<float>(model.params().begin(), model.params().end()));
  std::vector<float> x, targets;
  std::vector<std::int32_t> labels;
  for (int s = 0; s < steps; ++s) {
    const auto b = testing::make_batch(c.widths, batch, 100 + static_cast<std::uint64_t>(s));
    x.insert(x.end(), b.x.begin(), b.x.end());
    labels.insert(labels.end(), b.labels.begin(), b.labels.end());
    targets.insert(targets.end(), b.targets.begin(), b.targets.end());
  }
  write_raw(dir / "x.f32", x);
  write_raw(dir / "labels.i32", labels);
  write_raw(dir / "targets.f32", targets);
  std::ofstream(dir / "config.json") << config_json(c, batch, steps);

  const std::string cmd = std::string("/usr/bin/python3 ") + LOCUS_TRAIN_TEST_DIR +
                          "/torch_reference.py " + dir.string();
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;

  auto opt = make_optimizer(c.opt, model.layout().size());
  Workspace ws(model, batch);
  std::vector<float> grads(model.layout().size());
  std::vector<double> losses;
  int clipped = 0;
  const int in = c.widths.front();
  const int out = c.widths.back();
  for (int s = 0; s < steps; ++s) {
    const Batch b{std::span<const float>(x).subspan(static_cast<std::size_t>(s * batch * in),
                                                    static_cast<std::size_t>(batch * in)),
                  batch,
                  std::span<const std::int32_t>(labels).subspan(static_cast<std::size_t>(s * batch),
                                                                static_cast<std::size_t>(batch)),
                  std::span<const float>(targets).subspan(static_cast<std::size_t>(s * batch * out),
                                                          static_cast<std::size_t>(batch * out)),
                  {}};
    const LossStats st = forward_backward(model, ws, c.loss, b, static_cast<std::uint64_t>(s),
                                          batch, grads);
    losses.push_back(st.loss_sum / batch);
    const float scale = c.max_norm > 0 ? clip_factor(global_grad_norm(grads), c.max_norm) : 1.0f;
    clipped += scale < 1.0f ? 1 : 0;
    opt->step(model.params(), grads, learning_rate(c.sched, s), scale);
  }

  if (c.max_norm > 0) {
    EXPECT_GT(clipped, 0) << "clipping never engaged: lower max_norm";
  }
  const auto torch_losses = read_raw<double>(dir / "losses.f64");
  ASSERT_EQ(torch_losses.size(), losses.size());
  for (std::size_t s = 0; s < losses.size(); ++s) {
    EXPECT_NEAR(losses[s], torch_losses[s], 1e-5 * std::max(1.0, std::abs(torch_losses[s])))
        << "step " << s;
  }
  const auto final_params = read_raw<float>(dir / "params_final.f32");
  ASSERT_EQ(final_params.size(), model.layout().size());
  const auto p = model.params();
  double worst = 0.0;
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double diff = std::abs(static_cast<double>(p[i]) - final_params[i]);
    const double rel = diff / std::max(1e-2, std::abs(static_cast<double>(final_params[i])));
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-5) << "parameter " << i << ": locus " << p[i] << " torch "
                         << final_params[i];
  }
  RecordProperty("worst_relative_difference", std::to_string(worst));
  std::printf("[%s] worst relative difference %.3g\n", c.name.c_str(), worst);
  fs::remove_all(dir);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  {
    Case c{"relu_sgd_momentum_step_clip", {20, 16, 12, 5}, Activation::relu,
           Loss::softmax_cross_entropy, {}, {}, 1.0};
    c.opt.momentum = 0.9;
    c.opt.weight_decay = 1e-3;
    c.sched.kind = ScheduleKind::step;
    c.sched.base_lr = 0.1;
    c.sched.warmup_steps = 2;
    c.sched.step_size = 3;
    c.sched.gamma = 0.5;
    out.push_back(c);
  }
  {
    Case c{"gelu_sgd_nesterov_cosine", {20, 24, 5}, Activation::gelu,
           Loss::softmax_cross_entropy, {}, {}, 0.0};
    c.opt.momentum = 0.8;
    c.opt.nesterov = true;
    c.sched.kind = ScheduleKind::cosine;
    c.sched.base_lr = 0.2;
    c.sched.total_steps = 8;
    c.sched.min_lr = 0.01;
    out.push_back(c);
  }
  {
    Case c{"tanh_adamw_mse_cosine_warmup_clip", {20, 16, 12, 5}, Activation::tanh, Loss::mse,
           {}, {}, 0.3};
    c.opt.kind = OptimizerKind::adamw;
    c.opt.weight_decay = 0.05;
    c.sched.kind = ScheduleKind::cosine;
    c.sched.base_lr = 0.01;
    c.sched.warmup_steps = 3;
    c.sched.total_steps = 8;
    out.push_back(c);
  }
  {
    Case c{"relu_adam_l2_constant", {20, 16, 5}, Activation::relu, Loss::softmax_cross_entropy,
           {}, {}, 0.0};
    c.opt.kind = OptimizerKind::adam;
    c.opt.weight_decay = 1e-2;
    c.opt.beta1 = 0.85;
    c.sched.base_lr = 3e-3;
    out.push_back(c);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Cases, AgainstTorch, ::testing::ValuesIn(cases()),
                         [](const auto& p) { return p.param.name; });

}  // namespace
}  // namespace locus::train
