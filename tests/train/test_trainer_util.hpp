// Shared by the trainer tests: a small labelled dataset ingested through lib/io (so the loader
// reads a real locus file), the options of a small run, and parameter comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/io/ingest.hpp"
#include "locus/train/trainer.hpp"
#include "shared_tmpdir.hpp"

namespace locus::train::test {

inline constexpr int kFeatures = 12;
inline constexpr int kClasses = 4;

inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1) from (row, column, salt).
inline double noise(std::uint64_t row, int col, std::uint64_t salt) {
  const std::uint64_t h = mix(mix(row * 131 + static_cast<std::uint64_t>(col)) ^ salt);
  return static_cast<double>(h >> 11) / 4503599627370496.0 - 1.0;
}

// Collective over comm: ingests `rows` samples of 4 overlapping Gaussian-like clusters in 12
// dimensions (learnable, not trivially: a linear model gets ~85%) into a locus dataset.
inline void make_dataset(const mpi::Comm& comm, const std::string& path, int rows,
                         std::uint64_t salt, std::int64_t num_classes = kClasses) {
  const std::string csv = path + ".csv";
  if (comm.is_root()) {
    std::ofstream out(csv);
    for (int k = 0; k < kFeatures; ++k) out << "f" << k << ",";
    out << "label\n";
    for (int i = 0; i < rows; ++i) {
      const auto id = static_cast<std::uint64_t>(i);
      const int label = static_cast<int>(mix(id ^ salt) % kClasses);
      for (int k = 0; k < kFeatures; ++k) {
        const double centre = 1.2 * std::sin(1.7 * label + 0.9 * k);
        out << centre + 1.1 * noise(id, k, salt) << ",";
      }
      out << label << "\n";
    }
  }
  comm.barrier();
  io::IngestOptions o;
  o.source = io::IngestOptions::Source::csv;
  o.csv.path = csv;
  o.csv.label_column = "label";
  o.output = path;
  o.num_classes = num_classes;
  o.overwrite = true;
  io::run_ingest(comm, o);
}

// The datasets of a test: train (600 rows) and test (250 rows), made once per process.
struct Data {
  explicit Data(const mpi::Comm& comm) : dir(comm) {
    make_dataset(comm, train(), 600, 11);
    make_dataset(comm, test(), 250, 23);
  }
  std::string train() const { return dir.file("train.h5"); }
  std::string test() const { return dir.file("test.h5"); }
  locus::test::SharedTmpDir dir;
};

// A suite whose tests share one Data on MPI_COMM_WORLD, made before its first test and
// removed (collectively) after its last, before MPI finalizes.
class WorldDataSuite : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    static const mpi::Comm world = mpi::Comm::world();
    data_ = new Data(world);
  }
  static void TearDownTestSuite() {
    delete data_;
    data_ = nullptr;
  }
  static Data& data() { return *data_; }

 private:
  static inline Data* data_ = nullptr;
};

inline TrainOptions small_options(const Data& d) {
  TrainOptions o;
  o.model.widths = {kFeatures, 24, 16, kClasses};
  o.model.seed = 7;
  o.optimizer.momentum = 0.9;
  o.optimizer.nesterov = true;
  o.optimizer.weight_decay = 1e-4;
  o.schedule.kind = ScheduleKind::cosine;
  o.schedule.base_lr = 0.05;
  o.schedule.warmup_steps = 5;
  o.epochs = 2;
  o.data.path = d.train();
  o.data.global_batch = 42;  // 4 ranks get 10 or 11 rows: uneven on purpose
  o.data.shuffle = Shuffle::global;
  o.data.seed = 3;
  o.eval_path = d.test();
  o.eval_batch = 64;
  o.log_every = 4;
  // Small buckets, so the streaming all-reduce really runs in several pieces.
  o.reducer.bucket_bytes = 512;
  o.reducer.chunk_bytes = 1024;
  return o;
}

// Collective over comm: true when every rank holds bitwise the same floats.
inline bool same_on_all_ranks(const mpi::Comm& comm, std::span<const float> v) {
  std::vector<float> lo(v.begin(), v.end()), hi(v.begin(), v.end());
  comm.allreduce_inplace(std::span<float>(lo), MPI_MIN);
  comm.allreduce_inplace(std::span<float>(hi), MPI_MAX);
  return lo == hi;
}

// Records what the trainer reports.
struct Recorder final : TrainObserver {
  std::vector<StepMetrics> steps;
  std::vector<EpochMetrics> epochs;
  void on_step(const StepMetrics& m) override { steps.push_back(m); }
  void on_epoch(const EpochMetrics& m) override { epochs.push_back(m); }
};

}  // namespace locus::train::test
