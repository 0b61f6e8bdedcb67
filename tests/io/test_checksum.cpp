// checksum_file against zlib's crc32 of the whole file, computed serially in the test.
#include <gtest/gtest.h>
#include <zlib.h>

#include <random>

#include "locus/io/checksum.hpp"
#include "sources_test_util.hpp"

using namespace locus;

namespace {

std::uint32_t serial_crc(std::string_view bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  crc = crc32_z(crc, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size());
  return static_cast<std::uint32_t>(crc);
}

std::string random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

}  // namespace

TEST(Checksum, EqualsSerialCrcForManySizes) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  // Sizes below, at and above the rank count, and across the 1 MiB read chunk.
  for (std::size_t n : {0UL, 1UL, 2UL, 3UL, 5UL, 4095UL, (1UL << 20) + 7, (3UL << 20) + 1}) {
    const std::string bytes = random_bytes(n, static_cast<unsigned>(n) + 1);
    const std::string path = dir.file("bytes-" + std::to_string(n));
    test::write_shared(world, path, bytes);
    const io::SourceFile got = io::checksum_file(world, path);
    EXPECT_EQ(got.path, path);
    EXPECT_EQ(got.bytes, n);
    EXPECT_EQ(got.crc32, serial_crc(bytes)) << "size " << n;
  }
}

TEST(Checksum, KnownValueOfZlibCheckString) {
  // The CRC-32 check value of "123456789" is 0xCBF43926 (every CRC-32 catalogue lists it).
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("check"), "123456789");
  EXPECT_EQ(io::checksum_file(world, dir.file("check")).crc32, 0xCBF43926U);
}

TEST(Checksum, RealGzipFileMatchesSerialCrc) {
  mpi::Comm world = mpi::Comm::world();
  const std::string path = "/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz";
  const std::string bytes = test::slurp(path);
  ASSERT_FALSE(bytes.empty()) << path;
  const io::SourceFile got = io::checksum_file(world, path);
  EXPECT_EQ(got.bytes, bytes.size());
  EXPECT_EQ(got.crc32, serial_crc(bytes));
}

TEST(Checksum, MissingFileIsAgreedDataError) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const std::string path = dir.file("nope.bin");
  const std::string msg = test::expect_agreed_error<DataError>(
      world, [&] { io::checksum_file(world, path); });
  test::expect_contains(msg, "cannot open '" + path + "'");
  test::expect_contains(msg, "No such file or directory");
  test::expect_contains(msg, "[ingest]");
}
