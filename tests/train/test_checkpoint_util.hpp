// Shared by the checkpoint tests that train: what a run ends with (parameters, optimizer state,
// per-step metrics), an uninterrupted reference run and the checkpoint options of a test.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "locus/train/checkpoint.hpp"
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

// Everything compared between an interrupted and an uninterrupted run.
struct Outcome {
  std::vector<float> params;
  std::vector<std::vector<float>> optimizer;
  std::int64_t optimizer_steps = 0;
  std::vector<StepMetrics> steps;  // log_every = 1: one per step
};

inline void add_state(Outcome& o, const TrainState& s) {
  o.params.assign(s.model.params().begin(), s.model.params().end());
  o.optimizer.clear();
  for (const auto& b : std::as_const(*s.optimizer).state()) {
    o.optimizer.emplace_back(b.data.begin(), b.data.end());
  }
  o.optimizer_steps = s.optimizer->steps();
}

inline Outcome straight_run(const mpi::Comm& comm, const TrainOptions& o) {
  const Grid grid(comm, 1);
  Trainer t(grid, o);
  Recorder rec;
  t.train(&rec);
  Outcome out;
  add_state(out, t.state());
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

}  // namespace locus::train::test
