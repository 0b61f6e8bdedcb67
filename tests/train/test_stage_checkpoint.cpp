// Checkpoint and model files written and read by pipeline stages that hold only their layers
// (pp = 2 at 2 ranks; pp = 2 x dp = 2 and pp = 4 at 4 ranks), without training: the stages'
// file is bitwise the file one rank writes from the whole state (tensors and CRC-32s); a file
// written by one rank loads into every stage's layers; a flipped bit in a tensor only the last
// stage reads is the same agreed DataError on every rank; the stages write a model file.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cstring>
#include <string>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"
#include "locus/train/grid.hpp"
#include "locus/train/model/model_file.hpp"
#include "locus/train/pipeline/pipeline.hpp"
#include "shared_tmpdir.hpp"
#include "test_checkpoint_util.hpp"

namespace locus::train::test {
namespace {

class StageCheckpoint : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { use_memory_tmpdir(); }
};

mpi::Comm self() { return mpi::Comm::borrow(MPI_COMM_SELF); }

// 4 layers (up to 4 stages) whose row counts do not divide by 2 or 4.
ModelSpec spec() {
  ModelSpec s;
  s.widths = {7, 301, 13, 9, 5};
  s.seed = 3;
  return s;
}

// An AdamW state of layers `held` whose every value is a function of its layout index, so a
// stage's state is exactly its slice of the whole state made with the same salt.
TrainState make_state(LayerRange held, std::uint64_t salt) {
  OptimizerOptions o;
  o.kind = OptimizerKind::adamw;
  TrainState s(spec(), o, held);
  fill_state(s, salt);
  s.optimizer->set_steps(17);
  s.step = 17;
  s.epoch = 1;
  s.step_in_epoch = 3;
  return s;
}

LayerRange stage_layers(const Grid& g) {
  return StagePartition(ParamLayout(spec().widths), g.pipeline_stages()).stage(g.stage()).held();
}

CheckpointMeta meta_of(const TrainState& s, const Grid& g) {
  CheckpointMeta m;
  m.run_id = "stages";
  m.step = s.step;
  m.epoch = s.epoch;
  m.step_in_epoch = s.step_in_epoch;
  m.steps_per_epoch = 14;
  m.optimizer_steps = s.optimizer->steps();
  m.optimizer = "adamw";
  m.schedule = "constant";
  m.base_lr = 0.01;
  m.global_batch = 32;
  m.shuffle = "global";
  m.dataset = {"train.h5", 450, 7, "0123456789abcdef"};
  m.world_size = g.world().size();
  m.data_parallel = g.data_parallel();
  m.pipeline_stages = g.pipeline_stages();
  m.created = 1700000000.5;
  m.model = s.model.spec();
  m.num_classes = 5;
  return m;
}

// The grids of this world size with more than one stage.
std::vector<int> stage_counts() {
  std::vector<int> out{2};
  if (world().size() >= 4) out.push_back(4);
  return out;
}

bool bitwise_equal(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

TEST_F(StageCheckpoint, StagesWriteTheFileOneRankWrites) {
  const locus::test::SharedTmpDir dir(world());
  const TrainState whole = make_state(ParamLayout(spec().widths).all_layers(), 1);
  for (const int stages : stage_counts()) {
    const Grid g(world(), stages);
    SCOPED_TRACE(g.describe());
    const TrainState mine = make_state(stage_layers(g), 1);
    ASSERT_FALSE(mine.model.whole());
    const CheckpointMeta m = meta_of(mine, g);
    const std::string staged = dir.file(fmt::format("staged-{}.h5", stages));
    const std::string alone = dir.file(fmt::format("alone-{}.h5", stages));
    ASSERT_EQ(write_checkpoint_file(g.world(), staged, data_of(mine, m)), WriteOutcome::written);
    if (world().is_root()) write_checkpoint_file(self(), alone, data_of(whole, m));
    world().barrier();
    const VerifyReport vs = verify_checkpoint(world(), staged);
    EXPECT_TRUE(vs.ok) << vs.problem;
    if (!world().is_root()) continue;
    // Per tensor: the same bytes and the same stored CRC-32 as the one-rank file's.
    const VerifyReport va = verify_checkpoint(self(), alone);
    ASSERT_EQ(vs.tensors.size(), va.tensors.size());
    for (std::size_t i = 0; i < vs.tensors.size(); ++i) {
      EXPECT_EQ(vs.tensors[i].name, va.tensors[i].name);
      EXPECT_EQ(vs.tensors[i].stored_crc, va.tensors[i].stored_crc) << vs.tensors[i].name;
    }
    const TrainState a = load_checkpoint_state(self(), staged);
    const TrainState b = load_checkpoint_state(self(), alone);
    EXPECT_TRUE(bitwise_equal(a.model.params(), whole.model.params())) << "parameters differ";
    EXPECT_TRUE(bitwise_equal(a.model.params(), b.model.params()));
    const auto sa = std::as_const(*a.optimizer).state();
    const auto sw = std::as_const(*whole.optimizer).state();
    ASSERT_EQ(sa.size(), sw.size());
    for (std::size_t i = 0; i < sa.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(sa[i].data, sw[i].data)) << sa[i].name << " differs";
    }
  }
}

TEST_F(StageCheckpoint, EveryStageReadsItsLayers) {
  const locus::test::SharedTmpDir dir(world());
  const Grid one(world(), 1);
  const TrainState whole = make_state(ParamLayout(spec().widths).all_layers(), 2);
  const std::string path = dir.file("alone.h5");
  if (world().is_root()) write_checkpoint_file(self(), path, data_of(whole, meta_of(whole, one)));
  world().barrier();
  for (const int stages : stage_counts()) {
    const Grid g(world(), stages);
    SCOPED_TRACE(g.describe());
    TrainState mine = make_state(stage_layers(g), 99);  // other values: all must be replaced
    load_checkpoint(g.world(), path, mine);
    const TrainState want = make_state(stage_layers(g), 2);
    EXPECT_TRUE(bitwise_equal(mine.model.params(), want.model.params()));
    const auto sm = std::as_const(*mine.optimizer).state();
    const auto sw = std::as_const(*want.optimizer).state();
    for (std::size_t i = 0; i < sm.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(sm[i].data, sw[i].data)) << sm[i].name << " differs";
    }
    EXPECT_EQ(mine.step, 17);
    EXPECT_EQ(mine.optimizer->steps(), 17);
    EXPECT_EQ(mine.step_in_epoch, 3);
  }
}

TEST_F(StageCheckpoint, FlippedBitInALastStageTensorFailsEveryRank) {
  const locus::test::SharedTmpDir dir(world());
  const int layers = ParamLayout(spec().widths).num_layers();
  for (const int stages : stage_counts()) {
    const Grid g(world(), stages);
    SCOPED_TRACE(g.describe());
    const TrainState mine = make_state(stage_layers(g), 3);
    const std::string path = dir.file(fmt::format("flip-{}.h5", stages));
    write_checkpoint_file(g.world(), path, data_of(mine, meta_of(mine, g)));
    const std::string tensor = "optimizer/exp_avg_sq/" + ParamLayout::weight_name(layers - 1);
    flip_tensor_bit(path, "/" + tensor);
    // Only the last stage's ranks read the damaged tensor; every rank must refuse the file.
    EXPECT_EQ(stage_layers(g).contains(layers - 1), g.stage() + 1 == stages);
    TrainState back = make_state(stage_layers(g), 4);
    int refused = 0;
    try {
      load_checkpoint(g.world(), path, back);
    } catch (const DataError& e) {
      refused = 1;
      EXPECT_TRUE(e.agreed());
      EXPECT_NE(std::string(e.what()).find(tensor), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("does not match its digest"), std::string::npos);
    }
    EXPECT_EQ(world().allreduce(refused, MPI_SUM), world().size());
    const VerifyReport r = verify_checkpoint(world(), path);
    EXPECT_FALSE(r.ok);
    EXPECT_NE(r.problem.find(tensor), std::string::npos) << r.problem;
  }
}

TEST_F(StageCheckpoint, StagesWriteAModelFile) {
  const locus::test::SharedTmpDir dir(world());
  const TrainState whole = make_state(ParamLayout(spec().widths).all_layers(), 5);
  for (const int stages : stage_counts()) {
    const Grid g(world(), stages);
    const TrainState mine = make_state(stage_layers(g), 5);
    ModelInfo info;
    info.num_classes = 5;
    info.trained_steps = mine.step;
    const std::string path = dir.file(fmt::format("model-{}.h5", stages));
    write_model_file(g.world(), path, mine.model, info);
    // Read back by every rank and by one alone: the whole model, bit for bit.
    const Mlp all = read_model_file(world(), path);
    EXPECT_TRUE(bitwise_equal(all.params(), whole.model.params())) << g.describe();
    if (world().is_root()) {
      ModelInfo back;
      const Mlp one = read_model_file(self(), path, &back);
      EXPECT_TRUE(bitwise_equal(one.params(), whole.model.params())) << g.describe();
      EXPECT_EQ(back.trained_steps, 17);
    }
  }
}

}  // namespace
}  // namespace locus::train::test
