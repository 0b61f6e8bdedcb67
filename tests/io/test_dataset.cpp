// Collective row I/O round trips at any rank count, asserting HDF5 really did the transfer
// collectively; attributes; extendible datasets; clear errors for missing files/datasets and
// failed HDF5 calls (with HDF5's error stack).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>

#include <fmt/format.h>

#include "locus/io/attribute.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;
using h5::Dataset;
using h5::File;

namespace {
float value_at(std::uint64_t row, std::uint64_t col) {
  return static_cast<float>(row) * 1000.0f + static_cast<float>(col) * 0.5f;
}
std::vector<float> rows_of(h5::RowRange r, std::uint64_t cols) {
  std::vector<float> v(r.count * cols);
  for (std::uint64_t i = 0; i < r.count; ++i)
    for (std::uint64_t c = 0; c < cols; ++c) v[i * cols + c] = value_at(r.begin + i, c);
  return v;
}
}  // namespace

TEST(Partition, CoversEveryRowOnceInOrder) {
  for (std::uint64_t n : {0u, 1u, 7u, 100u, 1001u}) {
    for (int size : {1, 2, 3, 4, 7}) {
      for (std::uint64_t align : {1u, 4u, 64u}) {
        std::uint64_t next = 0;
        for (int r = 0; r < size; ++r) {
          auto range = h5::partition_rows(n, r, size, align);
          EXPECT_EQ(range.begin, next);
          if (align > 1 && range.end() < n) {
            EXPECT_EQ(range.end() % align, 0u);
          }
          next = range.end();
        }
        EXPECT_EQ(next, n) << "n=" << n << " size=" << size;
      }
    }
  }
}

TEST(Dataset, CollectiveRoundTripOfEachRanksRows) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::uint64_t n = 1003, d = 17;  // uneven split, several chunks
  const auto mine = h5::partition_rows(n, world.rank(), world.size());
  {
    File f = File::create(world, dir.file("rt.h5"));
    {
      Dataset ds = Dataset::create(f, {.name = "/features", .dtype = h5::Dtype::f32, .rows = n,
                                       .cols = d, .chunk_rows = 64});
      auto data = rows_of(mine, d);
      ds.write_rows<float>(mine.begin, data);
      EXPECT_TRUE(ds.last_transfer().collective())
          << "cause " << ds.last_transfer().local_no_collective_cause;
      Dataset lab = Dataset::create(f, {.name = "/labels", .dtype = h5::Dtype::i32, .rows = n});
      std::vector<std::int32_t> labels(mine.count);
      std::iota(labels.begin(), labels.end(), static_cast<std::int32_t>(mine.begin));
      lab.write_rows<std::int32_t>(mine.begin, labels);
      EXPECT_TRUE(lab.last_transfer().collective());
    }
    f.close();
  }
  // Read back with a different partition (reversed rank order) to prove rows landed globally.
  File f = File::open(world, dir.file("rt.h5"), File::Mode::read);
  Dataset ds = Dataset::open(f, "/features");
  EXPECT_EQ(ds.rows(), n);
  EXPECT_EQ(ds.cols(), d);
  EXPECT_EQ(ds.dtype(), h5::Dtype::f32);
  const auto other = h5::partition_rows(n, world.size() - 1 - world.rank(), world.size());
  std::vector<float> back(other.count * d);
  ds.read_rows<float>(other.begin, back);
  EXPECT_TRUE(ds.last_transfer().collective());
  EXPECT_EQ(back, rows_of(other, d));
  Dataset lab = Dataset::open(f, "/labels");
  EXPECT_EQ(lab.cols(), 0u);
  std::vector<std::int32_t> labels(other.count);
  lab.read_rows<std::int32_t>(other.begin, labels);
  for (std::uint64_t i = 0; i < other.count; ++i)
    EXPECT_EQ(labels[i], static_cast<std::int32_t>(other.begin + i));
}

TEST(Dataset, LargeTransfersAreCutIntoCollectivePiecesOnEveryRank) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  // Only rank 0 holds rows: the other ranks must still join every piece.
  const std::uint64_t n = 500, d = 8;
  const h5::RowRange mine{0, world.is_root() ? n : 0};
  Dataset::set_max_piece_bytes(d * 4 * 7);  // 7 rows per piece → 72 pieces
  File f = File::create(world, dir.file("pieces.h5"));
  Dataset ds = Dataset::create(f, {.name = "/x", .dtype = h5::Dtype::f32, .rows = n, .cols = d});
  ds.write_rows<float>(mine.begin, rows_of(mine, d));
  const auto all = h5::partition_rows(n, world.rank(), world.size());
  std::vector<float> back(all.count * d);
  ds.read_rows<float>(all.begin, back);
  Dataset::set_max_piece_bytes(1ULL << 30);
  EXPECT_EQ(back, rows_of(all, d));
}

TEST(Dataset, SeveralRangesPerRankAreWrittenInCollectiveRounds) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  // Blocks of 7 rows dealt round-robin with a skew (rank r takes block b when (b + b / 5) % size
  // == r, so ranks hold different range counts), adjacent blocks of one rank not merged, and
  // one range cut in pieces: every rank must join every round.
  const std::uint64_t n = 200, d = 3, block = 7;
  std::vector<h5::RowRange> mine;
  std::vector<float> data;
  for (std::uint64_t b = 0; b * block < n; ++b) {
    if (static_cast<int>((b + b / 5) % static_cast<std::uint64_t>(world.size())) != world.rank())
      continue;
    const h5::RowRange r{b * block, std::min(block, n - b * block)};
    mine.push_back(r);
    const std::vector<float> v = rows_of(r, d);
    data.insert(data.end(), v.begin(), v.end());
  }
  Dataset::set_max_piece_bytes(d * 4 * 5);  // 5 rows per piece: each 7-row range takes 2
  File f = File::create(world, dir.file("ranges.h5"));
  Dataset ds = Dataset::create(f, {.name = "/x", .dtype = h5::Dtype::f32, .rows = n, .cols = d});
  ds.write_row_ranges<float>(mine, data);
  Dataset::set_max_piece_bytes(1ULL << 30);
  EXPECT_TRUE(ds.last_transfer().collective()) << "mode " << ds.last_transfer().mode;
  const auto all = h5::partition_rows(n, world.rank(), world.size());
  std::vector<float> back(all.count * d);
  ds.read_rows<float>(all.begin, back);
  EXPECT_EQ(back, rows_of(all, d));
}

TEST(Dataset, ExtendibleDatasetGrows) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::uint64_t d = 5;
  File f = File::create(world, dir.file("grow.h5"));
  Dataset ds = Dataset::create(
      f, {.name = "/x", .dtype = h5::Dtype::f32, .rows = 10, .cols = d, .chunk_rows = 4,
          .extendible = true});
  auto first = h5::partition_rows(10, world.rank(), world.size());
  ds.write_rows<float>(first.begin, rows_of(first, d));
  ds.resize(25);
  EXPECT_EQ(ds.rows(), 25u);
  auto added = h5::partition_rows(15, world.rank(), world.size());
  added.begin += 10;
  ds.write_rows<float>(added.begin, rows_of(added, d));
  auto all = h5::partition_rows(25, world.rank(), world.size());
  std::vector<float> back(all.count * d);
  ds.read_rows<float>(all.begin, back);
  EXPECT_EQ(back, rows_of(all, d));
}

TEST(Attributes, RoundTripEveryKind) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  File f = File::create(world, dir.file("attrs.h5"));
  const std::vector<double> stats{1.5, -2.25, 1e300};
  const std::vector<std::int64_t> counts{3, 0, -7};
  h5::write_attr(f.id(), "pi", 3.14159);
  h5::write_attr(f.id(), "rows", std::int64_t{60000});
  h5::write_attr(f.id(), "config", std::string("[ingest]\nsource = idx\n"));
  h5::write_attr(f.id(), "mean", std::span<const double>(stats));
  h5::write_attr(f.id(), "counts", std::span<const std::int64_t>(counts));
  h5::write_attr(f.id(), "names", std::vector<std::string>{"a", "pixel783", ""});
  h5::write_attr(f.id(), "rows", std::int64_t{60001});  // replacing works
  h5::write_attr(f.id(), "no_numbers", std::span<const double>());
  h5::write_attr(f.id(), "no_names", std::vector<std::string>{});
  f.close();
  File g = File::open(world, dir.file("attrs.h5"), File::Mode::read);
  EXPECT_DOUBLE_EQ(h5::read_attr<double>(g.id(), "pi"), 3.14159);
  EXPECT_EQ(h5::read_attr<std::int64_t>(g.id(), "rows"), 60001);
  EXPECT_EQ(h5::read_attr<double>(g.id(), "rows"), 60001.0);
  EXPECT_EQ(h5::read_attr<std::string>(g.id(), "config"), "[ingest]\nsource = idx\n");
  EXPECT_EQ(h5::read_attr<std::vector<double>>(g.id(), "mean"), stats);
  EXPECT_EQ(h5::read_attr<std::vector<std::int64_t>>(g.id(), "counts"), counts);
  EXPECT_EQ(h5::read_attr<std::vector<std::string>>(g.id(), "names"),
            (std::vector<std::string>{"a", "pixel783", ""}));
  EXPECT_TRUE(h5::read_attr<std::vector<double>>(g.id(), "no_numbers").empty());
  EXPECT_TRUE(h5::read_attr<std::vector<std::string>>(g.id(), "no_names").empty());
  EXPECT_FALSE(h5::has_attr(g.id(), "nope"));
  try {
    h5::read_attr<double>(g.id(), "nope");
    FAIL() << "missing attribute must throw";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("'nope'"), std::string::npos) << e.what();
  }
}

TEST(Errors, MissingFileAndDatasetAreClearDataErrorsOnEveryRank) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  try {
    File::open(world, dir.file("absent.h5"), File::Mode::read);
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("absent.h5"), std::string::npos);
  }
  if (world.is_root()) {
    std::FILE* fp = std::fopen(dir.file("garbage.h5").c_str(), "w");
    std::fputs("this is not hdf5", fp);
    std::fclose(fp);
  }
  world.barrier();
  EXPECT_THROW(File::open(world, dir.file("garbage.h5"), File::Mode::read), DataError);
  File f = File::create(world, dir.file("empty.h5"));
  try {
    Dataset::open(f, "/features");
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("/features"), std::string::npos);
  }
}

// A failed HDF5 call under LOCUS_H5_CHECK: an H5Error naming the call, its file:line and rank,
// with HDF5's own error stack appended (auto-printing is off, so that is the only report), and
// the stack cleared for the next call.
TEST(Errors, AFailedHdf5CallIsAnH5ErrorWithTheCallAndHdf5sStack) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  File f = File::create(world, dir.file("stack.h5"));
  for (int attempt = 0; attempt < 2; ++attempt) {
    const int line = __LINE__ + 2;
    try {
      LOCUS_H5_CHECK(H5Gopen2(f.id(), "no_such_group", H5P_DEFAULT));
      FAIL() << "opening a missing group must fail";
    } catch (const H5Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("H5Gopen2(f.id(), \"no_such_group\", H5P_DEFAULT) failed at "),
                std::string::npos) << what;
      EXPECT_NE(what.find(fmt::format("test_dataset.cpp:{} (rank {}/{}", line, world.rank(),
                                      world.size())),
                std::string::npos) << what;
      EXPECT_NE(what.find("; HDF5 error stack:\n  #000 "), std::string::npos) << what;
      EXPECT_NE(what.find("in H5Gopen2()"), std::string::npos) << what;
      EXPECT_NE(what.find("no_such_group"), std::string::npos) << what;
      // Cleared: the second attempt's message holds one stack, not two.
      EXPECT_EQ(what.find("#000", what.find("#000") + 1), std::string::npos) << what;
      EXPECT_FALSE(e.agreed());
    }
  }
}

TEST(Errors, UnwritableDirectoryIsAnIoError) {
  mpi::Comm world = mpi::Comm::world();
  try {
    File::create(world, "/proc/locus-cannot-write-here.h5");
    FAIL() << "expected IoError";
  } catch (const IoError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("is not writable"), std::string::npos) << e.what();
  }
}
