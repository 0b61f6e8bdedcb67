// Pipeline stages and micro-batches on the cuda backend (the stage computes on the CUDA layer
// operations, activations and their gradients go through the host-staged stage link), against
// the same pipeline on the cpu backend: at 2 ranks a 2-stage pipeline (1F1B and GPipe, SGD with
// dropout and clipping, AdamW + gelu + mse), at any rank count micro-batches on one stage;
// weights, optimizer state, losses and gradient norms within 1e-3 relative of the CPU; bf16 in
// its band; bitwise the same run twice and with train.graphs on or off (stages launch eagerly);
// a state restored mid-run continues bitwise; buffers that grow mid-step are freed only after
// it; the device cache with stages is refused. Without a device every case skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "agreed_error.hpp"
#include "layer_ops.hpp"
#include "locus/train/compute.hpp"
#include "test_trainer_util.hpp"

namespace locus::train::test {
namespace {

std::optional<std::string> no_device() {
  ComputeOptions c;
  c.backend = "cuda";
  try {
    validate(c);
    return std::nullopt;
  } catch (const ConfigError& e) {
    return std::string(e.what());
  }
}

class CudaPipeline : public WorldDataSuite {
 protected:
  void SetUp() override {
    if (auto why = no_device()) GTEST_SKIP() << "no CUDA device: " << *why;
  }
};

int world_size() { return mpi::Comm::world().size(); }

// 4 layers, 2 epochs of 15 steps (30 steps), evaluation at each epoch's end.
TrainOptions options(const Data& d, const std::string& backend, int stages, int micro,
                     PipelineSchedule schedule) {
  TrainOptions o = small_options(d);
  o.model.widths = {kFeatures, 24, 16, 12, kClasses};
  o.model.dropout = 0.2f;
  o.clip_max_norm = 0.5;
  o.compute.backend = backend;
  o.pipeline_stages = stages;
  o.micro_batches = micro;
  o.pipeline_schedule = schedule;
  o.log_every = 1;
  // A stuck transfer ends as an NcclError naming it, well within the GPU run's limit for this
  // test (bench/gpu/run_gpu.sh: 150 s), which would end it silently.
  o.stage_link.timeout_s = 40;
  o.reducer.timeout_s = 40;
  return o;
}

TrainOptions adamw_mse(TrainOptions o) {
  o.model.activation = Activation::gelu;
  o.loss = Loss::mse;
  o.optimizer = {};
  o.optimizer.kind = OptimizerKind::adamw;
  o.optimizer.weight_decay = 0.01;
  o.schedule.base_lr = 0.01;
  return o;
}

struct StageRun {
  std::vector<float> params;                    // this rank's stage
  std::vector<std::vector<float>> optimizer;    // this rank's stage
  std::vector<StepMetrics> steps;
  std::vector<EpochMetrics> epochs;
};

StageRun finish(Trainer& t, Recorder& rec) {
  StageRun r;
  const TrainState& s = t.synced_state();
  r.params.assign(s.model.params().begin(), s.model.params().end());
  for (const auto& b : std::as_const(*s.optimizer).state()) {
    r.optimizer.emplace_back(b.data.begin(), b.data.end());
  }
  r.steps = rec.steps;
  r.epochs = rec.epochs;
  return r;
}

StageRun train(const TrainOptions& o) {
  const Grid grid(mpi::Comm::world(), o.pipeline_stages);
  Trainer t(grid, o);
  Recorder rec;
  t.train(&rec);
  return finish(t, rec);
}

double relative(std::span<const float> a, std::span<const float> b) {
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    ref += static_cast<double>(b[i]) * b[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

// Where the trainer's stage link is not NCCL (`link`: its description): a skip, or a failure
// under LOCUS_REQUIRE_NCCL=1 (bench/gpu/hostid_rank.sh, where NCCL must run).
void skip_without_nccl(const std::string& link) {
  const char* require = std::getenv("LOCUS_REQUIRE_NCCL");
  if (require != nullptr && std::string(require) == "1")
    FAIL() << "LOCUS_REQUIRE_NCCL=1, but the NCCL link did not run: " << link;
  GTEST_SKIP() << "the NCCL link did not run here: " << link;
}

// The cuda pipeline against the cpu pipeline of the same options, on the same grid.
void expect_matches_cpu(const TrainOptions& cuda_options, double tol = 1e-3) {
  TrainOptions cpu_options = cuda_options;
  cpu_options.compute.backend = "cpu";
  const StageRun cpu = train(cpu_options);
  const StageRun gpu = train(cuda_options);
  ASSERT_EQ(gpu.params.size(), cpu.params.size());
  EXPECT_LE(relative(gpu.params, cpu.params), tol);
  ASSERT_EQ(gpu.optimizer.size(), cpu.optimizer.size());
  for (std::size_t i = 0; i < cpu.optimizer.size(); ++i) {
    EXPECT_LE(relative(gpu.optimizer[i], cpu.optimizer[i]), tol) << "optimizer state " << i;
  }
  ASSERT_EQ(gpu.steps.size(), 30u);
  ASSERT_EQ(gpu.steps.size(), cpu.steps.size());
  for (std::size_t i = 0; i < cpu.steps.size(); ++i) {
    EXPECT_EQ(gpu.steps[i].samples, cpu.steps[i].samples);
    EXPECT_NEAR(gpu.steps[i].loss, cpu.steps[i].loss, tol * std::abs(cpu.steps[i].loss) + 1e-6)
        << "step " << i;
    EXPECT_NEAR(gpu.steps[i].grad_norm, cpu.steps[i].grad_norm,
                tol * std::abs(cpu.steps[i].grad_norm) + 1e-7)
        << "step " << i;
  }
  ASSERT_EQ(gpu.epochs.size(), cpu.epochs.size());
  for (std::size_t e = 0; e < cpu.epochs.size(); ++e) {
    ASSERT_TRUE(gpu.epochs[e].evaluated);
    EXPECT_EQ(gpu.epochs[e].eval.rows, cpu.epochs[e].eval.rows);
    EXPECT_NEAR(gpu.epochs[e].eval.loss, cpu.epochs[e].eval.loss, tol * cpu.epochs[e].eval.loss);
  }
}

TEST_F(CudaPipeline, TwoStagesMatchTheCpuPipeline) {
  if (world_size() != 2) GTEST_SKIP() << "a 2-stage pipeline runs at 2 ranks";
  for (const auto sched : {PipelineSchedule::one_f_one_b, PipelineSchedule::gpipe}) {
    SCOPED_TRACE(std::string(to_string(sched)));
    expect_matches_cpu(options(data(), "cuda", 2, 3, sched));
  }
}

TEST_F(CudaPipeline, AdamWGeluMseTwoStagesMatchTheCpuPipeline) {
  if (world_size() != 2) GTEST_SKIP() << "a 2-stage pipeline runs at 2 ranks";
  expect_matches_cpu(adamw_mse(options(data(), "cuda", 2, 4, PipelineSchedule::one_f_one_b)));
}

// micro_batches > 1 on one stage: gradient accumulation on the device over the data-parallel
// ranks (the host-staged reducer at 2 ranks on one GPU).
TEST_F(CudaPipeline, MicroBatchesOnOneStageMatchTheCpu) {
  expect_matches_cpu(options(data(), "cuda", 1, 3, PipelineSchedule::one_f_one_b));
}

// Stages launch their kernels eagerly whatever train.graphs says: the same bits either way,
// and the same bits run after run (fixed reduction orders, one cuBLASLt algorithm per shape).
TEST_F(CudaPipeline, RunTwiceAndGraphsOnOrOffAreBitwiseEqual) {
  const int stages = world_size() == 2 ? 2 : 1;
  for (const Precision p : {Precision::fp32, Precision::bf16}) {
    SCOPED_TRACE(std::string(to_string(p)));
    TrainOptions o = options(data(), "cuda", stages, 3, PipelineSchedule::one_f_one_b);
    o.compute.precision = p;
    const StageRun a = train(o);
    const StageRun b = train(o);
    o.compute.graphs = false;
    const StageRun eager = train(o);
    EXPECT_EQ(a.params, b.params);
    EXPECT_EQ(a.optimizer, b.optimizer);
    EXPECT_EQ(a.params, eager.params);
    EXPECT_EQ(a.optimizer, eager.optimizer);
    ASSERT_EQ(a.steps.size(), b.steps.size());
    ASSERT_EQ(a.steps.size(), eager.steps.size());
    for (std::size_t i = 0; i < a.steps.size(); ++i) {
      EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i;
      EXPECT_EQ(a.steps[i].loss, eager.steps[i].loss) << "step " << i;
    }
  }
}

// train.stage_link: NCCL send/recv moves the same bytes as the host-staged MPI link, so a run
// of as many stages as ranks (2 in ctest; 4 in run_gpu.sh's host-id phase, where the middle
// stages receive and send on each channel) through either is bitwise the same (1F1B and GPipe,
// one micro-batch more than stages, evaluation included). Where the ranks cannot form an NCCL
// communicator (one GPU without run_gpu.sh's test-only host ids), auto takes the staged link
// and says why, and nccl is an agreed ConfigError.
TEST_F(CudaPipeline, NcclLinkTrainsBitwiseAsTheHostStagedLink) {
  const int stages = world_size();
  if (stages < 2 || stages > 4) GTEST_SKIP() << "a pipeline of 2 to 4 stages, one a rank";
  std::string refused;
  for (const auto sched : {PipelineSchedule::one_f_one_b, PipelineSchedule::gpipe}) {
    TrainOptions o = options(data(), "cuda", stages, stages + 1, sched);
    o.stage_link.backend = comm::LinkBackend::mpi;
    const StageRun staged = train(o);
    o.stage_link.backend = comm::LinkBackend::automatic;
    const Grid grid(mpi::Comm::world(), stages);
    Trainer t(grid, o);
    const std::string link = t.link_description();
    if (link.rfind("nccl", 0) != 0) {
      EXPECT_EQ(link.rfind("mpi-host-staged (train.stage_link = auto: not NCCL, as pipeline "
                           "ranks 0 and 1 share GPU ",
                           0),
                0u)
          << link;
      o.stage_link.backend = comm::LinkBackend::nccl;
      try {
        Trainer refusing(grid, o);
        ADD_FAILURE() << "train.stage_link = nccl was accepted where auto said: " << link;
      } catch (const ConfigError& e) {
        EXPECT_NE(std::string(e.what()).find("train.stage_link = nccl cannot be used: pipeline "
                                             "ranks 0 and 1 share GPU"),
                  std::string::npos)
            << e.what();
      }
      refused = link;
      continue;
    }
    Recorder rec;
    t.train(&rec);
    const StageRun nccl = finish(t, rec);
    EXPECT_EQ(nccl.params, staged.params) << to_string(sched);
    EXPECT_EQ(nccl.optimizer, staged.optimizer) << to_string(sched);
    ASSERT_EQ(nccl.steps.size(), staged.steps.size());
    for (std::size_t i = 0; i < staged.steps.size(); ++i) {
      EXPECT_EQ(nccl.steps[i].loss, staged.steps[i].loss) << to_string(sched) << " step " << i;
      EXPECT_EQ(nccl.steps[i].grad_norm, staged.steps[i].grad_norm) << "step " << i;
    }
    ASSERT_EQ(nccl.epochs.size(), staged.epochs.size());
    for (std::size_t e = 0; e < staged.epochs.size(); ++e) {
      EXPECT_EQ(nccl.epochs[e].eval.loss, staged.epochs[e].eval.loss) << "epoch " << e;
    }
  }
  if (!refused.empty()) skip_without_nccl(refused);
}

// Two stages, each on two data-parallel ranks (4 ranks): the NCCL link and the NCCL reducer in
// one process at once -- the link's communicators (one a direction) over each pipeline's ranks,
// the reducer's over each stage's replicas -- train bitwise as the host-staged link and reducer
// (the reduction sums two ranks' gradients: the same bits either way). Per step the last stage's
// loss waits for the previous step's all-reduce as well as for the activations received.
TEST_F(CudaPipeline, NcclLinkBesideTheNcclReducerTrainsBitwiseAsTheHostStagedOnes) {
  if (world_size() != 4) GTEST_SKIP() << "2 stages x 2 data-parallel ranks run at 4 ranks";
  TrainOptions o = options(data(), "cuda", 2, 3, PipelineSchedule::one_f_one_b);
  o.stage_link.backend = comm::LinkBackend::mpi;
  o.reducer.backend = comm::ReducerBackend::mpi;
  const StageRun staged = train(o);
  o.stage_link.backend = comm::LinkBackend::automatic;
  o.reducer.backend = comm::ReducerBackend::automatic;
  const Grid grid(mpi::Comm::world(), 2);
  Trainer t(grid, o);
  const std::string link = t.link_description(), reducer = t.reducer_description();
  if (link.rfind("nccl", 0) != 0 || reducer.rfind("nccl", 0) != 0) {
    skip_without_nccl("link " + link + "; reducer " + reducer);
    return;
  }
  Recorder rec;
  t.train(&rec);
  const StageRun nccl = finish(t, rec);
  EXPECT_EQ(nccl.params, staged.params);
  EXPECT_EQ(nccl.optimizer, staged.optimizer);
  ASSERT_EQ(nccl.steps.size(), 30u);
  ASSERT_EQ(nccl.steps.size(), staged.steps.size());
  for (std::size_t i = 0; i < staged.steps.size(); ++i) {
    EXPECT_EQ(nccl.steps[i].loss, staged.steps[i].loss) << "step " << i;
    EXPECT_EQ(nccl.steps[i].grad_norm, staged.steps[i].grad_norm) << "step " << i;
  }
  ASSERT_EQ(nccl.epochs.size(), staged.epochs.size());
  for (std::size_t e = 0; e < staged.epochs.size(); ++e) {
    EXPECT_EQ(nccl.epochs[e].eval.loss, staged.epochs[e].eval.loss) << "epoch " << e;
  }
}

// A step's labels (and mse targets) go from stage 0 to the last stage by MPI beside the NCCL
// link. At 20000 rows they are past MPI's eager limit (64 KiB over TCP; 4 KiB between processes
// without single-copy), where a send left pending moves only while its rank calls MPI: stage 0,
// waiting over the NCCL link for the gradients that follow the last stage's loss, did not, and
// the step waited for the link's timeout. Bitwise the host-staged link's training, cross
// entropy and mse; run_gpu.sh runs it once more with MPI over TCP (bench/gpu/hostid_rank.sh).
TEST_F(CudaPipeline, NcclLinkCarriesLabelsAndTargetsPastMpisEagerLimit) {
  if (world_size() != 2) GTEST_SKIP() << "a 2-stage pipeline runs at 2 ranks";
  const std::string wide = data().dir.file("wide.h5");
  make_dataset(mpi::Comm::world(), wide, 20000, 31);
  for (const Loss loss : {Loss::softmax_cross_entropy, Loss::mse}) {
    SCOPED_TRACE(std::string(to_string(loss)));
    TrainOptions o = options(data(), "cuda", 2, 2, PipelineSchedule::one_f_one_b);
    if (loss == Loss::mse) o = adamw_mse(o);
    o.data.path = wide;
    o.data.global_batch = 20000;  // labels 80 KB, targets 320 KB a step
    o.epochs = 3;  // one step an epoch
    o.max_steps = 3;
    o.schedule.warmup_steps = 1;
    o.stage_link.backend = comm::LinkBackend::mpi;
    const StageRun staged = train(o);
    o.stage_link.backend = comm::LinkBackend::automatic;
    const Grid grid(mpi::Comm::world(), 2);
    Trainer t(grid, o);
    if (const std::string link = t.link_description(); link.rfind("nccl", 0) != 0) {
      skip_without_nccl(link);
      return;
    }
    Recorder rec;
    t.train(&rec);
    const StageRun nccl = finish(t, rec);
    EXPECT_EQ(nccl.params, staged.params);
    ASSERT_EQ(nccl.steps.size(), 3u);
    ASSERT_EQ(staged.steps.size(), 3u);
    for (std::size_t i = 0; i < staged.steps.size(); ++i) {
      EXPECT_EQ(nccl.steps[i].loss, staged.steps[i].loss) << "step " << i;
    }
  }
}

// bf16 operands in the stages: each step's loss within the band of the whole-model GPU test
// (5% + 0.02 of the fp32 CPU pipeline's).
TEST_F(CudaPipeline, Bf16LossStaysInItsBand) {
  const int stages = world_size() == 2 ? 2 : 1;
  TrainOptions o = options(data(), "cuda", stages, 3, PipelineSchedule::one_f_one_b);
  o.compute.precision = Precision::bf16;
  TrainOptions c = o;
  c.compute.backend = "cpu";
  c.compute.precision = Precision::fp32;
  const StageRun cpu = train(c);
  const StageRun gpu = train(o);
  ASSERT_EQ(gpu.steps.size(), cpu.steps.size());
  for (std::size_t i = 0; i < cpu.steps.size(); ++i) {
    EXPECT_NEAR(gpu.steps[i].loss, cpu.steps[i].loss, 0.05 * cpu.steps[i].loss + 0.02)
        << "step " << i;
  }
  EXPECT_LE(relative(gpu.params, cpu.params), 3e-2);
}

// The host state restored into a new trainer mid-epoch (what a checkpoint resume does) reaches
// the stage's device buffers: bitwise equal to an uninterrupted GPU run.
TEST_F(CudaPipeline, RestoredStateContinuesBitwise) {
  const int stages = world_size() == 2 ? 2 : 1;
  const TrainOptions o = options(data(), "cuda", stages, 3, PipelineSchedule::one_f_one_b);
  const Grid grid(mpi::Comm::world(), stages);
  Trainer a(grid, o);
  a.train(nullptr, 23);  // mid-epoch (15 steps per epoch)
  Trainer b(grid, o);
  b.state().assign(a.synced_state());
  Recorder rec;
  b.train(&rec);
  const StageRun resumed = finish(b, rec);
  const StageRun straight = train(o);
  EXPECT_EQ(resumed.params, straight.params);
  EXPECT_EQ(resumed.optimizer, straight.optimizer);
}

// A stage's buffers that grow mid-step -- a slot reused by a larger micro-batch, the pass's
// scratch, the loss's labels, a send buffer -- keep their old memory until the step's
// transfers are done: no host wait as they grow (a cudaFree then would wait for the whole
// device, transfers to and from peers included, which may wait for this stage), one settle
// and the frees at free_replaced(), nothing at a second call; the grown buffers compute
// bitwise what fresh ones do. (gemm_select = heuristic: no GEMM is timed, which settles too.)
TEST_F(CudaPipeline, BuffersThatGrowMidStepAreFreedOnlyAfterTheStep) {
  ModelSpec spec;
  spec.widths = {kFeatures, 24, 16, kClasses};
  spec.seed = 7;
  OptimizerOptions optimizer;
  ComputeOptions c;
  c.backend = "cuda";
  c.measure_gemms = false;
  const mpi::Comm& world = mpi::Comm::world();
  TrainState grown_state(spec, optimizer), fresh_state(spec, optimizer);
  auto grown = detail::make_layer_ops(c, world, grown_state);
  auto fresh = detail::make_layer_ops(c, world, fresh_state);
  int settles = 0;
  grown->before_host_waits([&](void*) { ++settles; });
  constexpr int kRows = 9;
  std::vector<float> x(std::size_t{kRows} * kFeatures);
  for (std::size_t i = 0; i < x.size(); ++i) {
    x[i] = static_cast<float>((i * 37) % 23) / 11.0f - 1.0f;
  }
  std::vector<std::int32_t> y(kRows);
  for (int i = 0; i < kRows; ++i) y[static_cast<std::size_t>(i)] = (i * 3) % kClasses;
  const auto logits = [](detail::LayerActivations& a) {
    const comm::GradientBuffer out = a.output();
    std::vector<float> host(out.size);
    EXPECT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(out.stream)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), out.data, out.size * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  };
  const Loss loss = Loss::softmax_cross_entropy;
  auto a = grown->make_activations();
  auto send = grown->make_buffer();
  grown->prepare(*a, kRows - 1, false, false, false);
  const std::size_t first_floats = std::size_t{kRows - 1} * kFeatures;
  grown->forward(*a, std::span<const float>(x).first(first_floats), false, {});
  grown->loss(*a, loss, std::span<const std::int32_t>(y).first(kRows - 1), {}, 1.0, false);
  send->view(16);
  grown->prepare(*a, kRows, false, false, false);  // grows: the 8-row buffers are kept
  grown->forward(*a, x, false, {});
  const LossStats grown_loss = grown->loss(*a, loss, y, {}, 1.0, false);  // labels grow too
  send->view(std::size_t{kRows} * kFeatures);
  EXPECT_EQ(settles, 0) << "a buffer that grew waited on the host mid-step";
  const std::vector<float> grown_logits = logits(*a);
  grown->free_replaced();
  EXPECT_EQ(settles, 1) << "the kept buffers are freed after a settle (the peers watched)";
  grown->free_replaced();
  EXPECT_EQ(settles, 1) << "nothing was kept since: nothing to settle for";

  auto b = fresh->make_activations();
  fresh->prepare(*b, kRows, false, false, false);
  fresh->forward(*b, x, false, {});
  const LossStats fresh_loss = fresh->loss(*b, loss, y, {}, 1.0, false);
  EXPECT_EQ(grown_logits, logits(*b));
  EXPECT_EQ(grown_loss.loss_sum, fresh_loss.loss_sum);
  EXPECT_EQ(grown_loss.correct, fresh_loss.correct);
  EXPECT_EQ(grown_loss.rows, kRows);
}

// The device cache feeds whole-model steps only: with stages or micro-batches it is an agreed
// ConfigError naming both keys and the ways out, not silently ignored.
TEST_F(CudaPipeline, DeviceCacheWithMicroBatchesIsAnAgreedConfigError) {
  TrainOptions o = options(data(), "cuda", 1, 2, PipelineSchedule::one_f_one_b);
  o.device_cache_bytes = std::uint64_t{64} << 20;
  const Grid grid(mpi::Comm::world(), 1);
  const std::string message =
      locus::test::agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(message.find("loader.device_cache_mb = 64"), std::string::npos) << message;
  EXPECT_NE(message.find("train.micro_batches = 2"), std::string::npos) << message;
  EXPECT_NE(message.find("set loader.device_cache_mb = 0"), std::string::npos) << message;
  o.device_cache_bytes = 0;
  o.device_gather = true;
  const std::string gather =
      locus::test::agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(gather.find("loader.gather = device with train.pipeline_stages = 1 and "
                        "train.micro_batches = 2"),
            std::string::npos)
      << gather;
}

}  // namespace
}  // namespace locus::train::test
