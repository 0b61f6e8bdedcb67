// Raw byte movement (lib/io/src/raw_io.cpp, crc32.cpp) at 1, 2 and 4 ranks: the CRC-32 against
// zlib's at every length and alignment; every rank writing its byte range of one file (pieces
// and ranges not aligned to anything), the bytes read back by every rank, the ranks' CRCs
// combined equal to a serial zlib CRC of the whole; the same inside a contiguous HDF5 dataset,
// read back through HDF5; where raw access is refused (chunked, unallocated, another byte
// order); and the errors (missing file, truncated file, a full device).
#include <gtest/gtest.h>
#include <zlib.h>

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "locus/io/raw_io.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;

namespace {

std::uint32_t zlib_crc(const void* p, std::size_t n, std::uint32_t crc = 0) {
  return static_cast<std::uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(p), n));
}

std::vector<std::byte> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(rng() & 0xff);
  return out;
}

// Collective: the CRC of the ranks' pieces in rank order (what the checkpoint writer does).
std::uint32_t combined(const mpi::Comm& comm, std::uint32_t crc, std::uint64_t length) {
  const auto crcs = comm.allgather(static_cast<std::uint64_t>(crc));
  const auto lengths = comm.allgather(length);
  uLong out = 0;
  for (std::size_t r = 0; r < crcs.size(); ++r) {
    if (lengths[r] > 0) out = ::crc32_combine(out, crcs[r], static_cast<z_off_t>(lengths[r]));
  }
  return static_cast<std::uint32_t>(out);
}

TEST(RawIo, Crc32EqualsZlibAtEveryLengthAndAlignment) {
  const auto data = random_bytes((3u << 20) + 1000, 7);
  const std::span<const std::byte> all(data);
  for (std::size_t n = 0; n < 300; ++n) {
    for (std::size_t at : {0, 1, 3, 8, 15}) {
      ASSERT_EQ(io::crc32_bytes(all.subspan(at, n)), zlib_crc(data.data() + at, n))
          << "length " << n << " at " << at;
    }
  }
  for (std::size_t n : {std::size_t{4096} + 7, std::size_t{1} << 20, (std::size_t{3} << 20) + 999}) {
    EXPECT_EQ(io::crc32_bytes(all.subspan(1, n)), zlib_crc(data.data() + 1, n)) << n;
  }
  // Continued CRCs equal one CRC of the concatenation.
  const std::uint32_t first = io::crc32_bytes(all.subspan(0, 12345));
  EXPECT_EQ(io::crc32_bytes(all.subspan(12345, 1u << 20), first),
            zlib_crc(data.data(), 12345 + (1u << 20)));
  EXPECT_EQ(io::crc32_bytes(all.subspan(0, 0), 0x1234abcd), 0x1234abcdu);
}

TEST(RawIo, EveryRankWritesItsRangeAndAnyRankReadsTheFile) {
  const mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::string path = dir.file("raw.bin");
  // Not a multiple of anything, and more than two pieces per rank at 1 and 2 ranks.
  const std::uint64_t size = 3 * io::RawFile::kPieceBytes + 12345;
  const auto whole = random_bytes(size, 11);  // the same on every rank
  if (world.is_root()) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  world.barrier();
  const h5::RowRange mine = h5::partition_rows(size, world.rank(), world.size());
  const std::span<const std::byte> share(whole.data() + mine.begin, mine.count);
  io::RawFile out = io::RawFile::open(path, io::RawFile::Mode::write);
  const std::uint32_t crc = out.write_at(mine.begin, share);
  EXPECT_EQ(crc, zlib_crc(share.data(), share.size()));
  out.close();
  EXPECT_EQ(combined(world, crc, mine.count), zlib_crc(whole.data(), whole.size()));
  world.barrier();
  EXPECT_EQ(std::filesystem::file_size(path), size);
  io::RawFile in = io::RawFile::open(path, io::RawFile::Mode::read);
  std::vector<std::byte> back(size);
  EXPECT_EQ(in.read_at(0, back), zlib_crc(whole.data(), whole.size()));
  EXPECT_EQ(back, whole);
  // A range read starting mid-piece, continuing a CRC.
  std::vector<std::byte> part(io::RawFile::kPieceBytes + 3);
  const std::uint32_t head = io::crc32_bytes(std::span(whole).subspan(0, 777));
  EXPECT_EQ(in.read_at(777, part, head), zlib_crc(whole.data(), 777 + part.size()));
  EXPECT_TRUE(std::equal(part.begin(), part.end(), whole.begin() + 777));
}

// A contiguous float32 dataset allocated at creation, as checkpoints make them.
h5::Id contiguous(hid_t file, const char* name, hsize_t rows, hsize_t cols, hid_t type,
                  H5D_alloc_time_t alloc = H5D_ALLOC_TIME_EARLY) {
  const hsize_t dims[2] = {rows, cols};
  h5::Id space(LOCUS_H5_CHECK(H5Screate_simple(2, dims, nullptr)));
  h5::Id dcpl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
  LOCUS_H5_CHECK(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS));
  LOCUS_H5_CHECK(H5Pset_alloc_time(dcpl.get(), alloc));
  LOCUS_H5_CHECK(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER));
  return h5::Id(LOCUS_H5_CHECK(H5Dcreate2(file, name, type, space.get(), H5P_DEFAULT,
                                          dcpl.get(), H5P_DEFAULT)));
}

TEST(RawIo, RanksWriteAContiguousDatasetThatHdf5ReadsBack) {
  const mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::string path = dir.file("t.h5");
  const hsize_t rows = 1001, cols = 777;  // 3.1 MB: rank shares cross 1 MiB pieces
  std::vector<float> whole(rows * cols);
  for (std::size_t i = 0; i < whole.size(); ++i) whole[i] = static_cast<float>(i) * 0.5f - 7.0f;
  const h5::RowRange mine = h5::partition_rows(rows, world.rank(), world.size());
  std::uint32_t crc = 0;
  {
    h5::File f = h5::File::create(world, path);
    {
      h5::Id a = contiguous(f.id(), "/a", 5, 3, H5T_IEEE_F32LE);  // a dataset before it
      h5::Id ds = contiguous(f.id(), "/t", rows, cols, H5T_IEEE_F32LE);
      const auto at = h5::raw_offset(ds.get(), H5T_NATIVE_FLOAT);
      ASSERT_TRUE(at.has_value());
      EXPECT_EQ(h5::file_name(ds.get()), path);
      io::RawFile out = io::RawFile::open(h5::file_name(ds.get()), io::RawFile::Mode::write);
      const auto bytes = std::as_bytes(std::span(whole).subspan(mine.begin * cols, mine.count * cols));
      crc = out.write_at(*at + mine.begin * cols * sizeof(float), bytes);
      out.close();
    }
    f.close();
  }
  EXPECT_EQ(combined(world, crc, mine.count * cols * sizeof(float)),
            zlib_crc(whole.data(), whole.size() * sizeof(float)));
  h5::File f = h5::File::open(world, path, h5::File::Mode::read);
  h5::Dataset ds = h5::Dataset::open(f, "/t");
  std::vector<float> back(whole.size());
  ds.read_rows<float>(0, back);
  EXPECT_EQ(back, whole);
  // And raw reads of any rank's rows.
  const auto at = h5::raw_offset(ds.id(), H5T_NATIVE_FLOAT);
  ASSERT_TRUE(at.has_value());
  io::RawFile in = io::RawFile::open(path, io::RawFile::Mode::read);
  std::vector<float> rows_back(3 * cols);
  in.read_at(*at + 500 * cols * sizeof(float), std::as_writable_bytes(std::span(rows_back)));
  EXPECT_TRUE(std::equal(rows_back.begin(), rows_back.end(), whole.begin() + 500 * cols));
}

TEST(RawIo, RawAccessIsRefusedWhereBytesAreNotTheElements) {
  const mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  h5::File f = h5::File::create(world, dir.file("r.h5"));
  {
    h5::Dataset chunked = h5::Dataset::create(
        f, {.name = "/chunked", .dtype = h5::Dtype::f32, .rows = 64, .cols = 4});
    EXPECT_FALSE(h5::raw_offset(chunked.id(), H5T_NATIVE_FLOAT).has_value());
    h5::Id big_endian = contiguous(f.id(), "/be", 8, 8, H5T_IEEE_F32BE);
    EXPECT_FALSE(h5::raw_offset(big_endian.get(), H5T_NATIVE_FLOAT).has_value());
    h5::Id doubles = contiguous(f.id(), "/f64", 8, 8, H5T_IEEE_F64LE);
    EXPECT_FALSE(h5::raw_offset(doubles.get(), H5T_NATIVE_FLOAT).has_value());
    EXPECT_TRUE(h5::raw_offset(doubles.get(), H5T_NATIVE_DOUBLE).has_value());
  }
  f.close();
  // Space not allocated yet (only a serial file can defer it: parallel HDF5 allocates early).
  const std::string serial = dir.file("serial." + std::to_string(world.rank()) + ".h5");
  h5::Id local(LOCUS_H5_CHECK(H5Fcreate(serial.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT)));
  h5::Id late = contiguous(local.get(), "/late", 8, 8, H5T_IEEE_F32LE, H5D_ALLOC_TIME_LATE);
  EXPECT_FALSE(h5::raw_offset(late.get(), H5T_NATIVE_FLOAT).has_value()) << "unallocated";
}

TEST(RawIo, ErrorsNameTheFile) {
  const mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  const std::string missing = dir.file("missing.bin");
  EXPECT_THROW(io::RawFile::open(missing, io::RawFile::Mode::read), DataError);
  try {
    io::RawFile::open(missing, io::RawFile::Mode::write);
    ADD_FAILURE() << "opened a missing file for writing";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
  // A read past the end of a (per-rank) short file.
  const std::string short_file = dir.file("short." + std::to_string(world.rank()));
  {
    const int fd = ::open(short_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, "0123456789", 10), 10);
    ::close(fd);
  }
  io::RawFile in = io::RawFile::open(short_file, io::RawFile::Mode::read);
  std::vector<std::byte> buf(16);
  try {
    in.read_at(2, buf);
    ADD_FAILURE() << "a truncated read succeeded";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("is truncated"), std::string::npos) << e.what();
  }
  // A full device: the write fails with the system's reason.
  if (std::filesystem::exists("/dev/full")) {
    io::RawFile full = io::RawFile::open("/dev/full", io::RawFile::Mode::write);
    try {
      full.write_at(0, std::as_bytes(std::span(buf)));
      ADD_FAILURE() << "a write to /dev/full succeeded";
    } catch (const IoError& e) {
      EXPECT_NE(std::string(e.what()).find("No space left"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
