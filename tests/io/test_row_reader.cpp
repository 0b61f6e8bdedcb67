// io::RowReader (row_reader.cpp, read_pool.cpp): rows read by parallel pread are the bytes
// H5Dread gives, for contiguous and chunked storage (chunks not dividing the reads, chunks
// laid out back to front in the file, chunks never written and so the fill value), at 1 to 5
// threads and for reads from one row to the whole dataset; the layouts that must go through
// H5Dread do (compression, float64, chunks narrower than a row, a user block) and still read
// the same values, and so does one thread on chunks below 4 MiB; a file truncated under an open
// reader is a DataError naming it. The private pool of pread threads: pieces, errors, abandon().
#include <gtest/gtest.h>

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "locus/io/h5.hpp"
#include "locus/io/row_reader.hpp"
#include "read_pool.hpp"

using namespace locus;

namespace {

constexpr hsize_t kCols = 96;  // 384 bytes a row

struct Layout {
  hsize_t chunk_rows = 0;   // 0: contiguous
  hsize_t chunk_cols = kCols;
  bool deflate = false;
  bool f64 = false;
  hsize_t userblock = 0;
  bool reverse = false;     // write the row blocks back to front (chunks in descending order)
  std::vector<std::pair<hsize_t, hsize_t>> skip;  // row ranges never written (fill value)
};

constexpr float kFill = -7.25f;

float value(hsize_t row, hsize_t col) {
  return static_cast<float>(row) * 0.5f + static_cast<float>(col) * 1e-3f + 0.125f;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("locus_row_reader_" + std::to_string(::getpid()) + "_" + name + ".h5"))
      .string();
}

// Writes a [rows, kCols] dataset "x" block by block (blocks of 100 rows) in `l`'s layout.
std::string make_file(const std::string& name, hsize_t rows, const Layout& l) {
  h5::init();
  const std::string path = temp_path(name);
  h5::Id fcpl(H5Pcreate(H5P_FILE_CREATE));
  if (l.userblock > 0) H5Pset_userblock(fcpl.get(), l.userblock);
  h5::Id file(LOCUS_H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, fcpl.get(), H5P_DEFAULT)));
  const std::array<hsize_t, 2> dims{rows, kCols}, max{H5S_UNLIMITED, kCols};
  h5::Id dcpl(H5Pcreate(H5P_DATASET_CREATE));
  if (l.chunk_rows > 0) {
    const std::array<hsize_t, 2> chunk{l.chunk_rows, l.chunk_cols};
    LOCUS_H5_CHECK(H5Pset_chunk(dcpl.get(), 2, chunk.data()));
    if (l.deflate) LOCUS_H5_CHECK(H5Pset_deflate(dcpl.get(), 1));
  }
  const hid_t file_type = l.f64 ? H5T_IEEE_F64LE : H5T_IEEE_F32LE;
  LOCUS_H5_CHECK(H5Pset_fill_value(dcpl.get(), H5T_NATIVE_FLOAT, &kFill));
  h5::Id space(LOCUS_H5_CHECK(
      H5Screate_simple(2, dims.data(), l.chunk_rows > 0 ? max.data() : nullptr)));
  h5::Id d(LOCUS_H5_CHECK(H5Dcreate2(file.get(), "x", file_type, space.get(), H5P_DEFAULT,
                                     dcpl.get(), H5P_DEFAULT)));
  std::vector<hsize_t> starts;
  for (hsize_t r = 0; r < rows; r += 100) starts.push_back(r);
  if (l.reverse) std::reverse(starts.begin(), starts.end());
  auto write_rows = [&](hsize_t first, hsize_t n) {
    std::vector<float> block(n * kCols);
    for (hsize_t i = 0; i < n; ++i)
      for (hsize_t c = 0; c < kCols; ++c) block[i * kCols + c] = value(first + i, c);
    const std::array<hsize_t, 2> start{first, 0}, count{n, kCols};
    h5::Id fs(LOCUS_H5_CHECK(H5Dget_space(d.get())));
    LOCUS_H5_CHECK(H5Sselect_hyperslab(fs.get(), H5S_SELECT_SET, start.data(), nullptr,
                                       count.data(), nullptr));
    h5::Id ms(LOCUS_H5_CHECK(H5Screate_simple(2, count.data(), nullptr)));
    LOCUS_H5_CHECK(
        H5Dwrite(d.get(), H5T_NATIVE_FLOAT, ms.get(), fs.get(), H5P_DEFAULT, block.data()));
  };
  auto skipped = [&](hsize_t row) {
    return std::any_of(l.skip.begin(), l.skip.end(),
                       [&](auto range) { return row >= range.first && row < range.second; });
  };
  for (hsize_t r0 : starts) {
    const hsize_t end = std::min<hsize_t>(r0 + 100, rows);
    for (hsize_t a = r0; a < end;) {  // the runs of rows not skipped
      if (skipped(a)) {
        ++a;
        continue;
      }
      hsize_t b = a;
      while (b < end && !skipped(b)) ++b;
      write_rows(a, b - a);
      a = b;
    }
  }
  return path;
}

struct Open {
  h5::Id file, dataset;
  explicit Open(const std::string& path)
      : file(LOCUS_H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT))),
        dataset(LOCUS_H5_CHECK(H5Dopen2(file.get(), "x", H5P_DEFAULT))) {}
};

// What H5Dread gives for rows [first, first + n).
std::vector<float> h5_rows(const Open& o, hsize_t first, hsize_t n) {
  std::vector<float> out(n * kCols, 1e30f);
  const std::array<hsize_t, 2> start{first, 0}, count{n, kCols};
  h5::Id fs(LOCUS_H5_CHECK(H5Dget_space(o.dataset.get())));
  LOCUS_H5_CHECK(H5Sselect_hyperslab(fs.get(), H5S_SELECT_SET, start.data(), nullptr,
                                     count.data(), nullptr));
  h5::Id ms(LOCUS_H5_CHECK(H5Screate_simple(2, count.data(), nullptr)));
  LOCUS_H5_CHECK(
      H5Dread(o.dataset.get(), H5T_NATIVE_FLOAT, ms.get(), fs.get(), H5P_DEFAULT, out.data()));
  return out;
}

// Reads `ranges` of rows through a RowReader of `threads` threads and through H5Dread; the
// bytes must be equal (poisoned buffers: every element is written).
void expect_same_rows(const std::string& path, int threads, bool direct,
                      const std::vector<std::pair<hsize_t, hsize_t>>& ranges) {
  Open o(path);
  io::RowReader reader(o.file.get(), o.dataset.get(), threads);
  EXPECT_EQ(reader.direct(), direct) << reader.method();
  EXPECT_EQ(reader.cols(), kCols);
  for (auto [first, n] : ranges) {
    std::vector<float> got(n * kCols, std::nanf("1"));
    reader.read(first, got);
    const std::vector<float> want = h5_rows(o, first, n);
    ASSERT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
        << path << ": rows [" << first << ", " << first + n << ") at " << threads
        << " threads, " << reader.method();
  }
}

// Reads to cover: one row, a chunk's tail into the next, a whole chunk's worth, several MiB
// (several shares), and everything.
std::vector<std::pair<hsize_t, hsize_t>> ranges_of(hsize_t rows) {
  return {{0, 1}, {35, 3}, {rows - 1, 1}, {30, 40}, {111, 37},
          {7, std::min<hsize_t>(5000, rows - 7)}, {0, rows}, {1, rows - 2},
          {rows / 2, rows - rows / 2}};
}

constexpr hsize_t kRows = 12000;  // 4.6 MB: up to 4 shares of a whole read

TEST(RowReader, ContiguousRowsReadByPreadEqualH5Dread) {
  const std::string path = make_file("contig", kRows, {});
  for (int threads : {1, 2, 5}) expect_same_rows(path, threads, true, ranges_of(kRows));
  Open o(path);
  io::RowReader reader(o.file.get(), o.dataset.get(), 3);
  EXPECT_EQ(reader.method(), "pread, 3 threads (contiguous)");
  std::filesystem::remove(path);
}

TEST(RowReader, ChunkedRowsReadByPreadEqualH5DreadInAnyChunkOrder) {
  // 37-row chunks divide neither the reads nor the 100-row blocks written; "reverse" lays the
  // chunks out back to front, so consecutive chunks are not adjacent in the file.
  for (bool reverse : {false, true}) {
    const std::string path = make_file("chunked", kRows, {.chunk_rows = 37, .reverse = reverse});
    // One thread on chunks below 4 MiB goes through H5Dread (faster than a lookup per chunk).
    for (int threads : {1, 3, 4}) expect_same_rows(path, threads, threads > 1, ranges_of(kRows));
    Open o(path);
    io::RowReader reader(o.file.get(), o.dataset.get(), 4);
    EXPECT_EQ(reader.method(), "pread, 4 threads (chunks of 37 rows)");
    std::filesystem::remove(path);
  }
}

TEST(RowReader, OneThreadReadsChunksOfAtLeast4MiBByPread) {
  // 11000-row chunks of 384-byte rows (4.03 MiB): the second is an edge chunk, partly beyond
  // the dataset's 12000 rows.
  const std::string path = make_file("big_chunks", kRows, {.chunk_rows = 11000});
  for (int threads : {1, 2}) expect_same_rows(path, threads, true, ranges_of(kRows));
  const std::string small = make_file("small_chunks", 3000, {.chunk_rows = 10000});
  Open o(small);
  io::RowReader one(o.file.get(), o.dataset.get(), 1);
  EXPECT_EQ(one.method(), "H5Dread (one thread, chunks below 4 MiB)");
  std::filesystem::remove(path);
  std::filesystem::remove(small);
}

TEST(RowReader, ChunksNeverWrittenReadAsTheFillValue) {
  // Rows [370, 740) are never written: chunks 10..19 of 37 rows stay unallocated (chunk 9
  // and 20 are partly written).
  const std::string path =
      make_file("holes", 2000, {.chunk_rows = 37, .skip = {{370, 740}, {1900, 2000}}});
  expect_same_rows(path, 3, true, ranges_of(2000));
  Open o(path);
  io::RowReader reader(o.file.get(), o.dataset.get(), 2);
  std::vector<float> got(10 * kCols);
  reader.read(400, got);
  EXPECT_EQ(got[0], kFill);
  EXPECT_EQ(got.back(), kFill);
  std::filesystem::remove(path);
}

TEST(RowReader, LayoutsThatNeedHdf5GoThroughH5Dread) {
  struct Case {
    const char* name;
    Layout layout;
    const char* why;
  };
  const std::vector<Case> cases{
      {"deflate", {.chunk_rows = 64, .deflate = true}, "H5Dread (the dataset is compressed)"},
      {"f64", {.chunk_rows = 64, .f64 = true},
       "H5Dread (the dataset is not stored as native float32)"},
      {"narrow", {.chunk_rows = 64, .chunk_cols = 32},
       "H5Dread (the dataset's chunks do not span whole rows)"},
      {"userblock", {.userblock = 512}, "H5Dread (the file has a user block)"},
  };
  for (const Case& c : cases) {
    const std::string path = make_file(c.name, 3000, c.layout);
    expect_same_rows(path, 3, false, ranges_of(3000));
    Open o(path);
    io::RowReader reader(o.file.get(), o.dataset.get(), 3);
    EXPECT_EQ(reader.method(), c.why) << c.name;
    std::vector<float> row(kCols);
    reader.read(1234, row);
    EXPECT_EQ(row[5], value(1234, 5)) << c.name;
    std::filesystem::remove(path);
  }
}

// The pool alone (private, read_pool.hpp): pieces of any size from many ranges land where they
// belong; a range past the end of the file fails the read with a DataError and the pool reads
// on afterwards; abandon() after a caller's failure waits for the pieces already taken.
TEST(ReadPool, ReadsRangesInPiecesFailsCleanlyAndCanBeAbandoned) {
  const std::string path = temp_path("pool");
  std::vector<std::byte> data((5u << 20) + 12345);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::byte>((i * 131) >> 3);
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(data.data(), 1, data.size(), f), data.size());
    std::fclose(f);
  }
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  io::detail::ReadPool pool(4);
  std::vector<std::byte> out(data.size());
  // Ranges out of file order, one of several pieces (3 MiB + 7), some tiny, one empty.
  const std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges{
      {(3u << 20) + 7, data.size() - (3u << 20) - 7}, {0, 3}, {3, 0}, {3, (3u << 20) + 4}};
  for (int round = 0; round < 3; ++round) {
    std::fill(out.begin(), out.end(), std::byte{0xee});
    pool.begin(fd, path);
    for (auto [at, n] : ranges) pool.add(at, out.data() + at, n);
    pool.finish();
    ASSERT_EQ(std::memcmp(out.data(), data.data(), data.size()), 0) << "round " << round;
  }
  // Past the end: a DataError naming the file, whichever piece failed first.
  pool.begin(fd, path);
  pool.add(0, out.data(), 1u << 20);
  pool.add(data.size() - 10, out.data() + (1u << 20), 3u << 20);
  try {
    pool.finish();
    FAIL() << "a read past the end of the file succeeded";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  // Abandoned after 4 MiB were queued: the pieces taken finish, the rest are dropped.
  pool.begin(fd, path);
  pool.add(0, out.data(), 4u << 20);
  pool.abandon();
  // And the pool still reads.
  std::fill(out.begin(), out.end(), std::byte{0});
  pool.begin(fd, path);
  pool.add(0, out.data(), data.size());
  pool.finish();
  EXPECT_EQ(std::memcmp(out.data(), data.data(), data.size()), 0);
  ::close(fd);
  std::filesystem::remove(path);
}

TEST(RowReader, AFileTruncatedUnderAnOpenReaderIsADataErrorNamingIt) {
  const std::string path = make_file("truncated", kRows, {});
  Open o(path);
  io::RowReader reader(o.file.get(), o.dataset.get(), 3);
  ASSERT_TRUE(reader.direct());
  ASSERT_EQ(::truncate(path.c_str(), 1 << 20), 0);
  std::vector<float> all(kRows * kCols);
  try {
    reader.read(0, all);
    FAIL() << "a read past the end of the truncated file succeeded";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
  // The reader is still usable for rows before the cut.
  std::vector<float> row(kCols);
  reader.read(10, row);
  EXPECT_EQ(row[3], value(10, 3));
  std::filesystem::remove(path);
}

}  // namespace
