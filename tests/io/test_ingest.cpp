// run_ingest with units of work: the dataset's rows and its statistics are the same bits at every
// rank count, under the static and the dynamic schedule and with a slowed rank whose unit is
// re-run (speculation shown in the per-rank counts), a re-run unit counts once, errors and gate
// messages number lines and rows over all units, appends and gzip IDX inputs cut into units.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "locus/io/dataset_file.hpp"
#include "locus/io/ingest.hpp"
#include "dataset_read_back.hpp"
#include "sources_test_util.hpp"

using namespace locus;
using test::ReadBack;
using test::read_back;

namespace {

constexpr int kCols = 5;
constexpr std::uint64_t kUnitBytes = 700;  // ~14 lines: about 40 units for 600 rows

// A CSV held in memory as the reference sees it: rows, labels and each line's unit.
struct Csv {
  std::string text;
  std::vector<float> x;             // rows × kCols
  std::vector<std::int32_t> y;
  std::vector<std::int64_t> unit;   // of each row
  std::int64_t units = 0;
};

Csv make_csv(int rows, std::uint64_t unit_bytes, int first_value = 0) {
  Csv c;
  const std::string header = "a,b,c,d,e,y\n";
  c.text = header;
  for (int r = 0; r < rows; ++r) {
    const std::uint64_t start = c.text.size() - header.size();
    std::string line;
    for (int f = 0; f < kCols; ++f) {
      // Spread and offset differ per feature, so the merge order shows in the low bits.
      const double v = (f + 1) * 1000.0 + std::sin(0.37 * (r + first_value) * (f + 1)) * (f + 0.5);
      line += fmt::format("{:.6g},", v);
      c.x.push_back(std::strtof(fmt::format("{:.6g}", v).c_str(), nullptr));
    }
    c.y.push_back((r + first_value) % 3);
    line += fmt::format("{}\n", c.y.back());
    c.text += line;
    c.unit.push_back(static_cast<std::int64_t>(start / unit_bytes));
  }
  const std::uint64_t data = c.text.size() - header.size();
  c.units = static_cast<std::int64_t>(std::max<std::uint64_t>(1, (data + unit_bytes - 1) / unit_bytes));
  return c;
}

// The statistics a serial reader gets merging unit by unit, in unit order.
io::FeatureStats unit_order_stats(const Csv& c) {
  io::FeatureStats acc = io::row_stats({}, kCols);
  std::size_t r = 0;
  for (std::int64_t u = 0; u < c.units; ++u) {
    const std::size_t first = r;
    while (r < c.unit.size() && c.unit[r] == u) ++r;
    const std::span<const float> rows(c.x.data() + first * kCols, (r - first) * kCols);
    acc = io::merge(acc, io::row_stats(rows, kCols));
  }
  return acc;
}

io::IngestOptions csv_options(const std::string& csv, const std::string& out) {
  io::IngestOptions o;
  o.source = io::IngestOptions::Source::csv;
  o.csv.path = csv;
  o.csv.label_column = "y";
  o.output = out;
  o.report = out + ".gates.json";
  o.overwrite = true;
  o.unit_bytes = kUnitBytes;
  return o;
}

void expect_bitwise(const std::vector<double>& a, const std::vector<double>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::bit_cast<std::uint64_t>(a[i]), std::bit_cast<std::uint64_t>(b[i]))
        << what << "[" << i << "] " << a[i] << " vs " << b[i];
}

void expect_stats(const io::FeatureStats& got, const io::FeatureStats& want) {
  EXPECT_EQ(got.count, want.count) << "a unit counted twice or not at all";
  expect_bitwise(got.mean, want.mean, "mean");
  expect_bitwise(got.m2, want.m2, "m2");
  expect_bitwise(got.min, want.min, "min");
  expect_bitwise(got.max, want.max, "max");
}

std::int64_t sum(const std::vector<io::IngestRankStats>& v, std::int64_t io::IngestRankStats::*f) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0},
                         [&](std::int64_t s, const io::IngestRankStats& r) { return s + r.*f; });
}

// The start of data row `row` (after the header line) in a CSV text.
std::size_t row_start(const std::string& text, int row) {
  std::size_t at = 0;
  for (int line = 0; line <= row; ++line) at = text.find('\n', at) + 1;
  return at;
}

// Replaces the first field of data row `row`.
void set_first_field(std::string& text, int row, const std::string& value) {
  const std::size_t at = row_start(text, row);
  text.replace(at, text.find(',', at) - at, value);
}

// Runs with LOCUS_TEST_HOOK set to `hook` on every rank ("" clears it).
io::IngestResult ingest_with_hook(const mpi::Comm& comm, const io::IngestOptions& o,
                                  const std::string& hook) {
  if (hook.empty()) {
    ::unsetenv("LOCUS_TEST_HOOK");
  } else {
    ::setenv("LOCUS_TEST_HOOK", hook.c_str(), 1);
  }
  io::IngestResult r = io::run_ingest(comm, o);
  ::unsetenv("LOCUS_TEST_HOOK");
  return r;
}

}  // namespace

TEST(IngestUnits, SameRowsAndStatisticsAtEveryRankCountAndSchedule) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Csv c = make_csv(600, kUnitBytes);
  test::write_shared(world, dir.file("in.csv"), c.text);
  const io::FeatureStats want = unit_order_stats(c);
  std::vector<std::int64_t> hist;
  for (const auto schedule : {comm::Schedule::dynamic, comm::Schedule::static_blocks}) {
    io::IngestOptions o = csv_options(dir.file("in.csv"), dir.file("out.h5"));
    o.schedule = schedule;
    const io::IngestResult r = io::run_ingest(world, o);
    const io::IngestSchedule& s = r.schedule;
    EXPECT_EQ(s.units, c.units);
    ASSERT_EQ(s.per_rank.size(), static_cast<std::size_t>(world.size()));
    EXPECT_EQ(sum(s.per_rank, &io::IngestRankStats::won), c.units);
    EXPECT_EQ(sum(s.per_rank, &io::IngestRankStats::rows), 600);
    if (schedule == comm::Schedule::static_blocks) {
      EXPECT_EQ(sum(s.per_rank, &io::IngestRankStats::reruns), 0);
      EXPECT_FALSE(s.speculate);
    }
    const ReadBack b = read_back(world, o.output);
    ASSERT_EQ(b.meta.rows, 600);
    EXPECT_EQ(b.rows.features, c.x) << "rows out of place or altered";
    EXPECT_EQ(b.rows.labels, c.y);
    expect_stats(b.meta.stats, want);
    if (hist.empty()) hist = b.meta.histogram.counts;
    EXPECT_EQ(b.meta.histogram.counts, hist);
  }
}

TEST(IngestUnits, SlowRanksUnitIsRerunAndCountedOnce) {
  mpi::Comm world = mpi::Comm::world();
  if (world.size() < 2) GTEST_SKIP() << "needs a slow rank and a faster one";
  test::SharedTempDir dir(world);
  const Csv c = make_csv(600, kUnitBytes);
  test::write_shared(world, dir.file("in.csv"), c.text);
  io::IngestOptions o = csv_options(dir.file("in.csv"), dir.file("out.h5"));
  // Rank 1 would take 20 s per unit: the others finish every other unit, re-run the one it
  // holds, win it, and rank 1 drops its run. A rank descheduled past the whole drain claims
  // nothing: then try again (the claim is what this test needs).
  io::IngestResult r;
  for (int attempt = 0; attempt < 4; ++attempt) {
    r = ingest_with_hook(world, o, "ingest-unit:delay20000@1");
    if (r.schedule.per_rank[1].claimed > 0) break;
  }
  const auto& ranks = r.schedule.per_rank;
  ASSERT_GT(ranks[1].claimed, 0) << "rank 1 never got a unit in 4 attempts";
  EXPECT_EQ(ranks[1].won, 0) << "the slow rank's unit must be won by a re-run";
  EXPECT_GE(ranks[1].abandoned, 1);
  EXPECT_GE(sum(ranks, &io::IngestRankStats::reruns), 1);
  EXPECT_GE(sum(ranks, &io::IngestRankStats::rerun_wins), 1);
  EXPECT_EQ(sum(ranks, &io::IngestRankStats::won), c.units) << "every unit kept exactly once";
  const ReadBack b = read_back(world, o.output);
  EXPECT_EQ(b.rows.features, c.x);
  expect_stats(b.meta.stats, unit_order_stats(c));

  // Without speculation nobody re-runs: the slow rank keeps what it claimed.
  o.speculate = false;
  r = ingest_with_hook(world, o, "ingest-unit:delay200@1");
  EXPECT_EQ(sum(r.schedule.per_rank, &io::IngestRankStats::reruns), 0);
  EXPECT_EQ(r.schedule.per_rank[1].won, r.schedule.per_rank[1].claimed);
  expect_stats(read_back(world, o.output).meta.stats, unit_order_stats(c));
}

TEST(IngestUnits, ErrorsAndGatesNumberLinesAndRowsOverAllUnits) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  Csv c = make_csv(600, kUnitBytes);
  // Bad values at data rows 436 and 520 (file lines 438 and 522), far into the units: the first
  // is reported, with its line counted over every unit before it.
  auto replace_row = [&](int row, const std::string& with) {
    const std::size_t at = row_start(c.text, row);
    c.text.replace(at, c.text.find('\n', at) - at, with);
  };
  replace_row(520, "1,2,3,4,zebra,1");
  replace_row(436, "1,2,3,4,lion,1");
  test::write_shared(world, dir.file("bad.csv"), c.text);
  io::IngestOptions o = csv_options(dir.file("bad.csv"), dir.file("bad.h5"));
  const std::string msg =
      test::expect_agreed_error<DataError>(world, [&] { io::run_ingest(world, o); });
  test::expect_contains(msg, "line 438");
  test::expect_contains(msg, "lion");

  // A label out of range at data row 299: the gate names global row 299.
  Csv g = make_csv(600, kUnitBytes);
  std::string text = g.text;
  text.replace(row_start(text, 300) - 2, 1, "7");  // data row 299's label, before its newline
  test::write_shared(world, dir.file("gate.csv"), text);
  o = csv_options(dir.file("gate.csv"), dir.file("gate.h5"));
  o.num_classes = 3;
  const std::string gate =
      test::expect_agreed_error<GateError>(world, [&] { io::run_ingest(world, o); });
  test::expect_contains(gate, "first at global row 299 with label 7");
}

TEST(IngestUnits, DroppedRowsAndAppendsKeepUnitOrder) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Csv first = make_csv(400, kUnitBytes);
  const Csv more = make_csv(200, kUnitBytes, 400);
  std::string text = more.text;
  // Non-finite values in two rows of the appended part (rows 50 and 151): dropped.
  set_first_field(text, 151, "-inf");
  set_first_field(text, 50, "nan");
  std::vector<float> want_x = first.x;
  std::vector<std::int32_t> want_y = first.y;
  for (int r = 0; r < 200; ++r) {
    if (r == 50 || r == 151) continue;
    want_x.insert(want_x.end(), more.x.begin() + r * kCols, more.x.begin() + (r + 1) * kCols);
    want_y.push_back(more.y[static_cast<std::size_t>(r)]);
  }
  test::write_shared(world, dir.file("a.csv"), first.text);
  test::write_shared(world, dir.file("b.csv"), text);
  io::IngestOptions o = csv_options(dir.file("a.csv"), dir.file("out.h5"));
  io::run_ingest(world, o);
  o = csv_options(dir.file("b.csv"), dir.file("out.h5"));
  o.overwrite = false;
  o.append = true;
  o.gates.drop_nonfinite = true;
  const io::IngestResult r = ingest_with_hook(world, o, "ingest-unit:delay50@0");
  EXPECT_EQ(r.report.dropped_rows, 2);
  const ReadBack b = read_back(world, o.output);
  ASSERT_EQ(b.meta.rows, 598);
  EXPECT_EQ(b.rows.features, want_x) << "appended units out of place";
  EXPECT_EQ(b.rows.labels, want_y);
  EXPECT_EQ(b.meta.stats.count, 598);
}

TEST(IngestUnits, GzipIdxUnitsMatchTheRecords) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  constexpr std::uint32_t n = 300, side = 3;
  std::string images{'\0', '\0', '\x08', '\x03'}, labels{'\0', '\0', '\x08', '\x01'};
  auto be32 = [](std::string& s, std::uint32_t v) {
    for (int k = 3; k >= 0; --k) s.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
  };
  be32(images, n), be32(images, side), be32(images, side), be32(labels, n);
  std::vector<float> want;
  for (std::uint32_t i = 0; i < n * side * side; ++i) {
    images.push_back(static_cast<char>((i * 37 + i / 9) & 0xff));
    want.push_back(static_cast<float>(static_cast<unsigned char>(images.back())));
  }
  for (std::uint32_t i = 0; i < n; ++i) labels.push_back(static_cast<char>(i % 10));
  test::write_shared(world, dir.file("img.gz"), images, /*gzip=*/true);
  test::write_shared(world, dir.file("lbl.gz"), labels, /*gzip=*/true);
  io::IngestOptions o;
  o.idx = {dir.file("img.gz"), dir.file("lbl.gz")};
  o.output = dir.file("out.h5");
  o.overwrite = true;
  o.unit_bytes = 7 * side * side;  // 7 records per unit: 43 units
  // Rank 1 slowed: its unit is re-run by a rank whose gzip stream has moved past it (reopened).
  const io::IngestResult r =
      ingest_with_hook(world, o, world.size() > 1 ? "ingest-unit:delay20000@1" : "");
  EXPECT_EQ(r.schedule.units, 43);
  const ReadBack b = read_back(world, o.output);
  EXPECT_EQ(b.rows.features, want);
  ASSERT_EQ(b.rows.labels.size(), n);
  for (std::uint32_t i = 0; i < n; ++i) EXPECT_EQ(b.rows.labels[i], static_cast<int>(i % 10));
}
