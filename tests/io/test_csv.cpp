// read_csv: every rank's rows, concatenated in rank order, equal the values the test wrote
// (parsed back with strtof, independently of the library) and a serial read_csv; formats
// (CRLF, BOM, quotes, blank lines, nan/inf), long lines and fewer rows than ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "locus/io/csv.hpp"
#include "sources_test_util.hpp"

using namespace locus;

namespace {

struct Expected {
  std::vector<float> features;  // row-major, as the library must return them
  std::vector<std::int32_t> labels;
};

bool same(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  return std::memcmp(&a, &b, sizeof a) == 0;  // also tells -0 from +0
}

// This rank's rows must be rows [offset, offset + rows) of the reference, in order.
void expect_share(const mpi::Comm& comm, const io::Table& t, const Expected& e, std::int64_t d) {
  ASSERT_EQ(t.cols, d);
  const auto n = static_cast<std::int64_t>(e.features.size()) / d;
  const std::int64_t offset = comm.exscan_sum(t.rows());
  ASSERT_EQ(comm.allreduce<std::int64_t>(t.rows(), MPI_SUM), n);
  ASSERT_LE(offset + t.rows(), n);
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < t.rows() * d; ++i)
    if (!same(t.features[i], e.features[offset * d + i]) && bad++ < 5)
      ADD_FAILURE() << "rank " << comm.rank() << " value " << i << ": " << t.features[i]
                    << " != " << e.features[offset * d + i];
  EXPECT_EQ(bad, 0);
  if (!e.labels.empty()) {
    ASSERT_TRUE(t.has_labels);
    ASSERT_EQ(t.labels.size(), static_cast<std::size_t>(t.rows()));
    for (std::int64_t r = 0; r < t.rows(); ++r) EXPECT_EQ(t.labels[r], e.labels[offset + r]);
  }
}

// One random number as text (random length and notation, sometimes padded or signed) and the
// float it must parse to, by strtof.
std::string random_value(std::mt19937& rng, float& value) {
  const int kind = static_cast<int>(rng() % 40);
  std::string text;
  if (kind == 0) {
    const char* specials[] = {"nan", "NaN", "inf", "-inf", "INF", "-Infinity"};
    text = specials[rng() % 6];
  } else {
    const double v = std::ldexp(static_cast<double>(rng()) / 4294967296.0 - 0.5,
                                static_cast<int>(rng() % 40) - 20);
    const int precision = 1 + static_cast<int>(rng() % 9);
    const char* fmts[] = {"%.*g", "%.*e", "%.*f"};
    char buf[64];
    std::snprintf(buf, sizeof buf, fmts[rng() % 3], precision, v);
    text = buf;
    if (kind == 1 && text[0] != '-') text = "+" + text;
  }
  value = std::strtof(text.c_str(), nullptr);
  if (kind == 2) text = "  " + text + " ";
  return text;
}

// A CSV of rows with columns id (text), a, b, c, label; the reference holds a and c, or all
// of a, b, c, depending on all_numeric (then id is left out of the file).
std::string random_csv(int rows, bool all_numeric, Expected& e, unsigned seed) {
  std::mt19937 rng(seed);
  std::string out = all_numeric ? "a,b,c,label\n" : "id,a,b,c,label\n";
  for (int r = 0; r < rows; ++r) {
    float v[3];
    std::string cells[3];
    for (int c = 0; c < 3; ++c) cells[c] = random_value(rng, v[c]);
    const auto label = static_cast<std::int32_t>(rng() % 2001) - 1000;
    if (!all_numeric) out += "row" + std::to_string(r) + " x,";
    out += cells[0] + "," + cells[1] + "," + cells[2] + "," + std::to_string(label);
    out += rng() % 5 == 0 ? "\r\n" : "\n";
    if (all_numeric) {
      e.features.insert(e.features.end(), {v[0], v[1], v[2]});
    } else {
      e.features.insert(e.features.end(), {v[2], v[0]});  // feature_columns = {c, a}
    }
    e.labels.push_back(label);
  }
  return out;
}

io::Table serial_read(const io::CsvOptions& opts) {
  return io::read_csv(mpi::Comm::borrow(MPI_COMM_SELF), opts);
}

}  // namespace

TEST(Csv, RandomRowsMatchReferenceAndSerialRead) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  for (bool all_numeric : {true, false}) {
    Expected e;
    const std::string text = random_csv(3000, all_numeric, e, all_numeric ? 7 : 8);
    test::write_shared(world, dir.file("rows.csv"), text);
    io::CsvOptions opts{dir.file("rows.csv"), ',', "label", {}};
    if (!all_numeric) opts.feature_columns = {"c", "a"};
    const io::Table t = io::read_csv(world, opts);
    const std::int64_t d = all_numeric ? 3 : 2;
    expect_share(world, t, e, d);
    EXPECT_EQ(t.label_name, "label");
    const std::vector<std::string> names =
        all_numeric ? std::vector<std::string>{"a", "b", "c"} : std::vector<std::string>{"c", "a"};
    EXPECT_EQ(t.feature_names, names);
    // The serial read by this same library must agree too (row split never changes values).
    const io::Table s = serial_read(opts);
    Expected serial{s.features, s.labels};
    expect_share(world, t, serial, d);
  }
}

TEST(Csv, NoLabelsAndOtherDelimiters) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("t.tsv"), "x\ty\n1\t2\n3\t4\n5\t6\n");
  io::Table t = io::read_csv(world, {dir.file("t.tsv"), '\t', "", {}});
  EXPECT_FALSE(t.has_labels);
  EXPECT_TRUE(t.labels.empty());
  expect_share(world, t, {{1, 2, 3, 4, 5, 6}, {}}, 2);
  test::write_shared(world, dir.file("t.ssv"), "x;y\n1;2\n3;4\n");
  expect_share(world, io::read_csv(world, {dir.file("t.ssv"), ';', "y", {}}), {{1, 3}, {2, 4}},
               1);
}

TEST(Csv, FormatsCrLfBomQuotesBlankLinesSpecialValues) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const std::string text =
      "\xEF\xBB\xBF\"f 1\", \"f2\" ,lab\r\n"
      "nan,INF,1\r\n"
      "\r\n"
      "-inf,+1.5,2\r\n"
      "  \t \n"
      "-0, \"7e-3\" ,+3\r\n"
      "1e-45,3.4028235e38,-4\r\n"
      "\n\n\r\n";
  test::write_shared(world, dir.file("f.csv"), text);
  const io::Table t = io::read_csv(world, {dir.file("f.csv"), ',', "lab", {}});
  const float inf = std::numeric_limits<float>::infinity();
  expect_share(world, t,
               {{std::nanf(""), inf, -inf, 1.5f, -0.0f, 7e-3f, 1e-45f, 3.4028235e38f},
                {1, 2, 3, -4}},
               2);
  EXPECT_EQ(t.feature_names, (std::vector<std::string>{"f 1", "f2"}));
  // Underflow to zero is accepted; no trailing newline at the end of the file.
  test::write_shared(world, dir.file("u.csv"), "a,b\n1e-50,2\n3,4");
  expect_share(world, io::read_csv(world, {dir.file("u.csv"), ',', "", {}}), {{0, 2, 3, 4}, {}},
               2);
}

TEST(Csv, FewerRowsThanRanks) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  for (std::string text : {"x,y\n1,2\n3,4", "x,y\n1,2\n3,4\n", "x,y\n1,2\n"}) {
    test::write_shared(world, dir.file("tiny.csv"), text);
    const io::Table t = io::read_csv(world, {dir.file("tiny.csv"), ',', "y", {}});
    EXPECT_EQ(t.cols, 1);
    if (text.size() > 10) {
      expect_share(world, t, {{1, 3}, {2, 4}}, 1);
    } else {
      expect_share(world, t, {{1}, {2}}, 1);
    }
  }
}

TEST(Csv, LinesLongerThanTheReadBuffer) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const int cols = 150000;  // about 1.3 MB per line, more than the 1 MiB read buffer
  std::string text;
  Expected e;
  for (int c = 0; c < cols; ++c) text += (c ? ",c" : "c") + std::to_string(c);
  text += "\n";
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < cols; ++c) {
      const int v = (r * 7919 + c * 31) % 100000;
      text += (c ? "," : "") + std::to_string(v) + ".5";
      e.features.push_back(static_cast<float>(v) + 0.5f);
    }
    text += "\n";
  }
  test::write_shared(world, dir.file("wide.csv"), text);
  const io::Table t = io::read_csv(world, {dir.file("wide.csv"), ',', "", {}});
  expect_share(world, t, e, cols);
  EXPECT_EQ(t.feature_names.back(), "c" + std::to_string(cols - 1));
}
