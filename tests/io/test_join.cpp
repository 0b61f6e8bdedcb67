// ingest.join (join.cpp, the join in csv.cpp's row parse, the join_missing gate): the dimension
// table parsed with keys as text and columns in join_columns order, each of its errors naming the
// file, line, key, column or size; joined ingests against a join done by hand here, at every
// rank count and with a slowed rank; missing keys failing the gate or dropped and counted with
// the rows' places kept; an append of joined parts equal to the joined whole.
#include <gtest/gtest.h>

#include <zlib.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "locus/io/dataset_file.hpp"
#include "locus/io/ingest.hpp"
#include "locus/io/join.hpp"
#include "dataset_read_back.hpp"
#include "sources_test_util.hpp"

using namespace locus;
using test::ReadBack;
using test::read_back;

namespace {

constexpr std::uint64_t kUnitBytes = 600;  // about 20 units for 800 rows

io::JoinOptions join_options(const std::string& path, std::vector<std::string> columns = {}) {
  io::JoinOptions o;
  o.path = path;
  o.key = "id";
  o.columns = std::move(columns);
  return o;
}

// The dimension table of the ingest tests: 60 keys "s<k>", columns p, q, r (r is joined first).
struct Dim {
  std::string text = "q,id,p,r\n";
  std::map<std::string, std::vector<float>> rows;  // key -> {r, p} (join_columns = r,p)
};

Dim make_dim() {
  Dim d;
  for (int k = 0; k < 60; ++k) {
    const float p = static_cast<float>(k) * 0.5f - 7.0f, r = static_cast<float>(k * k) + 0.25f;
    d.text += fmt::format("{},s{},{},{}\n", 1000 + k, k, p, r);
    d.rows[fmt::format("s{}", k)] = {r, p};
  }
  return d;
}

// The large input, key in the middle; `missing` rows get keys the table lacks. The reference
// join: features a, b then r, p of the row's key; rows with a missing key left out.
struct Big {
  std::string text = "a,id,b,y\n";
  std::vector<float> x;  // rows x 4
  std::vector<std::int32_t> y;
  std::int64_t missing = 0;
  std::int64_t first_missing_line = 0;
};

Big make_big(const Dim& dim, int rows, int first = 0, bool with_missing = false) {
  Big g;
  for (int i = first; i < first + rows; ++i) {
    const float a = static_cast<float>(i) * 0.125f, b = -static_cast<float>(i % 17);
    const bool miss = with_missing && i % 53 == 20;
    const std::string key = miss ? fmt::format("s{}x", i) : fmt::format("s{}", (i * 7) % 60);
    g.text += fmt::format("{},{},{},{}\n", a, key, b, i % 3);
    if (miss) {
      if (g.missing++ == 0) g.first_missing_line = i - first + 2;  // line 1 is the header
      continue;
    }
    const std::vector<float>& j = dim.rows.at(key);
    g.x.insert(g.x.end(), {a, b, j[0], j[1]});
    g.y.push_back(i % 3);
  }
  return g;
}

io::IngestOptions joined(const std::string& csv, const std::string& dim, const std::string& out) {
  io::IngestOptions o;
  o.source = io::IngestOptions::Source::csv;
  o.csv.path = csv;
  o.csv.label_column = "y";
  o.join = join_options(dim, {"r", "p"});
  o.output = out;
  o.report = out + ".gates.json";
  o.overwrite = true;
  o.unit_bytes = kUnitBytes;
  return o;
}

std::string parse_error(const std::string& text, const io::JoinOptions& o, bool config = false) {
  try {
    io::JoinTable::parse(text, o);
  } catch (const ConfigError& e) {
    EXPECT_TRUE(config) << e.what();
    return e.what();
  } catch (const DataError& e) {
    EXPECT_FALSE(config) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no error for:\n" << text;
  return {};
}

}  // namespace

TEST(JoinTable, KeysAreTextAndColumnsFollowJoinColumns) {
  const std::string text = "\xEF\xBB\xBFid,p,q,r\r\n7,1,2,3\r\n\n07,4,5,6\n \"x\" ,+7,nan,-1e3";
  const io::JoinTable t = io::JoinTable::parse(text, join_options("d.csv", {"r", "p"}));
  EXPECT_EQ(t.columns(), (std::vector<std::string>{"r", "p"}));
  ASSERT_EQ(t.rows(), 3u);
  const float* seven = t.find("7");
  ASSERT_NE(seven, nullptr);
  EXPECT_EQ(seven[0], 3.0f);
  EXPECT_EQ(seven[1], 1.0f);
  ASSERT_NE(t.find("07"), nullptr);
  EXPECT_EQ(t.find("07")[0], 6.0f);
  EXPECT_EQ(t.find("7.0"), nullptr) << "keys compare as text, not as numbers";
  EXPECT_EQ(t.find(" 7"), nullptr);
  ASSERT_NE(t.find("x"), nullptr) << "keys are trimmed and unquoted as every field";
  EXPECT_EQ(t.find("x")[0], -1000.0f);
  EXPECT_EQ(t.find("x")[1], 7.0f);
  EXPECT_EQ(t.source().bytes, text.size());
  EXPECT_EQ(t.source().crc32,
            static_cast<std::uint32_t>(::crc32(0, reinterpret_cast<const Bytef*>(text.data()),
                                               static_cast<uInt>(text.size()))));
  // No join_columns: every column but the key, in file order (NaN kept: the gates judge it).
  const io::JoinTable all = io::JoinTable::parse(text, join_options("d.csv"));
  EXPECT_EQ(all.columns(), (std::vector<std::string>{"p", "q", "r"}));
  EXPECT_TRUE(std::isnan(all.find("x")[1]));
}

TEST(JoinTable, EveryErrorNamesTheFileLineKeyOrColumn) {
  const io::JoinOptions o = join_options("dim.csv");
  std::string m = parse_error("id,p\na,1\nb,2\na,3\n", o);
  test::expect_contains(m, "'dim.csv' line 4");
  test::expect_contains(m, "key 'a'");
  test::expect_contains(m, "first on line 2");
  m = parse_error("ID,p\na,1\n", o);
  test::expect_contains(m, "'dim.csv' has no column 'id'");
  test::expect_contains(m, "join_key");
  test::expect_contains(m, "did you mean 'ID'?");
  m = parse_error("id,p\na,1\n", join_options("dim.csv", {"p", "pp"}));
  test::expect_contains(m, "no column 'pp'");
  test::expect_contains(m, "join_columns");
  m = parse_error("id,p,name\na,1,x\nb,2,lion\n", o);
  test::expect_contains(m, "'dim.csv' line 2: join column 'name' has value 'x'");
  test::expect_contains(m, "not a number");
  m = parse_error("id,p\na,1\nb,\n", o);
  test::expect_contains(m, "line 3: join column 'p' has value ''");
  m = parse_error("id,p\na,1\nb,2,3\n", o);
  test::expect_contains(m, "line 3: the row has 3 fields but the header has 2");
  m = parse_error("id,p\n,1\n", o);
  test::expect_contains(m, "line 2: the key column 'id' is empty");
  test::expect_contains(parse_error("", o), "'dim.csv' is empty");
  test::expect_contains(parse_error("id,p\n", o), "'dim.csv' has no data rows");
  test::expect_contains(parse_error("id\na\n", o), "has only the key column 'id'");
  test::expect_contains(parse_error("id,p,p\na,1,2\n", o), "column 'p' appears twice");
  test::expect_contains(parse_error("id,p\na,1\n", join_options("dim.csv", {"p", "id"}), true),
                        "ingest.join_columns lists the join key 'id'");
  test::expect_contains(parse_error("id,p\na,1\n", join_options("dim.csv", {"p", "p"}), true),
                        "lists 'p' twice");
}

TEST(JoinTable, LoadedOnceAndTheSameOnEveryRankOrAnAgreedError) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Dim d = make_dim();
  test::write_shared(world, dir.file("dim.csv"), d.text);
  io::JoinOptions o = join_options(dir.file("dim.csv"), {"r", "p"});
  const auto t = io::load_join_table(world, o);
  ASSERT_EQ(t->rows(), 60u);
  for (const auto& [key, want] : d.rows) {
    const float* got = t->find(key);
    ASSERT_NE(got, nullptr) << key;
    EXPECT_EQ(got[0], want[0]) << key;
    EXPECT_EQ(got[1], want[1]) << key;
  }
  EXPECT_EQ(t->source().path, o.path);
  EXPECT_EQ(t->source().crc32, world.allreduce<std::int64_t>(t->source().crc32, MPI_MAX));

  // Too large: refused before any byte is broadcast, naming the file, its size and the key.
  o.max_bytes = 1000;
  std::string m = test::expect_agreed_error<ConfigError>(world, [&] { io::load_join_table(world, o); });
  test::expect_contains(m, dir.file("dim.csv"));
  test::expect_contains(m, fmt::format("is {:.1f} MiB", static_cast<double>(d.text.size()) / (1 << 20)));
  test::expect_contains(m, "raise ingest.join_max_mb");
  o = join_options(dir.file("none.csv"));
  m = test::expect_agreed_error<DataError>(world, [&] { io::load_join_table(world, o); });
  test::expect_contains(m, "none.csv");
  // A parse error is agreed too.
  test::write_shared(world, dir.file("dup.csv"), "id,p\na,1\na,2\n");
  o = join_options(dir.file("dup.csv"));
  m = test::expect_agreed_error<DataError>(world, [&] { io::load_join_table(world, o); });
  test::expect_contains(m, "line 3: key 'a'");
}

TEST(IngestJoin, RowsMatchAJoinByHandAtEveryRankCountAndWithASlowRank) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Dim d = make_dim();
  const Big g = make_big(d, 800);
  test::write_shared(world, dir.file("dim.csv"), d.text);
  test::write_shared(world, dir.file("in.csv"), g.text);
  io::IngestOptions o = joined(dir.file("in.csv"), dir.file("dim.csv"), dir.file("out.h5"));
  for (const char* hook : {"", "ingest-unit:delay30@1"}) {
    if (*hook != 0) ::setenv("LOCUS_TEST_HOOK", hook, 1);
    const io::IngestResult r = io::run_ingest(world, o);
    ::unsetenv("LOCUS_TEST_HOOK");
    EXPECT_GT(r.schedule.units, 15);
    ASSERT_TRUE(r.report.join_missing_rows.has_value());
    EXPECT_EQ(*r.report.join_missing_rows, 0);
    const ReadBack b = read_back(world, o.output);
    ASSERT_EQ(b.meta.rows, 800);
    EXPECT_EQ(b.meta.feature_names, (std::vector<std::string>{"a", "b", "r", "p"}))
        << "the key is no feature; joined columns follow, in join_columns order";
    EXPECT_EQ(b.rows.features, g.x) << "joined values wrong or rows out of place";
    EXPECT_EQ(b.rows.labels, g.y);
    ASSERT_EQ(b.meta.provenance.sources.size(), 2u);
    EXPECT_EQ(b.meta.provenance.sources[1].path, o.join.path);
    EXPECT_EQ(b.meta.provenance.sources[1].bytes, d.text.size());
    EXPECT_EQ(b.meta.stats.count, 800);
  }
}

TEST(IngestJoin, MissingKeysFailTheGateOrAreDroppedAndCounted) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Dim d = make_dim();
  const Big g = make_big(d, 800, 0, /*with_missing=*/true);
  ASSERT_EQ(g.missing, 15);
  test::write_shared(world, dir.file("dim.csv"), d.text);
  test::write_shared(world, dir.file("in.csv"), g.text);
  io::IngestOptions o = joined(dir.file("in.csv"), dir.file("dim.csv"), dir.file("fail.h5"));
  const std::string m =
      test::expect_agreed_error<GateError>(world, [&] { io::run_ingest(world, o); });
  test::expect_contains(m, "gate 'join_missing' failed: 15 rows of");
  test::expect_contains(m, fmt::format("line {}: key 's20x'", g.first_missing_line));
  test::expect_contains(m, "gates.join_missing = drop");
  EXPECT_FALSE(std::filesystem::exists(o.output)) << "a failed gate published the dataset";
  const std::string report = test::slurp(o.report);
  test::expect_contains(report, "\"join_missing_rows\": 15");

  o = joined(dir.file("in.csv"), dir.file("dim.csv"), dir.file("drop.h5"));
  o.gates.drop_join_missing = true;
  const io::IngestResult r = io::run_ingest(world, o);
  EXPECT_TRUE(r.report.passed());
  EXPECT_EQ(*r.report.join_missing_rows, 15);
  const ReadBack b = read_back(world, o.output);
  ASSERT_EQ(b.meta.rows, 785);
  EXPECT_EQ(b.rows.features, g.x) << "rows after a dropped one out of place";
  EXPECT_EQ(b.rows.labels, g.y);
}

TEST(IngestJoin, BadOptionsAreAgreedErrorsAndPublishNothing) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Dim d = make_dim();
  test::write_shared(world, dir.file("dim.csv"), d.text);
  test::write_shared(world, dir.file("in.csv"), make_big(d, 50).text);
  const auto opts = [&] {
    return joined(dir.file("in.csv"), dir.file("dim.csv"), dir.file("out.h5"));
  };
  io::IngestOptions o = opts();
  o.csv.label_column = "id";
  std::string m = test::expect_agreed_error<ConfigError>(world, [&] { io::run_ingest(world, o); });
  test::expect_contains(m, "ingest.join_key 'id' is also the label column");
  o = opts();
  o.csv.feature_columns = {"a", "id"};
  m = test::expect_agreed_error<ConfigError>(world, [&] { io::run_ingest(world, o); });
  test::expect_contains(m, "ingest.csv_features lists the join key 'id'");
  o = opts();
  o.csv.feature_columns = {"a", "b"};
  o.join.columns = {"a"};
  test::write_shared(world, dir.file("dim2.csv"), "id,a\ns1,1\n");
  o.join.path = dir.file("dim2.csv");
  m = test::expect_agreed_error<ConfigError>(world, [&] { io::run_ingest(world, o); });
  test::expect_contains(m, "join column 'a' of");
  o = opts();
  o.join.key = "q";  // in the join table, not in the input
  o.join.columns = {"r"};
  m = test::expect_agreed_error<DataError>(world, [&] { io::run_ingest(world, o); });
  test::expect_contains(m, "in.csv' has no column 'q' (named by [ingest] join_key)");
  o = opts();
  o.join.key.clear();
  m = test::expect_agreed_error<ConfigError>(world, [&] { io::run_ingest(world, o); });
  test::expect_contains(m, "needs ingest.join_key");
  o = opts();
  o.source = io::IngestOptions::Source::idx;
  o.idx.images = dir.file("in.csv");
  m = test::expect_agreed_error<ConfigError>(world, [&] { io::run_ingest(world, o); });
  test::expect_contains(m, "ingest.join needs ingest.source = csv");
  world.barrier();
  EXPECT_FALSE(std::filesystem::exists(dir.file("out.h5")));
}

TEST(IngestJoin, AppendOfJoinedPartsEqualsTheJoinedWhole) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Dim d = make_dim();
  const Big whole = make_big(d, 600);
  const Big head = make_big(d, 350), tail = make_big(d, 250, 350);
  test::write_shared(world, dir.file("dim.csv"), d.text);
  test::write_shared(world, dir.file("a.csv"), head.text);
  test::write_shared(world, dir.file("b.csv"), tail.text);
  io::IngestOptions o = joined(dir.file("a.csv"), dir.file("dim.csv"), dir.file("out.h5"));
  io::run_ingest(world, o);
  o = joined(dir.file("b.csv"), dir.file("dim.csv"), dir.file("out.h5"));
  o.overwrite = false;
  o.append = true;
  EXPECT_TRUE(io::run_ingest(world, o).published);
  const ReadBack b = read_back(world, o.output);
  ASSERT_EQ(b.meta.rows, 600);
  EXPECT_EQ(b.rows.features, whole.x);
  EXPECT_EQ(b.rows.labels, whole.y);
  ASSERT_EQ(b.meta.provenance.sources.size(), 4u);  // a.csv, dim.csv, b.csv, dim.csv
  // The same append again is recognised by its sources (the join table among them).
  EXPECT_TRUE(io::run_ingest(world, o).already_appended);
  // --validate-only with a join: the gates and the report, nothing written.
  o = joined(dir.file("a.csv"), dir.file("dim.csv"), dir.file("v.h5"));
  o.validate_only = true;
  const io::IngestResult v = io::run_ingest(world, o);
  EXPECT_FALSE(v.published);
  EXPECT_EQ(v.rows_added, 350);
  EXPECT_FALSE(std::filesystem::exists(o.output));
  EXPECT_TRUE(std::filesystem::exists(o.report));
}
