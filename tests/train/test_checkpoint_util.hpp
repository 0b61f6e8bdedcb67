// Shared by the checkpoint tests: states filled with a known pattern and what a save of them
// writes; for the tests that train, what a run ends with (parameters, optimizer state, per-step
// metrics), an uninterrupted reference run and the checkpoint options of a test.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"
#include "test_trainer_util.hpp"

namespace locus::train::test {

// Test files go to /dev/shm when it exists: every checkpoint fsyncs its file and directory,
// which costs up to a second on a busy disk and nothing on tmpfs. Call before any SharedTmpDir.
inline void use_memory_tmpdir() {
  std::error_code ec;
  if (std::filesystem::is_directory("/dev/shm", ec)) ::setenv("TMPDIR", "/dev/shm", 1);
}

inline const mpi::Comm& world() {
  static const mpi::Comm w = mpi::Comm::world();
  return w;
}

// A value per (index, salt) in [-0.5, 0.5), exact in float32: states made with one salt
// are equal bit for bit, and any two tensors or salts differ.
inline float pattern_value(std::uint64_t i, std::uint64_t salt) {
  std::uint64_t x = i * 0x9e3779b97f4a7c15ull + salt;
  x = (x ^ (x >> 31)) * 0xbf58476d1ce4e5b9ull;
  return static_cast<float>(static_cast<double>(x >> 40) / 16777216.0 - 0.5);
}

// Fills the parameters and the optimizer state of `s` with pattern values by layout index, so
// a pipeline stage's state equals its slice of the whole state filled with the same salt.
inline void fill_state(TrainState& s, std::uint64_t salt) {
  const std::size_t at = s.model.offset();
  auto p = s.model.params();
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = pattern_value(at + i, salt);
  std::uint64_t k = 1;
  for (auto& b : s.optimizer->state()) {
    for (std::size_t i = 0; i < b.data.size(); ++i) {
      b.data[i] = pattern_value(at + i, salt + 1000 * k);
    }
    ++k;
  }
}

// What a save of `s` with metadata `m` writes.
inline CheckpointData data_of(const TrainState& s, const CheckpointMeta& m) {
  CheckpointData d;
  d.model = &s.model;
  for (const auto& b : std::as_const(*s.optimizer).state()) d.optimizer_state.push_back(b);
  d.meta = m;
  return d;
}

// The suite of a checkpoint test: one Data on MPI_COMM_WORLD for all its tests, and every file
// (datasets, checkpoints) in memory.
class CheckpointSuite : public WorldDataSuite {
 protected:
  static void SetUpTestSuite() {
    use_memory_tmpdir();
    WorldDataSuite::SetUpTestSuite();
  }
};

// Everything compared between an interrupted and an uninterrupted run.
struct Outcome {
  std::vector<float> params;
  std::vector<std::vector<float>> optimizer;
  std::int64_t optimizer_steps = 0;
  std::vector<StepMetrics> steps;  // log_every = 1: one per step
};

// A whole state (every layer held: no pipeline stages).
inline void add_state(Outcome& o, const TrainState& s) {
  ASSERT_TRUE(s.model.whole()) << "a pipeline stage's state: use add_state(o, trainer)";
  o.params.assign(s.model.params().begin(), s.model.params().end());
  o.optimizer.clear();
  for (const auto& b : std::as_const(*s.optimizer).state()) {
    o.optimizer.emplace_back(b.data.begin(), b.data.end());
  }
  o.optimizer_steps = s.optimizer->steps();
}

// Collective over comm: the whole layout-sized buffer from every rank's slice of it (`offset`:
// the layout offset of slice[0]; the ranks' slices cover the layout, replicas alike). Each
// slice's lowest rank contributes it and every other rank zeros, combined by a bitwise OR, so
// no float arithmetic touches the values (-0.0 and NaN bits survive).
inline std::vector<float> gather_slices(const mpi::Comm& comm, std::span<const float> slice,
                                        std::size_t offset, std::size_t size) {
  const auto offsets = comm.allgather(static_cast<std::uint64_t>(offset));
  bool first = true;  // the lowest rank holding this slice
  for (int r = 0; r < comm.rank(); ++r) {
    first = first && offsets[static_cast<std::size_t>(r)] != offset;
  }
  std::vector<std::uint32_t> bits(size, 0u);
  if (first) std::memcpy(bits.data() + offset, slice.data(), slice.size_bytes());
  LOCUS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, bits.data(), static_cast<int>(size), MPI_UINT32_T,
                                MPI_BOR, comm.get()));
  std::vector<float> out(size);
  std::memcpy(out.data(), bits.data(), size * sizeof(float));
  return out;
}

// Collective over the trainer's world: its whole state, gathered from the stages when each
// rank holds only its stage's layers (a test's view; the library never gathers it).
inline void add_state(Outcome& o, const Trainer& t) {
  const TrainState& s = t.state();
  if (t.grid().pipeline_stages() == 1) return add_state(o, s);
  const mpi::Comm& comm = t.grid().world();
  const std::size_t size = s.model.layout().size(), at = s.model.offset();
  o.params = gather_slices(comm, s.model.params(), at, size);
  o.optimizer.clear();
  for (const auto& b : std::as_const(*s.optimizer).state()) {
    o.optimizer.push_back(gather_slices(comm, b.data, at, size));
  }
  o.optimizer_steps = s.optimizer->steps();
}

// Collective over comm: an uninterrupted run of o on comm, in o.pipeline_stages stages.
inline Outcome straight_run(const mpi::Comm& comm, const TrainOptions& o) {
  const Grid grid(comm, o.pipeline_stages);
  Trainer t(grid, o);
  Recorder rec;
  t.train(&rec);
  Outcome out;
  add_state(out, t);
  out.steps = rec.steps;
  return out;
}

inline CheckpointOptions checkpoint_options(const std::string& dir) {
  CheckpointOptions c;
  c.dir = dir;
  c.keep_last = 0;
  return c;
}

// Bitwise: parameters, optimizer state and every step's loss, accuracy, lr and grad norm.
inline void expect_bitwise(const Outcome& got, const Outcome& want, const std::string& what) {
  ASSERT_EQ(got.params.size(), want.params.size()) << what;
  EXPECT_EQ(0, std::memcmp(got.params.data(), want.params.data(), got.params.size() * 4))
      << what << ": parameters differ";
  ASSERT_EQ(got.optimizer.size(), want.optimizer.size()) << what;
  for (std::size_t i = 0; i < got.optimizer.size(); ++i) {
    EXPECT_EQ(got.optimizer[i], want.optimizer[i]) << what << ": optimizer state " << i;
  }
  EXPECT_EQ(got.optimizer_steps, want.optimizer_steps) << what;
  ASSERT_EQ(got.steps.size(), want.steps.size()) << what << ": step metrics";
  for (std::size_t i = 0; i < got.steps.size(); ++i) {
    const StepMetrics &a = got.steps[i], &b = want.steps[i];
    EXPECT_EQ(a.step, b.step) << what;
    EXPECT_EQ(a.samples, b.samples) << what << " step " << b.step;
    EXPECT_EQ(a.loss, b.loss) << what << " step " << b.step;  // bitwise on doubles
    EXPECT_EQ(a.accuracy, b.accuracy) << what << " step " << b.step;
    EXPECT_EQ(a.lr, b.lr) << what << " step " << b.step;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << what << " step " << b.step;
  }
}

// Within the data-parallel tolerance of tests/train/test_trainer_dp.cpp (float summation
// order only): 2e-6 absolute + 2e-5 relative.
inline void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                         const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double q = want[i];
    worst = std::max(worst, std::abs(got[i] - q));
    ASSERT_NEAR(got[i], q, 2e-6 + 2e-5 * std::abs(q)) << what << ": element " << i;
  }
  ::testing::Test::RecordProperty(what, std::to_string(worst));
}

// Rank 0 of world() flips one bit in the middle of the tensor dataset `name` of a checkpoint
// ("/model/layers.3.weight"), found through HDF5 (tensors are contiguous). Collective.
inline void flip_tensor_bit(const std::string& path, const std::string& name) {
  if (world().is_root()) {
    haddr_t at = HADDR_UNDEF;
    hsize_t bytes = 0;
    {
      h5::File f = h5::File::open(mpi::Comm::borrow(MPI_COMM_SELF), path, h5::File::Mode::read);
      {
        const h5::Dataset ds = h5::Dataset::open(f, name);
        at = H5Dget_offset(ds.id());
        bytes = H5Dget_storage_size(ds.id());
      }
      f.close();
    }
    EXPECT_NE(at, HADDR_UNDEF) << name << " is not a contiguous dataset";
    if (at != HADDR_UNDEF) {
      std::fstream io(path, std::ios::binary | std::ios::in | std::ios::out);
      io.seekg(static_cast<std::streamoff>(at + bytes / 2));
      char c = 0;
      io.read(&c, 1);
      c = static_cast<char>(c ^ 0x04);
      io.seekp(static_cast<std::streamoff>(at + bytes / 2));
      io.write(&c, 1);
      EXPECT_TRUE(io.good()) << "cannot flip a bit of " << path;
    }
  }
  world().barrier();  // every rank waits for the damage
}

}  // namespace locus::train::test
