// run_inference with infer.backend = cuda at 1 and 2 ranks: against the CPU run of the same
// options (probabilities within 1e-5 in fp32, argmax and top-k equal except at near-ties of the
// probabilities, the same metrics), and bytes identical to a 1-rank GPU run whatever the world
// size, read size, schedule, speculation (a slowed rank), incremental extension or batch
// layout on the device (a batch whose bytes are not a multiple of 256 is padded). tf32 and
// bf16 runs are repeatable; raw outputs (a regression model) match the CPU. Skipped (with the
// reason) where no GPU can run the engine.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "locus/infer/infer.hpp"
#include "locus/io/dataset_file.hpp"
#include "locus/train/cuda/device_model.hpp"
#include "locus/train/model/model_file.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;

namespace {

constexpr int kCols = 20, kClasses = 6, kTopK = 3;
constexpr std::uint64_t kUnit = 150;

std::string no_gpu() {
  return train::cuda::device_count() == 0 ? train::cuda::describe_devices() : std::string();
}

float feature(std::uint64_t row, int col) {
  const std::uint64_t h = (row * 2654435761u + static_cast<std::uint64_t>(col) * 40503u) % 1009u;
  return static_cast<float>(h) / 504.5f - 1.0f;
}
std::int32_t label(std::uint64_t row) { return static_cast<std::int32_t>((row * 7u) % kClasses); }

io::Table rows_table(const mpi::Comm& world, std::uint64_t begin, std::uint64_t end,
                     std::uint64_t* first) {
  const h5::RowRange mine = h5::partition_rows(end - begin, world.rank(), world.size());
  io::Table t;
  t.cols = kCols;
  t.has_labels = true;
  for (std::uint64_t r = begin + mine.begin; r < begin + mine.end(); ++r) {
    for (int c = 0; c < kCols; ++c) t.features.push_back(feature(r, c));
    t.labels.push_back(label(r));
  }
  *first = begin + mine.begin;
  return t;
}

io::DatasetMeta meta_for(std::int64_t rows) {
  io::DatasetMeta m;
  m.rows = rows;
  m.cols = kCols;
  m.num_classes = kClasses;
  m.has_labels = true;
  m.label_name = "label";
  for (int c = 0; c < kCols; ++c) m.feature_names.push_back("f" + std::to_string(c));
  return m;
}

void write_data(const mpi::Comm& world, const std::string& path, std::uint64_t rows) {
  std::uint64_t first = 0;
  const io::Table t = rows_table(world, 0, rows, &first);
  h5::File f = h5::File::create(world, path);
  io::write_dataset(f, t, first, rows, meta_for(static_cast<std::int64_t>(rows)), 50);
  f.close();
}

void append_data(const mpi::Comm& world, const std::string& path, std::uint64_t old_rows,
                 std::uint64_t new_rows) {
  std::uint64_t first = 0;
  const io::Table t = rows_table(world, old_rows, new_rows, &first);
  h5::File f = h5::File::open(world, path, h5::File::Mode::read_write);
  io::append_dataset(f, t, first, new_rows, meta_for(static_cast<std::int64_t>(new_rows)));
  f.close();
}

struct Output {
  std::vector<float> scores, topk_scores;
  std::vector<std::int32_t> predicted, topk, writer;
};

// Collective over comm.
Output read_output(const mpi::Comm& comm, const std::string& path, std::uint64_t rows,
                   int classes = kClasses, int k = kTopK) {
  h5::File f = h5::File::open(comm, path, h5::File::Mode::read);
  Output o;
  o.scores.resize(rows * static_cast<std::uint64_t>(classes));
  h5::Dataset::open(f, "/scores").read_rows<float>(0, o.scores);
  if (k > 0) {
    o.predicted.resize(rows);
    o.topk.resize(rows * static_cast<std::uint64_t>(k));
    o.topk_scores.resize(rows * static_cast<std::uint64_t>(k));
    h5::Dataset::open(f, "/predicted").read_rows<std::int32_t>(0, o.predicted);
    h5::Dataset::open(f, "/topk_classes").read_rows<std::int32_t>(0, o.topk);
    h5::Dataset::open(f, "/topk_scores").read_rows<float>(0, o.topk_scores);
    o.writer.resize(rows);
    h5::Dataset::open(f, "/writer").read_rows<std::int32_t>(0, o.writer);
  }
  f.close();
  return o;
}

template <class T> bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

void expect_same_bytes(const Output& a, const Output& b, const std::string& what) {
  EXPECT_TRUE(same_bytes(a.scores, b.scores)) << what << ": /scores differ";
  EXPECT_TRUE(same_bytes(a.predicted, b.predicted)) << what << ": /predicted differ";
  EXPECT_TRUE(same_bytes(a.topk, b.topk)) << what << ": /topk_classes differ";
  EXPECT_TRUE(same_bytes(a.topk_scores, b.topk_scores)) << what << ": /topk_scores differ";
}

struct Job {
  mpi::Comm world = mpi::Comm::world();
  mpi::Comm solo = world.split(world.rank(), 0);  // each rank alone: the 1-rank reference
  test::SharedTmpDir dir{world};
  train::Mlp model{train::ModelSpec{.widths = {kCols, 24, kClasses}, .seed = 11}};
  std::string model_path = dir.file("model.h5");
  std::string data_path = dir.file("data.h5");

  Job() {
    train::ModelInfo info;
    info.num_classes = kClasses;
    train::write_model_file(world, model_path, model, info);
  }
  infer::InferOptions options(const std::string& name, const std::string& backend = "cuda") const {
    infer::InferOptions o;
    o.model = model_path;
    o.input = data_path;
    o.output = dir.file(name);
    o.top_k = kTopK;
    o.batch_rows = 32;
    o.unit_rows = kUnit;
    o.record_writer = true;
    o.backend = backend;
    return o;
  }
  // The 1-rank GPU run of o (every rank scores alone into its own file); rank 0's output.
  Output solo_reference(infer::InferOptions o, std::uint64_t rows) const {
    const std::string out = o.output;
    o.output = fmt::format("{}.solo{}.h5", out, world.rank());
    o.report = o.output + ".json";
    infer::run_inference(solo, o);
    world.barrier();  // rank 0's file is complete before any rank opens it
    return read_output(world, fmt::format("{}.solo0.h5", out), rows);
  }
};

void expect_all_written(const Output& o, const infer::InferResult& r, int ranks) {
  for (std::int32_t w : o.writer) {
    ASSERT_GE(w, 0) << "a row was never written";
    ASSERT_LT(w, ranks);
  }
  EXPECT_EQ(r.units_written_once, r.units);
}

}  // namespace

#define LOCUS_SKIP_WITHOUT_GPU()                          \
  do {                                                    \
    if (const std::string why = no_gpu(); !why.empty()) { \
      GTEST_SKIP() << why;                                \
    }                                                     \
  } while (0)

TEST(InferCuda, MatchesTheCpuRun) {
  LOCUS_SKIP_WITHOUT_GPU();
  Job s;
  constexpr std::uint64_t kRows = 2000;
  write_data(s.world, s.data_path, kRows);
  // 32 rows x 20 floats is 2560 bytes (batches back to back on the device); 25 rows is 2000
  // bytes (each batch padded to a 256-byte boundary).
  for (int batch : {32, 25}) {
    SCOPED_TRACE(fmt::format("batch_rows {}", batch));
    infer::InferOptions cpu_o = s.options(fmt::format("cpu{}.h5", batch), "cpu");
    infer::InferOptions gpu_o = s.options(fmt::format("gpu{}.h5", batch));
    cpu_o.batch_rows = gpu_o.batch_rows = batch;
    const infer::InferResult rc = infer::run_inference(s.world, cpu_o);
    const infer::InferResult rg = infer::run_inference(s.world, gpu_o);
    EXPECT_NE(rg.compute.find("cuda fp32 on device"), std::string::npos) << rg.compute;
    const Output cpu = read_output(s.world, cpu_o.output, kRows);
    const Output gpu = read_output(s.world, gpu_o.output, kRows);
    expect_all_written(gpu, rg, s.world.size());
    double worst = 0;
    for (std::size_t i = 0; i < cpu.scores.size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(gpu.scores[i]) - cpu.scores[i]));
    EXPECT_LE(worst, 1e-5) << "probabilities differ from the CPU run";
    // Argmax and top-k equal to the CPU's; a difference only where the CPU's probabilities of
    // the two classes are within 1e-5 (a near-tie the GEMMs' summation order may flip).
    std::int64_t near_ties = 0;
    for (std::uint64_t r = 0; r < kRows; ++r) {
      const float* p = cpu.scores.data() + r * kClasses;
      for (int t = 0; t < kTopK; ++t) {
        const std::size_t i = r * kTopK + static_cast<std::size_t>(t);
        if (gpu.topk[i] == cpu.topk[i]) continue;
        ++near_ties;
        EXPECT_LE(std::abs(p[gpu.topk[i]] - p[cpu.topk[i]]), 1e-5)
            << "row " << r << " rank " << t << ": class " << gpu.topk[i] << " on the GPU, "
            << cpu.topk[i] << " on the CPU";
      }
      if (gpu.predicted[r] != cpu.predicted[r]) {
        EXPECT_LE(std::abs(p[gpu.predicted[r]] - p[cpu.predicted[r]]), 1e-5) << "row " << r;
      }
    }
    ASSERT_TRUE(rc.metrics && rg.metrics);
    EXPECT_EQ(rg.metrics->rows, static_cast<std::int64_t>(kRows));
    EXPECT_LE(std::abs(rg.metrics->correct - rc.metrics->correct), near_ties);
    if (near_ties == 0) {
      EXPECT_EQ(rg.metrics->confusion, rc.metrics->confusion);
    }
    EXPECT_NEAR(rg.metrics->log_loss_sum, rc.metrics->log_loss_sum, 1e-5 * kRows);
  }
}

TEST(InferCuda, BytesDoNotDependOnWorldSizeReadsOrSchedule) {
  LOCUS_SKIP_WITHOUT_GPU();
  Job s;
  constexpr std::uint64_t kRows = 1234;
  write_data(s.world, s.data_path, kRows);
  const Output ref = s.solo_reference(s.options("ref.h5"), kRows);
  int run = 0;
  for (std::uint64_t read_rows : {0u, 32u, 50u, 128u}) {
    for (int mode : {0, 1, 2}) {  // speculation on, off, static blocks
      infer::InferOptions o = s.options(fmt::format("r{}.h5", run++));
      o.read_rows = read_rows;
      o.speculate = mode == 0;
      if (mode == 2) o.schedule = infer::Schedule::static_blocks;
      // Parallel reads into the page-locked ring: 3 threads (pread), or 1 (H5Dread: the test
      // file's chunks are small), or the cuda default.
      o.read_threads = mode == 0 ? 3 : mode == 1 ? 1 : 0;
      const infer::InferResult r = infer::run_inference(s.world, o);
      const Output out = read_output(s.world, o.output, kRows);
      expect_all_written(out, r, s.world.size());
      expect_same_bytes(out, ref, fmt::format("{} ranks, read_rows {}, mode {}, read {}",
                                              s.world.size(), read_rows, mode, r.read));
    }
  }
}

TEST(InferCuda, SlowRankIsOvertakenAndBytesAreUnchanged) {
  LOCUS_SKIP_WITHOUT_GPU();
  Job s;
  if (s.world.size() < 2) GTEST_SKIP() << "needs a slow and a fast rank";
  constexpr std::uint64_t kRows = 6000;
  write_data(s.world, s.data_path, kRows);
  const Output ref = s.solo_reference(s.options("ref.h5"), kRows);
  infer::InferOptions o = s.options("slow.h5");
  o.slow_ranks = {s.world.size() - 1};
  o.slow_ms = 300;
  o.overwrite = true;
  bool exercised = false;
  for (int attempt = 0; attempt < 5 && !exercised; ++attempt) {
    const infer::InferResult r = infer::run_inference(s.world, o);
    const Output out = read_output(s.world, o.output, kRows);
    expect_all_written(out, r, s.world.size());
    expect_same_bytes(out, ref, "with a slowed rank");
    if (r.ranks.back().claimed == 0) continue;
    exercised = true;
    EXPECT_GT(r.speculative_runs, 0);
    std::int64_t wins = 0;
    for (const auto& rs : r.ranks) wins += rs.speculative_wins;
    EXPECT_GT(wins, 0) << "re-runs of the slow rank's units must win";
    EXPECT_GT(r.ranks.back().abandoned, 0) << "the slow rank must drop units others finished";
  }
  EXPECT_TRUE(exercised) << "the slow rank never got a unit in 5 runs";
}

TEST(InferCuda, IncrementalAfterAppendEqualsAFullRun) {
  LOCUS_SKIP_WITHOUT_GPU();
  Job s;
  write_data(s.world, s.data_path, 1234);
  infer::InferOptions o = s.options("inc.h5");
  infer::run_inference(s.world, o);
  append_data(s.world, s.data_path, 1234, 2000);
  o.incremental = true;
  o.read_rows = 32;  // the first unit of the increment starts mid-unit and mid-stripe
  const infer::InferResult r = infer::run_inference(s.world, o);
  EXPECT_TRUE(r.incremental);
  EXPECT_EQ(r.row_begin, 1234u);
  EXPECT_EQ(r.metrics->rows, 2000 - 1234);
  const Output ref = s.solo_reference(s.options("full.h5"), 2000);
  const Output out = read_output(s.world, o.output, 2000);
  for (std::int32_t w : out.writer) ASSERT_GE(w, 0);
  expect_same_bytes(out, ref, "incremental vs full GPU run");
}

TEST(InferCuda, ReducedPrecisionsAreRepeatable) {
  LOCUS_SKIP_WITHOUT_GPU();
  Job s;
  constexpr std::uint64_t kRows = 1000;
  write_data(s.world, s.data_path, kRows);
  const infer::InferOptions cpu_o = s.options("cpu.h5", "cpu");
  infer::run_inference(s.world, cpu_o);
  const Output cpu = read_output(s.world, cpu_o.output, kRows);
  for (auto [precision, tol] : {std::pair{"tf32", 2e-3}, std::pair{"bf16", 3e-2}}) {
    infer::InferOptions o = s.options(fmt::format("{}.h5", precision));
    o.precision = precision;
    const infer::InferResult r = infer::run_inference(s.world, o);
    EXPECT_NE(r.compute.find(fmt::format("cuda {} on", precision)), std::string::npos) << r.compute;
    const Output a = read_output(s.world, o.output, kRows);
    const Output b = s.solo_reference(o, kRows);
    expect_same_bytes(a, b, fmt::format("{}: {} ranks vs 1", precision, s.world.size()));
    double worst = 0;
    std::int64_t agree = 0;
    for (std::size_t i = 0; i < a.scores.size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(a.scores[i]) - cpu.scores[i]));
    for (std::uint64_t row = 0; row < kRows; ++row) agree += a.predicted[row] == cpu.predicted[row];
    EXPECT_LE(worst, tol) << precision << " probabilities vs the CPU's";
    EXPECT_GE(agree, static_cast<std::int64_t>(kRows * 97 / 100)) << precision << " argmax vs the CPU's";
  }
}

TEST(InferCuda, RawOutputsMatchTheCpu) {
  LOCUS_SKIP_WITHOUT_GPU();
  Job s;
  constexpr std::uint64_t kRows = 700;
  write_data(s.world, s.data_path, kRows);
  train::ModelInfo info;
  info.loss = train::Loss::mse;  // outputs = auto: raw
  const std::string path = s.dir.file("regression.h5");
  train::write_model_file(s.world, path, s.model, info);
  infer::InferOptions cpu_o = s.options("raw-cpu.h5", "cpu"), gpu_o = s.options("raw-gpu.h5");
  cpu_o.model = gpu_o.model = path;
  cpu_o.top_k = gpu_o.top_k = 0;
  const infer::InferResult r = infer::run_inference(s.world, gpu_o);
  EXPECT_EQ(r.kind, infer::OutputKind::raw);
  EXPECT_FALSE(r.metrics.has_value());
  infer::run_inference(s.world, cpu_o);
  const Output cpu = read_output(s.world, cpu_o.output, kRows, kClasses, 0);
  const Output gpu = read_output(s.world, gpu_o.output, kRows, kClasses, 0);
  double worst = 0, scale = 0;
  for (std::size_t i = 0; i < cpu.scores.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(gpu.scores[i]) - cpu.scores[i]));
    scale = std::max(scale, static_cast<double>(std::abs(cpu.scores[i])));
  }
  EXPECT_LE(worst, 1e-5 * std::max(scale, 1.0)) << "raw outputs vs the CPU's";
}
