// read_csv on malformed input: one agreed error on every rank naming the file, the 1-based
// line, the column and the value. Bad lines sit at ~90% of the file, so at 2 and 4 ranks the
// last rank finds them and the line number must come from the scan of the other ranks' lines.
#include <gtest/gtest.h>

#include <algorithm>

#include "locus/io/csv.hpp"
#include "sources_test_util.hpp"

using namespace locus;

namespace {

// 200 valid rows "a,b,c,label" with blank and CRLF lines sprinkled in; bad_row replaces the
// row at the given fraction of the rows. Returns the text and sets the bad line's 1-based number
// and byte offset.
std::string csv_with(const std::string& bad_row, double at, std::int64_t& bad_line,
                     std::size_t* bad_offset = nullptr) {
  std::string out = "a,b,c,label\n";
  const int bad_index = static_cast<int>(200 * at);
  for (int r = 0; r < 200; ++r) {
    if (r % 37 == 5) out += r % 2 ? "\n" : "  \r\n";  // blank lines still count as lines
    if (r == bad_index) {
      bad_line = std::count(out.begin(), out.end(), '\n') + 1;
      if (bad_offset != nullptr) *bad_offset = out.size();
      out += bad_row + "\n";
      continue;
    }
    out += std::to_string(r) + ".25," + std::to_string(r * 3) + ",-" + std::to_string(r) +
           "e-2," + std::to_string(r % 10) + (r % 3 ? "\n" : "\r\n");
  }
  return out;
}

std::string csv_error(const mpi::Comm& comm, const io::CsvOptions& opts) {
  return test::expect_agreed_error<DataError>(comm, [&] { io::read_csv(comm, opts); });
}

// Writes a file with one bad row at 90% and returns the error message; checks file and line.
std::string bad_row_error(const mpi::Comm& comm, const test::SharedTempDir& dir,
                          const std::string& row) {
  std::int64_t line = 0;
  std::size_t offset = 0;
  const std::string path = dir.file("bad.csv");
  const std::string text = csv_with(row, 0.9, line, &offset);
  // The bad line starts in the last rank's byte range (the data after the header, split evenly).
  const std::size_t header = text.find('\n') + 1;
  const std::size_t data = text.size() - header;
  EXPECT_GE(offset, header + data / comm.size() * (comm.size() - 1) + data % comm.size());
  test::write_shared(comm, path, text);
  const std::string msg = csv_error(comm, {path, ',', "label", {}});
  test::expect_contains(msg, "'" + path + "' line " + std::to_string(line) + ": ");
  return msg;
}

}  // namespace

TEST(CsvErrors, RaggedRows) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  std::string msg = bad_row_error(world, dir, "1,2,3");
  test::expect_contains(msg, "the row has 3 fields but the header has 4 columns");
  msg = bad_row_error(world, dir, "1,2,3,4,5\r");
  test::expect_contains(msg, "the row has 5 fields but the header has 4 columns");
}

TEST(CsvErrors, NonNumericEmptyAndOutOfRangeValues) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  std::string msg = bad_row_error(world, dir, "1,abc,3,4");
  test::expect_contains(msg, "column 'b' has value 'abc', which is not a number");
  test::expect_contains(msg, "feature_columns");
  msg = bad_row_error(world, dir, "1, 0x10 ,3,4");
  test::expect_contains(msg, "column 'b' has value '0x10'");
  msg = bad_row_error(world, dir, "1e999,2,3,4");
  test::expect_contains(msg, "column 'a' has value '1e999'");
  msg = bad_row_error(world, dir, "1,,3,4");
  test::expect_contains(msg, "column 'b' is empty");
  msg = bad_row_error(world, dir, "1,2,3,");
  test::expect_contains(msg, "column 'label' is empty");
}

TEST(CsvErrors, NonIntegerLabels) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  for (std::string bad : {"3.5", "3.0", "cat", "99999999999", "1e3"}) {
    const std::string msg = bad_row_error(world, dir, "1,2,3," + bad);
    test::expect_contains(msg,
                          "label column 'label' has value '" + bad + "', which is not an integer");
  }
}

TEST(CsvErrors, FirstBadLineInFileOrderWins) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  std::int64_t early = 0;
  std::string text = csv_with("1,2,x,4", 0.4, early);
  // A second bad row later in the file (found by the last rank at 2 and 4 ranks): the error
  // must still name the first one, found by a lower rank.
  const std::size_t cut = text.find("180.25,");
  ASSERT_NE(cut, std::string::npos);
  text = text.substr(0, cut) + "1,2\n" + text.substr(cut);
  test::write_shared(world, dir.file("two.csv"), text);
  const std::string msg = csv_error(world, {dir.file("two.csv"), ',', "label", {}});
  test::expect_contains(msg, "line " + std::to_string(early) + ": column 'c' has value 'x'");
}

TEST(CsvErrors, MissingColumnsSuggestTheClosestName) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const std::string path = dir.file("iris.csv");
  test::write_shared(world, path, "sepal_length,sepal_width,species\n1,2,0\n");
  std::string msg = csv_error(world, {path, ',', "specie", {}});
  test::expect_contains(msg,
                        "'" + path + "' has no column 'specie' (named by [ingest] label_column)");
  test::expect_contains(msg, "did you mean 'species'?");
  test::expect_contains(msg, "the header has 3 columns: sepal_length, sepal_width, species");
  msg = csv_error(world, {path, ',', "species", {"sepal_length", "Sepal_Widht"}});
  test::expect_contains(msg, "has no column 'Sepal_Widht' (named by [ingest] feature_columns)");
  test::expect_contains(msg, "did you mean 'sepal_width'?");
  msg = csv_error(world, {path, ',', "species", {"petal_area_in_mm"}});
  EXPECT_EQ(msg.find("did you mean"), std::string::npos) << "no close name: " << msg;
}

TEST(CsvErrors, NoDataRows) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  for (std::string text : {"", "a,b\n", "a,b", "a,b\r\n\n  \n\r\n"}) {
    test::write_shared(world, dir.file("empty.csv"), text);
    const std::string msg = csv_error(world, {dir.file("empty.csv"), ',', "", {}});
    test::expect_contains(msg, "'" + dir.file("empty.csv") + "'");
    test::expect_contains(msg, "no data rows");
  }
}

TEST(CsvErrors, BadHeaderAndMissingFile) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("dup.csv"), "a,b,a\n1,2,3\n");
  test::expect_contains(csv_error(world, {dir.file("dup.csv"), ',', "", {}}),
                        "column 'a' appears twice (columns 1 and 3)");
  test::write_shared(world, dir.file("hole.csv"), "a,,b\n1,2,3\n");
  test::expect_contains(csv_error(world, {dir.file("hole.csv"), ',', "", {}}),
                        "line 1 (the header): column 2 has no name");
  test::write_shared(world, dir.file("label.csv"), "y\n1\n");
  test::expect_contains(csv_error(world, {dir.file("label.csv"), ',', "y", {}}),
                        "has no feature columns");
  const std::string msg = csv_error(world, {dir.file("nope.csv"), ',', "", {}});
  test::expect_contains(msg,
                        "cannot open '" + dir.file("nope.csv") + "': No such file or directory");
  test::expect_contains(msg, "[ingest]");
}

TEST(CsvErrors, ContradictoryOptionsAreConfigErrors) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("ok.csv"), "a,b\n1,2\n");
  auto config_error = [&](const io::CsvOptions& o) {
    return test::expect_agreed_error<ConfigError>(world, [&] { io::read_csv(world, o); });
  };
  test::expect_contains(config_error({dir.file("ok.csv"), ',', "b", {"a", "b"}}),
                        "label column 'b' is also listed in feature_columns");
  test::expect_contains(config_error({dir.file("ok.csv"), ',', "", {"a", "a"}}),
                        "feature_columns lists 'a' twice");
  test::expect_contains(config_error({dir.file("ok.csv"), '"', "", {}}), "delimiter");
}
