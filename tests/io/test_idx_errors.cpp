// read_idx on malformed input: each case raises one agreed DataError on every rank, naming the
// file and what to do. Data errors sit late in the file so non-zero ranks find them at 2/4 ranks.
#include <gtest/gtest.h>

#include <random>

#include "locus/io/idx.hpp"
#include "sources_test_util.hpp"

using namespace locus;

namespace {

std::string header(std::uint8_t dtype, const std::vector<std::uint32_t>& dims) {
  std::string out{'\0', '\0', static_cast<char>(dtype), static_cast<char>(dims.size())};
  for (auto d : dims)
    for (int b = 3; b >= 0; --b) out.push_back(static_cast<char>((d >> (8 * b)) & 0xff));
  return out;
}

// A u8 IDX file of n records of 512 low-entropy bytes: compresses to several deflate blocks.
std::string noisy_images(std::uint32_t n) {
  std::string out = header(0x08, {n, 16, 32});
  std::mt19937 rng(42);
  for (std::uint64_t i = 0; i < std::uint64_t{n} * 512; ++i)
    out.push_back(static_cast<char>(rng() % 16));
  return out;
}

std::string idx_error(const mpi::Comm& comm, const io::IdxOptions& opts) {
  return test::expect_agreed_error<DataError>(comm, [&] { io::read_idx(comm, opts); });
}

}  // namespace

TEST(IdxErrors, MissingImagesOrLabelsFile) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("img"), header(0x08, {3, 2}) + std::string(6, '\1'));
  std::string msg = idx_error(world, {dir.file("missing.idx"), ""});
  test::expect_contains(msg, "cannot open '" + dir.file("missing.idx") + "'");
  test::expect_contains(msg, "No such file or directory");
  test::expect_contains(msg, "check the path in [ingest]");
  msg = idx_error(world, {dir.file("img"), dir.file("labels.gz")});
  test::expect_contains(msg, "cannot open '" + dir.file("labels.gz") + "'");
}

TEST(IdxErrors, WrongMagicPlainAndGzip) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  for (bool gz : {false, true}) {
    test::write_shared(world, dir.file("csv"), "a,b\n1,2\n3,4\n", gz);
    const std::string msg = idx_error(world, {dir.file("csv"), ""});
    test::expect_contains(msg, "'" + dir.file("csv") + "' is not an IDX file");
    test::expect_contains(msg, "61 2c 62 0a");  // "a,b\n"
    if (gz) test::expect_contains(msg, "after decompression");
  }
  test::write_shared(world, dir.file("tiny"), std::string("\0\0", 2));
  test::expect_contains(idx_error(world, {dir.file("tiny"), ""}), "too short to be an IDX file");
}

TEST(IdxErrors, UnknownDtype) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("x"), header(0x0A, {2, 2}) + std::string(4, '\0'));
  const std::string msg = idx_error(world, {dir.file("x"), ""});
  test::expect_contains(msg, "'" + dir.file("x") + "' has unknown IDX dtype 0x0a");
  test::expect_contains(msg, "0x08 u8");
}

TEST(IdxErrors, ShortPlainFileAndShortGzipContent) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  // 100 records of 16 bytes declared, 60 present.
  const std::string cut = header(0x08, {100, 4, 4}) + std::string(60 * 16, '\7');
  for (bool gz : {false, true}) {
    test::write_shared(world, dir.file("short"), cut, gz);
    const std::string msg = idx_error(world, {dir.file("short"), ""});
    test::expect_contains(msg, "'" + dir.file("short") + "' is shorter than its header says");
    test::expect_contains(msg, "re-download or re-create it");
    if (!gz) test::expect_contains(msg, "needs 1616 bytes but the file has 976");
  }
  // Longer than declared is as suspicious as shorter.
  for (bool gz : {false, true}) {
    test::write_shared(world, dir.file("long"), cut + std::string(41 * 16, '\7'), gz);
    test::expect_contains(idx_error(world, {dir.file("long"), ""}),
                          gz ? "holds more data than its header says" : "longer than its header");
  }
}

TEST(IdxErrors, GzipCutInHalf) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("full.gz"), noisy_images(3000), true);
  const std::string gz = test::slurp(dir.file("full.gz"));
  ASSERT_GT(gz.size(), 100000U) << "want several deflate blocks";
  test::write_shared(world, dir.file("half.gz"), gz.substr(0, gz.size() / 2));
  const std::string msg = idx_error(world, {dir.file("half.gz"), ""});
  test::expect_contains(msg, "'" + dir.file("half.gz") + "' is a truncated or corrupt gzip file");
  test::expect_contains(msg, "unexpected end of file");
  test::expect_contains(msg, "gzip -t");
  // Missing only the 8-byte trailer: the data is complete, but the stream is not.
  test::write_shared(world, dir.file("notrailer.gz"), gz.substr(0, gz.size() - 8));
  test::expect_contains(idx_error(world, {dir.file("notrailer.gz"), ""}),
                        "truncated or corrupt gzip file");
}

TEST(IdxErrors, GzipWithFlippedBytes) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("full.gz"), noisy_images(3000), true);
  std::string gz = test::slurp(dir.file("full.gz"));
  for (std::size_t i = gz.size() * 3 / 4; i < gz.size() * 3 / 4 + 16; ++i)
    gz[i] = static_cast<char>(~gz[i]);
  test::write_shared(world, dir.file("flipped.gz"), gz);
  const std::string msg = idx_error(world, {dir.file("flipped.gz"), ""});
  test::expect_contains(msg,
                        "'" + dir.file("flipped.gz") + "' is a truncated or corrupt gzip file");
  // One flipped byte late in the payload keeps the deflate stream valid: only the CRC catches it.
  gz = test::slurp(dir.file("full.gz"));
  gz[gz.size() - 9] = static_cast<char>(gz[gz.size() - 9] ^ 0x01);  // last byte before trailer
  test::write_shared(world, dir.file("crc.gz"), gz);
  test::expect_contains(idx_error(world, {dir.file("crc.gz"), ""}), "corrupt gzip file");
}

TEST(IdxErrors, LabelFileDoesNotMatch) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("img"), header(0x08, {12, 2}) + std::string(24, '\1'));
  test::write_shared(world, dir.file("lab"), header(0x08, {10}) + std::string(10, '\1'));
  std::string msg = idx_error(world, {dir.file("img"), dir.file("lab")});
  test::expect_contains(msg, "label count mismatch");
  test::expect_contains(msg, "'" + dir.file("img") + "' has 12 records");
  test::expect_contains(msg, "'" + dir.file("lab") + "' has 10 labels");

  test::write_shared(world, dir.file("flab"), header(0x0D, {12}) + std::string(48, '\0'));
  msg = idx_error(world, {dir.file("img"), dir.file("flab")});
  test::expect_contains(msg, "labels must be integers");
  test::write_shared(world, dir.file("wide"), header(0x08, {12, 2}) + std::string(24, '\0'));
  msg = idx_error(world, {dir.file("img"), dir.file("wide")});
  test::expect_contains(msg, "a labels file must have shape [N]");
  // The labels' own data can be short too (found by the ranks holding the last records).
  test::write_shared(world, dir.file("shortlab.gz"), header(0x08, {12}) + std::string(7, '\1'),
                     true);
  msg = idx_error(world, {dir.file("img"), dir.file("shortlab.gz")});
  test::expect_contains(msg, "'" + dir.file("shortlab.gz") + "' is shorter than its header says");
}

// Found by tests/fuzz (fuzz_idx): a gzip header claiming ~15 GB of records allocated them before
// reading a byte of data, and a header of 0 records but 2^40 features per record asked for 2^40
// feature names. Both are now DataErrors, with memory bounded by the data actually read.
TEST(IdxErrors, HeaderClaimsMoreThanTheDataHolds) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  test::write_shared(world, dir.file("big.gz"), header(0x08, {60000, 500, 500}) + "abc", true);
  std::string msg = idx_error(world, {dir.file("big.gz"), ""});
  test::expect_contains(msg, "is shorter than its header says");
  test::expect_contains(msg, "after decompression");
  test::write_shared(world, dir.file("wide"), header(0x08, {0, 1u << 20, 1u << 20}));
  msg = idx_error(world, {dir.file("wide"), ""});
  test::expect_contains(msg, "has an implausible shape [0, 1048576, 1048576]");
  test::expect_contains(msg, "at most 16777216 are supported");
}
