// Data-parallel training on 1, 2 and 4 ranks against serial training of the same global
// batches on every rank: local rows with grad_divisor = global batch, each layer's gradient
// slice all-reduced from on_grads_ready, clipping by the global norm, dropout keyed
// by global sample ids; the clipping norm also from per-rank shards through the cross-rank
// sum. Ranks must agree bit for bit and match the serial run to rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/train/model/backward.hpp"
#include "locus/train/optim/clip.hpp"
#include "locus/train/optim/optimizer.hpp"
#include "locus/train/optim/schedule.hpp"

namespace locus::train {
namespace {

constexpr int kSamples = 72;
constexpr int kGlobalBatch = 18;  // 4 ranks get 4, 5, 4, 5 rows: uneven on purpose
const std::vector<int> kWidths{10, 24, 16, 4};

// A sample is a pure function of its id (as a dataset row would be).
void sample(std::uint64_t id, float* x, std::int32_t* label) {
  for (int k = 0; k < kWidths.front(); ++k) {
    x[k] = static_cast<float>(std::sin(0.37 * static_cast<double>(id) + 1.3 * k));
  }
  *label = static_cast<std::int32_t>((id * 7) % static_cast<std::uint64_t>(kWidths.back()));
}

// The global batch of a step: a shuffled window over the sample ids (same on every rank).
std::vector<std::uint64_t> global_ids(std::int64_t step) {
  std::vector<std::uint64_t> perm(kSamples);
  std::iota(perm.begin(), perm.end(), 0);
  std::uint64_t s = 12345 + static_cast<std::uint64_t>(step / (kSamples / kGlobalBatch));
  for (int i = kSamples - 1; i > 0; --i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(perm[static_cast<std::size_t>(i)], perm[(s >> 33) % static_cast<std::uint64_t>(i + 1)]);
  }
  const auto first = static_cast<std::size_t>(step % (kSamples / kGlobalBatch)) * kGlobalBatch;
  return {perm.begin() + static_cast<std::ptrdiff_t>(first),
          perm.begin() + static_cast<std::ptrdiff_t>(first + kGlobalBatch)};
}

struct Trainer {
  Mlp model;
  std::unique_ptr<Optimizer> opt;
  Workspace ws;
  std::vector<float> grads;
  std::vector<float> x;
  std::vector<std::int32_t> labels;

  Trainer(Activation act, const OptimizerOptions& o)
      : model(ModelSpec{kWidths, act, Init::he, 0.2f, 5}),
        opt(make_optimizer(o, model.layout().size())),
        ws(model, kGlobalBatch),
        grads(model.layout().size()) {}

  // One step on rows [begin, end) of the global batch; comm == nullptr means serial.
  void step(std::int64_t s, int begin, int end, const mpi::Comm* comm) {
    const std::vector<std::uint64_t> all = global_ids(s);
    const std::vector<std::uint64_t> ids(all.begin() + begin, all.begin() + end);
    const int rows = end - begin;
    x.assign(static_cast<std::size_t>(rows) * kWidths.front(), 0.0f);
    labels.assign(static_cast<std::size_t>(rows), 0);
    for (int r = 0; r < rows; ++r) {
      sample(ids[static_cast<std::size_t>(r)], x.data() + r * kWidths.front(),
             labels.data() + r);
    }
    const ParamLayout& layout = model.layout();
    const GradsReadyFn reduce = [&](int l) {
      if (comm == nullptr) return;
      const LayerLayout& ly = layout.layer(l);
      comm->allreduce_inplace(std::span<float>(grads).subspan(ly.begin(), ly.end() - ly.begin()),
                              MPI_SUM);
    };
    forward_backward(model, ws, Loss::softmax_cross_entropy, {x, rows, labels, {}, ids},
                     static_cast<std::uint64_t>(s), kGlobalBatch, grads, reduce);
    // After the all-reduce every rank holds the whole gradient, so its local norm is the
    // global one. The cross-rank sum is for sharded gradients: each rank's sum of squares over
    // its own shard adds up to the same norm.
    const double norm = global_grad_norm(grads);
    if (comm != nullptr) {
      const std::size_t n = grads.size();
      const auto r = static_cast<std::size_t>(comm->rank());
      const auto size = static_cast<std::size_t>(comm->size());
      const auto shard = std::span<const float>(grads).subspan(r * n / size,
                                                               (r + 1) * n / size - r * n / size);
      EXPECT_NEAR(global_grad_norm(shard, sum_across(*comm)), norm, 1e-9 * norm);
    }
    ScheduleOptions sched;
    sched.kind = ScheduleKind::step;
    sched.base_lr = opt->options().kind == OptimizerKind::sgd ? 0.1 : 0.01;
    sched.warmup_steps = 2;
    sched.step_size = 3;
    sched.gamma = 0.7;
    opt->step(model.params(), grads, learning_rate(sched, s), clip_factor(norm, 0.8));
  }
};

void check_against_serial(Activation act, const OptimizerOptions& o) {
  const mpi::Comm world = mpi::Comm::world();
  const int n = world.size();
  const int r = world.rank();
  Trainer dp(act, o), serial(act, o);
  for (std::int64_t s = 0; s < 10; ++s) {
    dp.step(s, r * kGlobalBatch / n, (r + 1) * kGlobalBatch / n, &world);
    serial.step(s, 0, kGlobalBatch, nullptr);
  }
  const auto p = dp.model.params();
  std::vector<float> lo(p.begin(), p.end()), hi(p.begin(), p.end());
  world.allreduce_inplace(std::span<float>(lo), MPI_MIN);
  world.allreduce_inplace(std::span<float>(hi), MPI_MAX);
  EXPECT_EQ(lo, hi) << "ranks disagree on the parameters";
  const auto q = serial.model.params();
  double max_change = 0.0;
  Mlp init(dp.model.spec());
  for (std::size_t i = 0; i < p.size(); ++i) {
    max_change = std::max(max_change, std::abs(static_cast<double>(p[i]) - init.params()[i]));
    ASSERT_NEAR(p[i], q[i], 1e-5 + 1e-4 * std::abs(q[i])) << "parameter " << i;
  }
  EXPECT_GT(max_change, 1e-3);  // training really moved the parameters
}

TEST(DataParallel, SgdNesterovMatchesSerial) {
  OptimizerOptions o;
  o.momentum = 0.9;
  o.nesterov = true;
  o.weight_decay = 1e-4;
  check_against_serial(Activation::relu, o);
}

TEST(DataParallel, AdamWMatchesSerial) {
  OptimizerOptions o;
  o.kind = OptimizerKind::adamw;
  o.weight_decay = 0.01;
  check_against_serial(Activation::gelu, o);
}

}  // namespace
}  // namespace locus::train
