// The trainer with pipeline stages keeps only its stage's layers (parameters, gradients,
// optimizer state, background-save snapshots: the stage's share, the stages' shares adding up
// to one model), and its checkpoints are written and read by the stages: a checkpoint of
// pp = 2 (2 ranks) or pp = 2 x dp = 2 (4 ranks) holds the tensors of the same run on one rank
// (bitwise where the runs are bitwise equal, else within the data-parallel tolerance), resumes
// on other grids (1 rank -> pp = 2, pp = 2 x dp = 2 -> pp = 2 x dp = 1, pp = 2 -> 1 rank), and
// damage in a tensor only the last stage reads makes every rank fall back to the previous
// checkpoint.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <string>
#include <vector>

#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "shared_tmpdir.hpp"
#include "test_checkpoint_util.hpp"

namespace locus::train::test {
namespace {

class PipelineState : public CheckpointSuite {
 protected:

  // 4 layers, one epoch of 15 steps of 42 rows.
  static TrainOptions options(int stages, OptimizerKind kind, int micro) {
    TrainOptions o = small_options(data());
    o.model.widths = {kFeatures, 24, 16, 12, kClasses};
    o.epochs = 1;
    o.pipeline_stages = stages;
    o.micro_batches = micro;
    o.log_every = 1;
    o.eval_path.clear();
    if (kind == OptimizerKind::adamw) {
      o.model.activation = Activation::gelu;
      o.optimizer = {};
      o.optimizer.kind = OptimizerKind::adamw;
      o.optimizer.weight_decay = 0.01;
      o.schedule.base_lr = 0.01;
    } else {
      o.model.dropout = 0.2f;
    }
    return o;
  }
};

mpi::Comm self() { return mpi::Comm::borrow(MPI_COMM_SELF); }

// The same run on one stage (every rank data-parallel, one micro-batch).
TrainOptions single(TrainOptions o) {
  o.pipeline_stages = 1;
  o.micro_batches = 1;
  return o;
}

std::uint64_t state_bytes(const TrainState& s) {
  std::uint64_t bytes = s.model.params().size_bytes();
  for (const auto& b : std::as_const(*s.optimizer).state()) bytes += b.data.size_bytes();
  return bytes;
}

TEST_F(PipelineState, EachRankHoldsItsStagesShare) {
  std::vector<int> counts{2};
  if (world().size() >= 4) counts.push_back(4);
  const ParamLayout layout(options(1, OptimizerKind::adamw, 1).model.widths);
  const std::uint64_t model_bytes = layout.size() * sizeof(float) * 3;  // params, m, v
  for (const int stages : counts) {
    const Grid grid(world(), stages);
    Trainer t(grid, options(stages, OptimizerKind::adamw, 2));
    SCOPED_TRACE(grid.describe());
    const StageRange& r = t.partition()->stage(grid.stage());
    const TrainState& s = t.state();
    EXPECT_EQ(s.model.held(), r.held());
    EXPECT_EQ(s.model.offset(), r.begin);
    EXPECT_EQ(state_bytes(s), r.param_bytes() * 3) << "stage " << grid.stage();
    EXPECT_LT(state_bytes(s), model_bytes);
    // The stages' shares are one model; the replicas of a stage hold the same share.
    EXPECT_EQ(grid.pp().allreduce(state_bytes(s), MPI_SUM), model_bytes);
    // A background save's snapshot copies the share only.
    const Snapshot snap(s, CheckpointMeta{});
    EXPECT_EQ(snap.bytes(), state_bytes(s));
    t.train(nullptr, 2);  // the state stays the stage's after steps
    EXPECT_EQ(t.state().model.params().size(), r.size());
  }
  const Grid grid(world(), 1);
  const Trainer whole(grid, options(1, OptimizerKind::adamw, 1));
  EXPECT_TRUE(whole.state().model.whole());
  EXPECT_EQ(state_bytes(whole.state()), model_bytes);
}

// Collective over comm (a no-op on ranks outside it): trains o to `stop` with checkpoints in
// dir and saves there. Returns the run's whole state (gathered from the stages).
Outcome save_at(const mpi::Comm& comm, const TrainOptions& o, std::int64_t stop,
                const std::string& dir) {
  Outcome out;
  if (comm.get() == MPI_COMM_NULL) return out;
  const Grid grid(comm, o.pipeline_stages);
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir), "");
  c.resume("none");
  t.train(nullptr, stop, &c);
  c.save_now("test");
  add_state(out, t);
  return out;
}

// On rank 0: every tensor of two checkpoint files bitwise equal (and their stored CRC-32s), or
// within the data-parallel tolerance.
void compare_files(const std::string& a, const std::string& b, bool bitwise,
                   const std::string& what) {
  if (!world().is_root()) return;
  SCOPED_TRACE(what);
  const VerifyReport ra = verify_checkpoint(self(), a), rb = verify_checkpoint(self(), b);
  ASSERT_TRUE(ra.ok) << ra.problem;
  ASSERT_TRUE(rb.ok) << rb.problem;
  const TrainState sa = load_checkpoint_state(self(), a), sb = load_checkpoint_state(self(), b);
  Outcome oa, ob;
  add_state(oa, sa);
  add_state(ob, sb);
  ASSERT_EQ(ra.tensors.size(), rb.tensors.size());
  ASSERT_EQ(oa.optimizer.size(), ob.optimizer.size());
  if (bitwise) {
    for (std::size_t i = 0; i < ra.tensors.size(); ++i) {
      EXPECT_EQ(ra.tensors[i].stored_crc, rb.tensors[i].stored_crc) << ra.tensors[i].name;
    }
    EXPECT_EQ(0, std::memcmp(oa.params.data(), ob.params.data(), oa.params.size() * 4));
    for (std::size_t i = 0; i < oa.optimizer.size(); ++i) {
      EXPECT_EQ(oa.optimizer[i], ob.optimizer[i]) << "optimizer state " << i;
    }
  } else {
    expect_close(oa.params, ob.params, what + ": parameters");
    for (std::size_t i = 0; i < oa.optimizer.size(); ++i) {
      expect_close(oa.optimizer[i], ob.optimizer[i], what + ": optimizer state");
    }
  }
  EXPECT_EQ(sa.step, sb.step);
}

// On rank 0: writes `o`'s whole state alone as a checkpoint with the metadata of `like`.
void write_alone(const TrainOptions& opts, const Outcome& o, const std::string& like,
                 const std::string& path) {
  TrainState whole(opts.model, opts.optimizer);
  std::ranges::copy(o.params, whole.model.params().begin());
  auto bufs = whole.optimizer->state();
  ASSERT_EQ(bufs.size(), o.optimizer.size());
  for (std::size_t i = 0; i < bufs.size(); ++i) {
    std::ranges::copy(o.optimizer[i], bufs[i].data.begin());
  }
  CheckpointData d;
  d.model = &whole.model;
  for (const auto& b : std::as_const(*whole.optimizer).state()) d.optimizer_state.push_back(b);
  d.meta = read_checkpoint_meta(self(), like);
  write_checkpoint_file(self(), path, d);
}

// pp = 2 x dp = world/2 saves what one rank would write from its (gathered) state, bitwise,
// and the tensors of the same run on other grids: bitwise with one micro-batch and no clipping
// where the data-parallel size is the same (the stages run the 1-rank kernels on the same
// rows; a 2-replica sum is commutative), else within the tolerance of test_trainer_pipeline.
TEST_F(PipelineState, CheckpointsOfEveryGridHoldTheSameTensors) {
  const locus::test::SharedTmpDir dir(world());
  const mpi::Comm root = world().split(world().is_root() ? 0 : MPI_UNDEFINED, 0);
  const mpi::Comm none = mpi::Comm::borrow(MPI_COMM_NULL);
  // Groups of world/2 ranks: a data-parallel size of the pp = 2 run's.
  const int group = world().rank() / (world().size() / 2);
  const mpi::Comm groups = world().split(group, world().rank());
  const std::string ckpt = checkpoint_file_name(9);
  struct Case {
    TrainOptions o;
    bool bitwise;
  };
  for (const Case& c : {Case{options(2, OptimizerKind::sgd, 1), true},
                        Case{options(2, OptimizerKind::adamw, 3), false}}) {
    const std::string sub = dir.file(c.bitwise ? "bitwise" : "close");
    const std::string pp = sub + "/pp/" + ckpt, one = sub + "/one/" + ckpt;
    const std::string dp = sub + "/dp0/" + ckpt, pp_half = sub + "/half0/" + ckpt;
    const Outcome state = save_at(world(), c.o, 9, sub + "/pp");
    save_at(world().is_root() ? root.view() : none.view(), single(c.o), 9, sub + "/one");
    save_at(groups, single(c.o), 9, sub + fmt::format("/dp{}", group));
    if (groups.size() >= 2) save_at(groups, c.o, 9, sub + fmt::format("/half{}", group));
    if (world().is_root()) write_alone(c.o, state, pp, sub + "/alone.h5");
    world().barrier();
    const int dps = world().size() / 2;
    const std::string grid = fmt::format("pp=2 x dp={}", dps);
    compare_files(pp, sub + "/alone.h5", true, grid + " vs its state written by one rank");
    compare_files(pp, dp, c.bitwise, fmt::format("{} vs pp=1 x dp={}", grid, dps));
    compare_files(pp, one, c.bitwise && dps == 1, grid + " vs 1 rank");
    if (groups.size() >= 2) compare_files(pp_half, one, c.bitwise, "pp=2 (2 ranks) vs 1 rank");
  }
}

// Collective over comm: o on comm's grid resumes from `how` (a path, or auto in dir) and
// finishes; its whole state and the metrics of the steps after the resume.
Outcome resume_and_finish(const mpi::Comm& comm, const TrainOptions& o, const std::string& dir,
                          const std::string& how, ResumeResult* result) {
  const Grid grid(comm, o.pipeline_stages);
  Trainer t(grid, o);
  Checkpointer c(t, checkpoint_options(dir), "");
  *result = c.resume(how);
  EXPECT_TRUE(result->resumed);
  Recorder rec;
  EXPECT_TRUE(t.train(&rec, -1, &c).finished);
  c.wait();
  Outcome out;
  add_state(out, t);
  out.steps = rec.steps;
  return out;
}

// The continuation of a checkpoint at `stop` against an uninterrupted run on the new grid.
void expect_continues(const Outcome& got, const Outcome& want, std::int64_t stop,
                      const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(got.steps.size() + static_cast<std::size_t>(stop), want.steps.size());
  for (std::size_t i = 0; i < got.steps.size(); ++i) {
    const StepMetrics& a = got.steps[i];
    const StepMetrics& b = want.steps[i + static_cast<std::size_t>(stop)];
    EXPECT_EQ(a.step, b.step);
    EXPECT_EQ(a.samples, b.samples) << "step " << b.step;
    EXPECT_NEAR(a.loss, b.loss, 1e-4) << "step " << b.step;
  }
  EXPECT_EQ(got.optimizer_steps, want.optimizer_steps);
  expect_close(got.params, want.params, what + ": parameters");
  ASSERT_EQ(got.optimizer.size(), want.optimizer.size());
  for (std::size_t i = 0; i < got.optimizer.size(); ++i) {
    expect_close(got.optimizer[i], want.optimizer[i], what + ": optimizer state");
  }
}

// 1 rank -> pp = 2 x dp = world/2; pp = 2 x dp = world/2 -> world/2 ranks (pp = 2 x dp = 1 at
// 4 ranks, 1 rank at 2 ranks). The other directions are in test_trainer_pipeline.cpp.
TEST_F(PipelineState, ResumesOnOtherGrids) {
  const locus::test::SharedTmpDir dir(world());
  const mpi::Comm root = world().split(world().is_root() ? 0 : MPI_UNDEFINED, 0);
  const mpi::Comm none = mpi::Comm::borrow(MPI_COMM_NULL);
  const int group = world().rank() / (world().size() / 2);
  const mpi::Comm groups = world().split(group, world().rank());
  const std::int64_t stop = 9;  // mid-epoch
  const std::string ckpt = checkpoint_file_name(stop);
  ResumeResult r;

  const TrainOptions sgd = options(2, OptimizerKind::sgd, 2);
  save_at(world().is_root() ? root.view() : none.view(), single(sgd), stop, dir.file("one"));
  world().barrier();
  const Outcome from_one = resume_and_finish(world(), sgd, "", dir.file("one/" + ckpt), &r);
  EXPECT_EQ(r.meta.pipeline_stages, 1);
  EXPECT_EQ(r.meta.world_size, 1);
  expect_continues(from_one, straight_run(world(), sgd), stop, "1 rank -> pp=2");

  TrainOptions adamw = options(2, OptimizerKind::adamw, 3);
  save_at(world(), adamw, stop, dir.file("pp"));
  if (groups.size() == 1) adamw = single(adamw);  // 2 ranks: each continues alone
  const Outcome to_half = resume_and_finish(groups, adamw, "", dir.file("pp/" + ckpt), &r);
  EXPECT_EQ(r.meta.pipeline_stages, 2);
  EXPECT_EQ(r.meta.data_parallel, world().size() / 2);
  expect_continues(to_half, straight_run(groups, adamw), stop,
                   fmt::format("pp=2 x dp={} -> {}", world().size() / 2, groups.size() == 1
                                                                           ? "1 rank"
                                                                           : "pp=2 x dp=1"));
}

// A flipped bit in a tensor only the last stage reads: every rank skips the newest checkpoint
// with the same reason and resumes the previous one (a background save of the stages'
// snapshots), bitwise where an uninterrupted run is.
TEST_F(PipelineState, DamageOnTheLastStageFallsBackOnEveryRank) {
  const locus::test::SharedTmpDir dir(world());
  const TrainOptions o = options(2, OptimizerKind::adamw, 2);
  CheckpointOptions co = checkpoint_options(dir.path());
  co.every_steps = 4;
  co.async = true;  // steps 4 and 8 from the stages' snapshots, in the background
  {
    const Grid grid(world(), 2);
    Trainer t(grid, o);
    Checkpointer c(t, co, "");
    c.resume("none");
    t.train(nullptr, 9, &c);
    c.save_now("test");
    EXPECT_EQ(c.saves().size(), 3u);  // steps 4, 8, 9
  }
  const int last = static_cast<int>(o.model.widths.size()) - 2;
  const std::string tensor = "model/" + ParamLayout::weight_name(last);
  flip_tensor_bit(dir.file(checkpoint_file_name(9)), "/" + tensor);
  ResumeResult r;
  const Outcome got = resume_and_finish(world(), o, dir.path(), "auto", &r);
  EXPECT_EQ(world().allreduce(r.meta.step, MPI_MIN), 8);
  EXPECT_EQ(world().allreduce(r.meta.step, MPI_MAX), 8);
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_NE(r.skipped[0].find(checkpoint_file_name(9)), std::string::npos) << r.skipped[0];
  EXPECT_NE(r.skipped[0].find(tensor), std::string::npos) << r.skipped[0];
  const Outcome want = straight_run(world(), o);
  Outcome tail = want;
  tail.steps.erase(tail.steps.begin(), tail.steps.begin() + 8);
  expect_bitwise(got, tail, "resumed from step 8 after skipping a damaged step 9");
}

}  // namespace
}  // namespace locus::train::test
