// Checkpoint files and directories at 1, 2 and 4 ranks: bitwise round trips written at one
// world size and read at another, tensor digests equal to a serial zlib CRC-32, damage found
// (a flipped bit in a tensor or in the attributes, a newer format), the commit and retention
// rules of a directory, a write over the time budget abandoned and a failing write (file size
// limit, unwritable directory) that leaves the previous checkpoint and the pointer intact, and a
// checkpoint rewritten by h5repack (chunked, compressed) read bitwise through HDF5.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <zlib.h>

#include <fmt/format.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/h5.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"
#include "shared_tmpdir.hpp"
#include "test_checkpoint_util.hpp"

namespace locus::train::test {
namespace {

namespace fs = std::filesystem;

// Every file of these tests in memory (fsync is free on tmpfs).
class CheckpointFile : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { use_memory_tmpdir(); }
};
using CheckpointDir = CheckpointFile;

// An AdamW state with distinct values everywhere (widths chosen so that tensors have row
// counts that do not divide by 2 or 4).
TrainState make_state(std::uint64_t salt) {
  ModelSpec spec;
  spec.widths = {7, 301, 13, 5};
  spec.seed = 3;
  OptimizerOptions o;
  o.kind = OptimizerKind::adamw;
  TrainState s(spec, o);
  fill_state(s, salt);
  s.optimizer->set_steps(41);
  s.step = 41;
  s.epoch = 2;
  s.step_in_epoch = 5;
  return s;
}

CheckpointMeta make_meta(const TrainState& s, const std::string& run) {
  CheckpointMeta m;
  m.run_id = run;
  m.step = s.step;
  m.epoch = s.epoch;
  m.step_in_epoch = s.step_in_epoch;
  m.steps_per_epoch = 18;
  m.samples_in_epoch = 5 * 32;
  m.samples_seen = 2 * 570 + 160;
  m.optimizer_steps = s.optimizer->steps();
  m.optimizer = "adamw";
  m.schedule = "cosine";
  m.base_lr = 0.01;
  m.total_steps = 100;
  m.lr = 0.0075;
  m.global_batch = 32;
  m.shuffle = "global";
  m.dataset = {"train.h5", 570, 7, "0123456789abcdef"};
  m.config = "[train]\nbatch = 32\n";
  m.config_hash = "feedfacecafebeef";
  m.world_size = world().size();
  m.data_parallel = world().size();
  m.pipeline_stages = 1;
  m.created = 1700000000.5;
  m.model = s.model.spec();
  m.num_classes = 5;
  return m;
}

void expect_same_state(const TrainState& a, const TrainState& b) {
  const auto pa = a.model.params(), pb = b.model.params();
  EXPECT_EQ(0, std::memcmp(pa.data(), pb.data(), pa.size_bytes())) << "parameters differ";
  const auto sa = std::as_const(*a.optimizer).state(), sb = std::as_const(*b.optimizer).state();
  ASSERT_EQ(sa.size(), sb.size());
  for (std::size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].name, sb[i].name);
    EXPECT_EQ(0, std::memcmp(sa[i].data.data(), sb[i].data.data(), sa[i].data.size_bytes()))
        << sa[i].name << " differs";
  }
  EXPECT_EQ(a.optimizer->steps(), b.optimizer->steps());
  EXPECT_EQ(a.step, b.step);
  EXPECT_EQ(a.epoch, b.epoch);
  EXPECT_EQ(a.step_in_epoch, b.step_in_epoch);
}

TrainState fresh_like(const TrainState& s) {
  OptimizerOptions o;
  o.kind = s.optimizer->options().kind;
  return TrainState(s.model.spec(), o);
}

// Rank 0 flips one bit of the first occurrence of `needle` in the file.
void flip_bit_at(const std::string& path, std::span<const float> needle) {
  if (world().is_root()) {
    std::ifstream in(path, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    const std::string pattern(reinterpret_cast<const char*>(needle.data()), needle.size_bytes());
    const auto at = bytes.find(pattern);
    ASSERT_NE(at, std::string::npos) << "tensor bytes not found in " << path;
    bytes[at + pattern.size() / 2] ^= 0x10;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  world().barrier();
}

TEST_F(CheckpointFile, RoundTripIsBitwiseAtAnyWorldSize) {
  const locus::test::SharedTmpDir dir(world());
  const TrainState s = make_state(1);
  const CheckpointMeta m = make_meta(s, "run-a");
  const std::string path = dir.file("a.h5");
  ASSERT_EQ(write_checkpoint_file(world(), path, data_of(s, m)), WriteOutcome::written);

  TrainState all = fresh_like(s);
  const CheckpointMeta back = load_checkpoint(world(), path, all);
  expect_same_state(s, all);
  EXPECT_EQ(meta_text(back), meta_text(m));
  EXPECT_EQ(back.config, m.config);
  // Each rank alone reads what the whole world wrote.
  TrainState alone = fresh_like(s);
  load_checkpoint(mpi::Comm::borrow(MPI_COMM_SELF), path, alone);
  expect_same_state(s, alone);

  // The digests are zlib's CRC-32 of each whole tensor, whatever the world size.
  const VerifyReport r = verify_checkpoint(world(), path);
  EXPECT_TRUE(r.ok) << r.problem;
  ASSERT_EQ(r.tensors.size(), 6u * 3u);  // 3 layers x (weight, bias) x (params, m, v)
  const auto tensors = s.model.layout().tensors();
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const auto p = s.model.params().subspan(tensors[i].offset, tensors[i].size());
    const auto crc = static_cast<std::uint32_t>(
        crc32(0L, reinterpret_cast<const Bytef*>(p.data()), static_cast<uInt>(p.size_bytes())));
    EXPECT_EQ(r.tensors[i].name, "model/" + tensors[i].name);
    EXPECT_EQ(r.tensors[i].stored_crc, crc) << r.tensors[i].name;
  }
}

TEST_F(CheckpointFile, WrittenAloneReadByTheWorld) {
  const locus::test::SharedTmpDir dir(world());
  const TrainState s = make_state(2);
  // Every rank writes its own file alone; all ranks then read rank 0's together.
  const std::string mine = dir.file(fmt::format("r{}.h5", world().rank()));
  write_checkpoint_file(mpi::Comm::borrow(MPI_COMM_SELF), mine,
                        data_of(s, make_meta(s, "run-b")));
  world().barrier();
  TrainState back = fresh_like(s);
  load_checkpoint(world(), dir.file("r0.h5"), back);
  expect_same_state(s, back);
}

TEST_F(CheckpointFile, FlippedBitInATensorIsFound) {
  const locus::test::SharedTmpDir dir(world());
  const TrainState s = make_state(3);
  const std::string path = dir.file("c.h5");
  write_checkpoint_file(world(), path, data_of(s, make_meta(s, "run-c")));
  const auto exp_avg = std::as_const(*s.optimizer).state()[0].data;
  const TensorInfo w1 = s.model.layout().tensors()[2];  // layers.1.weight [13, 301]
  flip_bit_at(path, exp_avg.subspan(w1.offset + 1000, 64));
  const VerifyReport r = verify_checkpoint(world(), path);
  EXPECT_FALSE(r.ok);
  EXPECT_NE(r.problem.find("optimizer/exp_avg/layers.1.weight"), std::string::npos) << r.problem;
  int bad = 0;
  for (const auto& t : r.tensors) bad += t.ok() ? 0 : 1;
  EXPECT_EQ(bad, 1);
  TrainState back = fresh_like(s);
  try {
    load_checkpoint(world(), path, back);
    ADD_FAILURE() << "a damaged checkpoint was loaded";
  } catch (const DataError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("does not match its digest"), std::string::npos);
  }
}

TEST_F(CheckpointFile, DamagedAttributeOrNewerFormatIsRefused) {
  const locus::test::SharedTmpDir dir(world());
  const TrainState s = make_state(4);
  const std::string path = dir.file("d.h5");
  write_checkpoint_file(world(), path, data_of(s, make_meta(s, "run-d")));
  auto edit = [&](const char* name, std::int64_t v) {
    if (world().is_root()) {
      h5::init();
      h5::Id f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
      ASSERT_TRUE(f);
      h5::write_attr(f.get(), name, v);
    }
    world().barrier();
  };
  edit("step", 40);
  std::string msg;
  try {
    read_checkpoint_meta(world(), path);
  } catch (const DataError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("do not match their digest"), std::string::npos) << msg;
  EXPECT_FALSE(verify_checkpoint(world(), path).ok);
  edit("format_version", kCheckpointFormatVersion + 1);
  msg.clear();
  try {
    read_checkpoint_meta(world(), path);
  } catch (const DataError& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("format_version 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("newer locus"), std::string::npos) << msg;
  // A file that is no checkpoint at all.
  const VerifyReport junk = verify_checkpoint(world(), dir.file("nothing-here.h5"));
  EXPECT_FALSE(junk.ok);
  EXPECT_FALSE(junk.problem.empty());
}

TEST_F(CheckpointFile, AnotherModelOrOptimizerIsRefused) {
  const locus::test::SharedTmpDir dir(world());
  const TrainState s = make_state(5);
  const std::string path = dir.file("e.h5");
  write_checkpoint_file(world(), path, data_of(s, make_meta(s, "run-e")));
  ModelSpec other = s.model.spec();
  other.widths = {7, 300, 13, 5};
  OptimizerOptions adamw;
  adamw.kind = OptimizerKind::adamw;
  TrainState wrong_model(other, adamw);
  EXPECT_THROW(load_checkpoint(world(), path, wrong_model), ConfigError);
  OptimizerOptions sgd;
  sgd.momentum = 0.9;
  TrainState wrong_opt(s.model.spec(), sgd);
  try {
    load_checkpoint(world(), path, wrong_opt);
    ADD_FAILURE() << "loaded an adamw checkpoint into sgd";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("optim.optimizer = adamw"), std::string::npos)
        << e.what();
  }
}

// A checkpoint whose tensors are no longer contiguous -- rewritten by h5repack with gzip, as a
// user archiving it might -- is read through HDF5 (pieces of about 1 MiB) instead of by offset,
// still checked against its digests and bitwise what was saved, at every world size.
TEST_F(CheckpointFile, RepackedAndCompressedIsReadThroughHdf5Bitwise) {
  const locus::test::SharedTmpDir dir(world());
  ModelSpec spec;
  spec.widths = {1024, 600, 5};  // layers.0.weight: 600 rows of 4 KiB, several pieces a rank
  spec.seed = 5;
  OptimizerOptions o;
  o.kind = OptimizerKind::adamw;
  TrainState s(spec, o);
  fill_state(s, 9);
  s.optimizer->set_steps(41);
  s.step = 41;
  s.epoch = 2;
  s.step_in_epoch = 5;
  CheckpointMeta m = make_meta(s, "run-repack");
  m.model = s.model.spec();
  const std::string path = dir.file("plain.h5"), packed = dir.file("packed.h5");
  ASSERT_EQ(write_checkpoint_file(world(), path, data_of(s, m)), WriteOutcome::written);
  if (world().is_root()) {
    const std::string cmd = fmt::format("h5repack -f GZIP=1 '{}' '{}'", path, packed);
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << " failed (h5repack: Debian's hdf5-tools)";
    h5::init();
    h5::Id f(H5Fopen(packed.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT));
    ASSERT_TRUE(f);
    h5::Id ds(H5Dopen2(f.get(), "model/layers.0.weight", H5P_DEFAULT));
    ASSERT_TRUE(ds);
    h5::Id plist(H5Dget_create_plist(ds.get()));
    EXPECT_EQ(H5Pget_layout(plist.get()), H5D_CHUNKED) << "h5repack left the tensor contiguous";
  }
  world().barrier();

  TrainState back = fresh_like(s);
  const CheckpointMeta meta = load_checkpoint(world(), packed, back);
  expect_same_state(s, back);
  EXPECT_EQ(meta_text(meta), meta_text(m));
  const VerifyReport r = verify_checkpoint(world(), packed);
  EXPECT_TRUE(r.ok) << r.problem;
}

std::vector<std::string> names_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

TEST_F(CheckpointDir, CommitPointerAndRetention) {
  const locus::test::SharedTmpDir tmp(world());
  const std::string dir = tmp.path();
  TrainState s = make_state(6);
  // A checkpoint of an earlier run and a leftover temporary file of a killed save.
  write_checkpoint_file(world(), dir + "/" + checkpoint_file_name(500),
                        data_of(s, make_meta(s, "old-run")));
  if (world().is_root()) std::ofstream(dir + "/.ckpt-00000600.h5.locus-tmp") << "partial";
  world().barrier();
  for (std::int64_t step : {10, 20, 30}) {
    s.step = step;
    s.optimizer->set_steps(step);
    const SaveResult r = save_checkpoint(world(), dir, data_of(s, make_meta(s, "new-run")), {},
                                         {.keep_last = 2});
    EXPECT_TRUE(r.committed);
    EXPECT_EQ(r.path, dir + "/" + checkpoint_file_name(step));
    const LatestPointer p = read_latest(dir);
    EXPECT_TRUE(p.present);
    EXPECT_EQ(p.run_id, "new-run");
    EXPECT_EQ(p.file, checkpoint_file_name(step));
  }
  world().barrier();
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"ckpt-00000020.h5", "ckpt-00000030.h5",
                                                     "latest"}));
  const auto listed = list_checkpoints(dir);
  ASSERT_EQ(listed.size(), 2u);
  EXPECT_EQ(listed[0].step, 30);
  // Resumed from step 20 and saved at 25: step 30 belongs to an abandoned branch.
  s.step = 25;
  s.optimizer->set_steps(25);
  save_checkpoint(world(), dir, data_of(s, make_meta(s, "new-run")), {}, {.keep_last = 3});
  world().barrier();
  EXPECT_EQ(names_in(dir), (std::vector<std::string>{"ckpt-00000020.h5", "ckpt-00000025.h5",
                                                     "latest"}));
}

TEST_F(CheckpointDir, OverTheTimeBudgetTheSaveIsAbandoned) {
  const locus::test::SharedTmpDir tmp(world());
  TrainState s = make_state(7);
  ASSERT_TRUE(save_checkpoint(world(), tmp.path(), data_of(s, make_meta(s, "r")), {}, {}).committed);
  s.step = 42;
  s.optimizer->set_steps(42);
  const SaveResult r =
      save_checkpoint(world(), tmp.path(), data_of(s, make_meta(s, "r")), {.timeout_s = 1e-9}, {});
  EXPECT_FALSE(r.committed);
  world().barrier();
  EXPECT_EQ(names_in(tmp.path()), (std::vector<std::string>{"ckpt-00000041.h5", "latest"}));
  EXPECT_EQ(read_latest(tmp.path()).file, "ckpt-00000041.h5");
}

// Raises the file size limit back when the test ends.
struct FileSizeLimit {
  explicit FileSizeLimit(rlim_t bytes) {
    getrlimit(RLIMIT_FSIZE, &saved);
    std::signal(SIGXFSZ, SIG_IGN);  // fail the write with EFBIG instead of killing the rank
    rlimit l = saved;
    l.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &l);
  }
  ~FileSizeLimit() { setrlimit(RLIMIT_FSIZE, &saved); }
  rlimit saved{};
};

TEST_F(CheckpointDir, FailedWriteKeepsThePreviousCheckpoint) {
  const locus::test::SharedTmpDir tmp(world());
  TrainState s = make_state(8);
  const TrainState before = make_state(8);
  ASSERT_TRUE(save_checkpoint(world(), tmp.path(), data_of(s, make_meta(s, "r")), {}, {}).committed);
  s.step = 50;
  s.optimizer->set_steps(50);
  std::string msg;
  {
    const FileSizeLimit limit(16 * 1024);  // the checkpoint is ~100 KB
    try {
      save_checkpoint(world(), tmp.path(), data_of(s, make_meta(s, "r")), {}, {});
      ADD_FAILURE() << "the save beyond the file size limit succeeded";
    } catch (const IoError& e) {
      EXPECT_TRUE(e.agreed());
      msg = e.what();
    }
  }
  EXPECT_NE(msg.find(tmp.path()), std::string::npos) << msg;
  world().barrier();
  EXPECT_EQ(names_in(tmp.path()), (std::vector<std::string>{"ckpt-00000041.h5", "latest"}));
  EXPECT_EQ(read_latest(tmp.path()).file, "ckpt-00000041.h5");
  TrainState back = fresh_like(s);
  load_checkpoint(world(), tmp.path() + "/ckpt-00000041.h5", back);
  expect_same_state(before, back);
  // A directory that cannot exist (its parent is a file).
  const std::string blocked = tmp.file("latest") + "/sub";
  EXPECT_THROW(save_checkpoint(world(), blocked, data_of(s, make_meta(s, "r")), {}, {}),
               IoError);
  // The limit is gone: the same save now works.
  EXPECT_TRUE(save_checkpoint(world(), tmp.path(), data_of(s, make_meta(s, "r")), {}, {}).committed);
}

}  // namespace
}  // namespace locus::train::test
