// run_inference at 1, 2 and 4 ranks against a serial scorer on the same batch grid: the output
// is bit-identical whatever the world size, speculation or stragglers; metrics match; an
// incremental run after an append equals a full run.
#include <gtest/gtest.h>
#include <hdf5.h>

#include <cmath>
#include <cstring>
#include <numeric>

#include <fmt/format.h>

#include "locus/infer/infer.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/dataset_file.hpp"
#include "locus/io/json.hpp"
#include "locus/train/model/model_file.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;

namespace {

constexpr int kCols = 20, kClasses = 6;

float feature(std::uint64_t row, int col) {
  const std::uint64_t h = (row * 2654435761u + static_cast<std::uint64_t>(col) * 40503u) % 1009u;
  return static_cast<float>(h) / 504.5f - 1.0f;
}
std::int32_t label(std::uint64_t row) { return static_cast<std::int32_t>((row * 7u) % kClasses); }

// This rank's share of rows [begin, end) as a Table.
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

Output read_output(const mpi::Comm& world, const std::string& path, std::uint64_t rows, int k) {
  h5::File f = h5::File::open(world, path, h5::File::Mode::read);
  Output o;
  o.scores.resize(rows * kClasses);
  o.predicted.resize(rows);
  o.topk.resize(rows * static_cast<std::uint64_t>(k));
  o.topk_scores.resize(rows * static_cast<std::uint64_t>(k));
  o.writer.resize(rows);
  h5::Dataset::open(f, "/scores").read_rows<float>(0, o.scores);
  h5::Dataset::open(f, "/predicted").read_rows<std::int32_t>(0, o.predicted);
  h5::Dataset::open(f, "/topk_classes").read_rows<std::int32_t>(0, o.topk);
  h5::Dataset::open(f, "/topk_scores").read_rows<float>(0, o.topk_scores);
  h5::Dataset::open(f, "/writer").read_rows<std::int32_t>(0, o.writer);
  f.close();
  return o;
}

template <class T> bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// The serial reference: every unit of the grid scored on its own by one scorer.
infer::Scores reference(const train::Mlp& model, std::uint64_t rows, std::uint64_t unit, int batch,
                        int k) {
  infer::Scorer scorer(model, {.kind = infer::OutputKind::probabilities, .top_k = k,
                               .batch_rows = batch});
  infer::Scores all;
  all.metrics.reset(kClasses);
  for (std::uint64_t lo = 0; lo < rows; lo += unit) {
    const std::uint64_t hi = std::min(rows, lo + unit);
    std::vector<float> x;
    std::vector<std::int32_t> y;
    for (std::uint64_t r = lo; r < hi; ++r) {
      for (int c = 0; c < kCols; ++c) x.push_back(feature(r, c));
      y.push_back(label(r));
    }
    infer::Scores s;
    EXPECT_TRUE(scorer.score(lo, lo, x, y, s));
    all.values.insert(all.values.end(), s.values.begin(), s.values.end());
    all.predicted.insert(all.predicted.end(), s.predicted.begin(), s.predicted.end());
    all.topk_index.insert(all.topk_index.end(), s.topk_index.begin(), s.topk_index.end());
    all.topk_value.insert(all.topk_value.end(), s.topk_value.begin(), s.topk_value.end());
    all.metrics.merge(s.metrics);
  }
  return all;
}

struct Job {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir{world};
  train::Mlp model{train::ModelSpec{.widths = {kCols, 24, kClasses}, .seed = 11}};
  std::string model_path = dir.file("model.h5");
  std::string data_path = dir.file("data.h5");

  Job() {
    train::ModelInfo info;
    info.num_classes = kClasses;
    train::write_model_file(world, model_path, model, info);
  }
  infer::InferOptions options(const std::string& out) const {
    infer::InferOptions o;
    o.model = model_path;
    o.input = data_path;
    o.output = out;
    o.top_k = 3;
    o.batch_rows = 32;
    o.unit_rows = 150;
    o.record_writer = true;
    return o;
  }
};

void expect_matches_reference(const Job& s, const std::string& out, std::uint64_t rows,
                              const infer::InferResult& r) {
  ASSERT_EQ(r.row_end, rows);
  const infer::Scores ref = reference(s.model, rows, 150, 32, 3);
  const Output o = read_output(s.world, out, rows, 3);
  EXPECT_TRUE(same_bytes(o.scores, ref.values)) << "scores differ from the serial scorer";
  EXPECT_TRUE(same_bytes(o.predicted, ref.predicted));
  EXPECT_TRUE(same_bytes(o.topk, ref.topk_index));
  EXPECT_TRUE(same_bytes(o.topk_scores, ref.topk_value));
  std::vector<std::int64_t> per_rank(static_cast<std::size_t>(s.world.size()), 0);
  for (std::int32_t w : o.writer) {
    ASSERT_GE(w, 0) << "a row was never written";
    ASSERT_LT(w, s.world.size());
    ++per_rank[static_cast<std::size_t>(w)];
  }
  for (int i = 0; i < s.world.size(); ++i)
    EXPECT_EQ(per_rank[static_cast<std::size_t>(i)], r.ranks[static_cast<std::size_t>(i)].rows);
  EXPECT_EQ(r.units_written_once, r.units);
  ASSERT_TRUE(r.metrics.has_value());
  EXPECT_EQ(r.metrics->rows, static_cast<std::int64_t>(rows));
  EXPECT_EQ(r.metrics->correct, ref.metrics.correct);
  EXPECT_EQ(r.metrics->confusion, ref.metrics.confusion);
  EXPECT_NEAR(r.metrics->log_loss_sum, ref.metrics.log_loss_sum, 1e-9 * rows);
}

}  // namespace

TEST(Infer, OutputEqualsSerialScorerWithAndWithoutSpeculation) {
  Job s;
  write_data(s.world, s.data_path, 2000);
  for (int mode : {0, 1, 2}) {  // dynamic with and without speculation, static blocks
    infer::InferOptions o = s.options(s.dir.file(fmt::format("mode{}.h5", mode)));
    o.speculate = mode == 0;
    if (mode == 2) o.schedule = infer::Schedule::static_blocks;
    const infer::InferResult r = infer::run_inference(s.world, o);
    EXPECT_EQ(r.units, 14);
    if (mode != 0) {
      EXPECT_EQ(r.speculative_runs, 0);
    }
    if (mode == 2) {  // rank i scored exactly the rows of its block of units
      for (int i = 0; i < s.world.size(); ++i) {
        const auto block = h5::partition_rows(14, i, s.world.size());
        const auto rows = std::min<std::uint64_t>(block.end() * 150, 2000) -
                          std::min<std::uint64_t>(block.begin * 150, 2000);
        EXPECT_EQ(r.ranks[static_cast<std::size_t>(i)].rows, static_cast<std::int64_t>(rows));
      }
    }
    expect_matches_reference(s, o.output, 2000, r);
  }
}

TEST(Infer, SlowRankIsOvertakenAndOutputIsUnchanged) {
  Job s;
  if (s.world.size() < 2) GTEST_SKIP() << "needs a slow and a fast rank";
  write_data(s.world, s.data_path, 6000);
  infer::InferOptions o = s.options(s.dir.file("slow.h5"));
  o.slow_ranks = {s.world.size() - 1};
  // 10 s before each unit it claims, but cut short once another rank finishes that unit: the
  // fast ranks have all the time they need to drain the queue and overtake it, however slow
  // the machine (at 300 ms they sometimes had not), and a passing run takes no longer.
  o.slow_ms = 10000;
  o.overwrite = true;
  // On a loaded machine the fast ranks may drain every unit before the slow rank is scheduled
  // at all; such a run proves nothing, so try again (a few times at most).
  bool exercised = false;
  for (int attempt = 0; attempt < 5 && !exercised; ++attempt) {
    const infer::InferResult r = infer::run_inference(s.world, o);
    expect_matches_reference(s, o.output, 6000, r);
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

TEST(Infer, IncrementalAfterAppendEqualsFullRun) {
  Job s;
  write_data(s.world, s.data_path, 1234);
  infer::InferOptions o = s.options(s.dir.file("inc.h5"));
  infer::run_inference(s.world, o);
  append_data(s.world, s.data_path, 1234, 2000);
  o.incremental = true;
  const infer::InferResult r = infer::run_inference(s.world, o);
  EXPECT_TRUE(r.incremental);
  EXPECT_EQ(r.row_begin, 1234u);
  EXPECT_EQ(r.row_end, 2000u);
  EXPECT_EQ(r.metrics->rows, 2000 - 1234) << "metrics cover the rows of this run";
  const infer::Scores ref = reference(s.model, 2000, 150, 32, 3);
  const Output out = read_output(s.world, o.output, 2000, 3);
  EXPECT_TRUE(same_bytes(out.scores, ref.values)) << "incremental output differs from a full run";
  EXPECT_TRUE(same_bytes(out.topk, ref.topk_index));
  for (std::int32_t w : out.writer) ASSERT_GE(w, 0);
}

TEST(Infer, StripedReadsGiveTheSameBytes) {
  // Each rank reads its units read_rows at a time into the compute thread's ring: one batch per
  // stripe (32), a size rounded up to whole batches (50 -> 64), two stripes whose second is
  // short (128 of 150), whole units (0) -- with and without speculation, by 1 reading thread
  // (H5Dread: small chunks) or 3 (pread of the 50-row chunks), and an incremental run whose
  // first unit starts mid-stripe. Every row is written once and equals the serial scorer.
  Job s;
  write_data(s.world, s.data_path, 1234);
  for (std::uint64_t read_rows : {32u, 50u, 128u, 0u}) {
    for (bool speculate : {true, false}) {
      infer::InferOptions o = s.options(s.dir.file(fmt::format("r{}{}.h5", read_rows, speculate)));
      o.read_rows = read_rows;
      o.speculate = speculate;
      o.read_threads = read_rows >= 128 ? 3 : 0;  // 0: 1 thread on the cpu backend
      const infer::InferResult r = infer::run_inference(s.world, o);
      expect_matches_reference(s, o.output, 1234, r);
      EXPECT_EQ(r.read, read_rows >= 128 ? "pread, 3 threads (chunks of 50 rows)"
                                         : "H5Dread (one thread, chunks below 4 MiB)");
    }
  }
  append_data(s.world, s.data_path, 1234, 2000);
  infer::InferOptions o = s.options(s.dir.file("r32true.h5"));
  o.read_rows = 32;
  o.incremental = true;
  const infer::InferResult r = infer::run_inference(s.world, o);
  EXPECT_EQ(r.row_begin, 1234u);
  const infer::Scores ref = reference(s.model, 2000, 150, 32, 3);
  const Output out = read_output(s.world, o.output, 2000, 3);
  EXPECT_TRUE(same_bytes(out.scores, ref.values)) << "striped incremental run differs";
  EXPECT_TRUE(same_bytes(out.topk, ref.topk_index));
  for (std::int32_t w : out.writer) ASSERT_GE(w, 0);
}

TEST(Infer, BadRequestsAreAgreedErrors) {
  Job s;
  write_data(s.world, s.data_path, 100);
  infer::InferOptions o = s.options(s.dir.file("out.h5"));
  infer::run_inference(s.world, o);
  EXPECT_THROW(infer::run_inference(s.world, o), ConfigError);  // exists
  o.overwrite = true;
  o.top_k = kClasses + 1;
  EXPECT_THROW(infer::run_inference(s.world, o), ConfigError);
  o.top_k = 1;
  o.read_threads = 65;
  EXPECT_THROW(infer::run_inference(s.world, o), ConfigError);
  o.read_threads = 0;
  o.features = "/nope";
  EXPECT_THROW(infer::run_inference(s.world, o), DataError);
  o.features = "/features";
  train::Mlp wide(train::ModelSpec{.widths = {kCols + 1, 4, kClasses}});
  train::write_model_file(s.world, s.dir.file("wide.h5"), wide, {});
  o.model = s.dir.file("wide.h5");
  try {
    infer::run_inference(s.world, o);
    ADD_FAILURE() << "a feature-width mismatch must fail";
  } catch (const DataError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("feature-width mismatch"), std::string::npos) << e.what();
  }
}

// report_json on its own (no run): the members in the order docs/FORMATS.md shows, the
// confusion matrix as rows of true classes, null metrics without labels, and valid JSON for a
// path that is not UTF-8.
TEST(Infer, ReportMembersInDocumentedOrder) {
  infer::InferOptions opts;
  opts.output = "out/caf\xe9.h5";  // Latin-1: becomes U+FFFD
  opts.model = "m.h5";
  opts.input = "in.h5";
  infer::InferResult r;
  r.row_begin = 0;
  r.row_end = 8;
  r.features = 3;
  r.outputs = 2;
  r.top_k = 1;
  r.unit_rows = 4;
  r.batch_rows = 2;
  r.units = r.units_written_once = 2;
  r.ranks.resize(2);
  r.ranks[1].speculative_wins = 1;
  r.seconds = 0.5;
  infer::Metrics m;
  m.reset(2);
  m.rows = 8;
  m.correct = 7;
  m.log_loss_sum = 2.0;
  m.confusion = {3, 1, 0, 4};
  r.metrics = m;

  const std::string text = infer::report_json(opts, r);
  io::Json j;
  ASSERT_NO_THROW(j = io::Json::parse(text)) << text;  // strict UTF-8
  std::vector<std::string> keys;
  for (const auto& [k, v] : j.items()) keys.push_back(k);
  const std::vector<std::string> want = {
      "output", "model", "input", "features", "mode", "row_begin", "row_end", "rows_scored",
      "features_per_row", "outputs", "kind", "top_k", "ranks", "compute", "read", "unit_rows",
      "batch_rows",
      "units", "units_written_once", "schedule", "speculation", "speculative_runs",
      "speculative_wins", "seconds", "seconds_durable", "seconds_init", "seconds_total",
      "rows_per_second",
      "per_rank", "metrics"};
  EXPECT_EQ(keys, want);
  EXPECT_EQ(j["output"], "out/caf\xEF\xBF\xBD.h5");
  EXPECT_EQ(j["rows_scored"], 8);
  EXPECT_EQ(j["speculative_wins"], 1);
  EXPECT_EQ(j["rows_per_second"].get<double>(), 16.0);
  EXPECT_NE(text.find("\"rows_per_second\": 16.0,\n"), std::string::npos) << text;
  ASSERT_EQ(j["per_rank"].size(), 2u);
  EXPECT_EQ(j["per_rank"][1]["rank"], 1);
  EXPECT_EQ(j["per_rank"][1].begin().key(), "rank");
  EXPECT_EQ(j["metrics"]["accuracy"].get<double>(), 7.0 / 8.0);
  EXPECT_EQ(j["metrics"]["log_loss"].get<double>(), 0.25);
  EXPECT_EQ(j["metrics"]["confusion"], io::Json::parse("[[3,1],[0,4]]"));

  r.metrics.reset();
  EXPECT_TRUE(io::Json::parse(infer::report_json(opts, r))["metrics"].is_null());
}

// Found while writing tests/fuzz/fuzz_prediction_meta (its regression input reproduces it): a
// prediction file whose num_outputs and /scores width were edited, the model fingerprint still
// matching, was extended with rows of the model's width cut at the file's width: an internal
// assertion (MPI_Abort) on the row count. Now a DataError naming both widths.
TEST(Infer, IncrementalRefusesAFileOfAnotherOutputWidth) {
  Job s;
  write_data(s.world, s.data_path, 300);
  infer::InferOptions o = s.options(s.dir.file("out.h5"));
  infer::run_inference(s.world, o);
  // Rank 0 damages the file with serial HDF5; every rank learns whether that worked.
  auto damage = [&] {
    h5::Id f(H5Fopen(o.output.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    if (!f || H5Ldelete(f.get(), "/scores", H5P_DEFAULT) < 0) return false;
    const hsize_t dims[2] = {300, kClasses - 1};
    h5::Id space(H5Screate_simple(2, dims, nullptr));
    h5::Id d(H5Dcreate2(f.get(), "/scores", H5T_IEEE_F32LE, space.get(), H5P_DEFAULT,
                        H5P_DEFAULT, H5P_DEFAULT));
    h5::write_attr(f.get(), "num_outputs", std::int64_t{kClasses - 1});
    h5::write_attr(f.get(), "committed_rows", std::int64_t{100});
    return static_cast<bool>(d);
  };
  const int damaged = s.world.allreduce(s.world.is_root() ? static_cast<int>(damage()) : 1, MPI_MIN);
  ASSERT_EQ(damaged, 1) << "rank 0 could not edit the prediction file";
  o.incremental = true;
  try {
    infer::run_inference(s.world, o);
    ADD_FAILURE() << "a file of another output width must be refused";
  } catch (const DataError& e) {
    EXPECT_TRUE(e.agreed());
    const std::string want = fmt::format("holds {} outputs per row but model", kClasses - 1);
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}
