// read_idx: every rank's share, concatenated in rank order, equals a serial decode done in the
// test (Fashion-MNIST and crafted files of every dtype, plain and gzip); every malformed file
// raises one agreed DataError that names the file.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cstring>
#include <random>

#include "locus/io/idx.hpp"
#include "sources_test_util.hpp"

using namespace locus;

namespace {

const std::string kFashion = "/usr/share/datasets/fashion-mnist/";

void put_be(std::string& out, std::uint64_t v, int bytes) {
  for (int b = bytes - 1; b >= 0; --b) out.push_back(static_cast<char>((v >> (8 * b)) & 0xff));
}

std::string idx_header(std::uint8_t dtype, const std::vector<std::uint32_t>& dims) {
  std::string out{'\0', '\0', static_cast<char>(dtype), static_cast<char>(dims.size())};
  for (auto d : dims) put_be(out, d, 4);
  return out;
}

// A crafted IDX file: element i holds value(i) in the given dtype. Returns the bytes and the
// float each element must decode to.
struct Crafted {
  std::string bytes;
  std::vector<float> expected;
};

Crafted craft(std::uint8_t dtype, const std::vector<std::uint32_t>& dims) {
  Crafted c;
  c.bytes = idx_header(dtype, dims);
  std::uint64_t n = 1;
  for (auto d : dims) n *= d;
  for (std::uint64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::int64_t>(i);
    switch (dtype) {
      case 0x08:
        put_be(c.bytes, static_cast<std::uint64_t>((k * 7) % 256), 1);
        c.expected.push_back(static_cast<float>((k * 7) % 256));
        break;
      case 0x09: {
        const auto v = static_cast<std::int8_t>((k * 7) % 256 - 128);
        put_be(c.bytes, static_cast<std::uint8_t>(v), 1);
        c.expected.push_back(v);
        break;
      }
      case 0x0B: {
        const auto v = static_cast<std::int16_t>((k * 997) % 65536 - 32768);
        put_be(c.bytes, static_cast<std::uint16_t>(v), 2);
        c.expected.push_back(v);
        break;
      }
      case 0x0C: {
        const auto v = static_cast<std::int32_t>((k * 1000003) % 16777216 - 8388608);
        put_be(c.bytes, static_cast<std::uint32_t>(v), 4);
        c.expected.push_back(static_cast<float>(v));
        break;
      }
      case 0x0D: {
        const float v = static_cast<float>(k) * 0.37f - 5.0f;
        std::uint32_t u;
        std::memcpy(&u, &v, 4);
        put_be(c.bytes, u, 4);
        c.expected.push_back(v);
        break;
      }
      case 0x0E: {
        const double v = static_cast<double>(k) * 0.123456789 - 7.0;
        std::uint64_t u;
        std::memcpy(&u, &v, 8);
        put_be(c.bytes, u, 8);
        c.expected.push_back(static_cast<float>(v));
        break;
      }
      default: ADD_FAILURE() << "bad dtype";
    }
  }
  return c;
}

// This rank's rows must be rows [offset, offset + rows) of the serial reference, and the
// ranks together must hold all of them in order.
void expect_share(const mpi::Comm& comm, const io::Table& t, const std::vector<float>& all,
                  std::int64_t n, std::int64_t d) {
  ASSERT_EQ(t.cols, d);
  const std::int64_t offset = comm.exscan_sum(t.rows());
  EXPECT_EQ(comm.allreduce<std::int64_t>(t.rows(), MPI_SUM), n);
  // Balanced partition: the first n % size ranks get one extra record.
  EXPECT_EQ(t.rows(), n / comm.size() + (comm.rank() < n % comm.size() ? 1 : 0));
  ASSERT_LE((offset + t.rows()) * d, static_cast<std::int64_t>(all.size()));
  EXPECT_TRUE(t.features.empty() || std::memcmp(t.features.data(), all.data() + offset * d,
                                                t.features.size() * sizeof(float)) == 0)
      << "rank " << comm.rank() << " rows differ from the serial decode";
}

std::string gunzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  EXPECT_NE(f, nullptr) << path;
  std::string out;
  char buf[1 << 16];
  int got = 0;
  while (f != nullptr && (got = gzread(f, buf, sizeof buf)) > 0) out.append(buf, got);
  if (f != nullptr) gzclose(f);
  return out;
}

void check_fashion(const std::string& split, std::int64_t n, std::int64_t first_image_sum,
                   std::int64_t all_pixel_sum) {
  mpi::Comm world = mpi::Comm::world();
  const io::Table t = io::read_idx(world, {kFashion + split + "-images-idx3-ubyte.gz",
                                           kFashion + split + "-labels-idx1-ubyte.gz"});
  const std::string images = gunzip(kFashion + split + "-images-idx3-ubyte.gz");
  const std::string labels = gunzip(kFashion + split + "-labels-idx1-ubyte.gz");
  ASSERT_EQ(images.size(), 16 + static_cast<std::size_t>(n) * 784);
  std::vector<float> ref(images.size() - 16);
  for (std::size_t i = 0; i < ref.size(); ++i) ref[i] = static_cast<unsigned char>(images[16 + i]);
  expect_share(world, t, ref, n, 784);

  ASSERT_TRUE(t.has_labels);
  EXPECT_EQ(t.label_name, "label");
  ASSERT_EQ(t.labels.size(), static_cast<std::size_t>(t.rows()));
  const std::int64_t offset = world.exscan_sum(t.rows());
  std::vector<std::int64_t> hist(10, 0);
  std::int64_t pixels = 0;
  for (std::int64_t r = 0; r < t.rows(); ++r) {
    EXPECT_EQ(t.labels[r], static_cast<unsigned char>(labels[8 + offset + r]));
    if (t.labels[r] >= 0 && t.labels[r] < 10) ++hist[t.labels[r]];
  }
  for (float v : t.features) pixels += static_cast<std::int64_t>(v);
  world.allreduce_inplace(std::span<std::int64_t>(hist), MPI_SUM);
  // Known facts of Fashion-MNIST (checked with numpy): balanced classes, first label 9
  // (ankle boot), and these pixel sums.
  for (auto h : hist) EXPECT_EQ(h, n / 10);
  EXPECT_EQ(world.allreduce(pixels, MPI_SUM), all_pixel_sum);
  if (world.is_root()) {
    EXPECT_EQ(t.labels[0], 9);
    double s = 0;
    for (int i = 0; i < 784; ++i) s += t.features[i];
    EXPECT_EQ(static_cast<std::int64_t>(s), first_image_sum);
  }
  EXPECT_EQ(t.feature_names.size(), 784U);
  EXPECT_EQ(t.feature_names.front(), "pixel0");
  EXPECT_EQ(t.feature_names.back(), "pixel783");
}

}  // namespace

TEST(Idx, FashionMnistTrainMatchesSerialDecode) {
  check_fashion("train", 60000, 76247, 3431114169);
}

TEST(Idx, FashionMnistTestMatchesSerialDecode) {
  check_fashion("t10k", 10000, 33456, 573469082);
}

TEST(Idx, EveryDtypePlainAndGzip) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  for (std::uint8_t dtype : {0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E}) {
    for (bool gz : {false, true}) {
      SCOPED_TRACE(testing::Message() << "dtype " << int(dtype) << (gz ? " gzip" : " plain"));
      const Crafted c = craft(dtype, {37, 3, 2});
      const std::string path = dir.file("d" + std::to_string(dtype) + (gz ? ".idx.gz" : ".idx"));
      test::write_shared(world, path, c.bytes, gz);
      const io::Table t = io::read_idx(world, {path, ""});
      EXPECT_FALSE(t.has_labels);
      expect_share(world, t, c.expected, 37, 6);
    }
  }
}

TEST(Idx, IntegerLabelsOfEveryIntegerDtype) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Crafted images = craft(0x08, {23, 2});
  test::write_shared(world, dir.file("img"), images.bytes);
  for (std::uint8_t dtype : {0x08, 0x09, 0x0B, 0x0C}) {
    for (const auto& dims : {std::vector<std::uint32_t>{23}, std::vector<std::uint32_t>{23, 1}}) {
      const Crafted labels = craft(dtype, dims);
      test::write_shared(world, dir.file("lab"), labels.bytes, dtype == 0x0B);
      const io::Table t = io::read_idx(world, {dir.file("img"), dir.file("lab")});
      ASSERT_TRUE(t.has_labels);
      ASSERT_EQ(t.labels.size(), static_cast<std::size_t>(t.rows()));
      const std::int64_t offset = world.exscan_sum(t.rows());
      for (std::int64_t r = 0; r < t.rows(); ++r)
        EXPECT_EQ(t.labels[r], static_cast<std::int32_t>(labels.expected[offset + r]));
    }
  }
}

TEST(Idx, FewerRecordsThanRanksAndEmptyAndOneDimensional) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  for (bool gz : {false, true}) {
    const Crafted two = craft(0x0D, {2, 5});
    test::write_shared(world, dir.file("two"), two.bytes, gz);
    expect_share(world, io::read_idx(world, {dir.file("two"), ""}), two.expected, 2, 5);

    const Crafted none = craft(0x08, {0, 4});
    test::write_shared(world, dir.file("none"), none.bytes, gz);
    expect_share(world, io::read_idx(world, {dir.file("none"), ""}), none.expected, 0, 4);

    const Crafted flat = craft(0x0B, {9});  // shape [N]: one feature per record
    test::write_shared(world, dir.file("flat"), flat.bytes, gz);
    expect_share(world, io::read_idx(world, {dir.file("flat"), ""}), flat.expected, 9, 1);
  }
}
