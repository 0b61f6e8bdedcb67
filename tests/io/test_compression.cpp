// ingest.compression (compression.cpp, Dataset::create's filters, write_dataset, --append):
// a deflate ingest stores bitwise the values and attributes of an uncompressed one in a smaller
// file, with shuffle + deflate at the requested level in the filter pipeline, at every rank
// count and chunk shape; the collective write really is collective (a rank with no rows takes
// part with an empty selection); an append to a compressed dataset equals a full ingest and
// keeps the filters; the option's parser refuses what it must.
#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "locus/io/compression.hpp"
#include "locus/io/dataset_file.hpp"
#include "locus/io/ingest.hpp"
#include "dataset_read_back.hpp"
#include "sources_test_util.hpp"

using namespace locus;
using test::ReadBack;
using test::read_back;

namespace {

constexpr std::uint32_t kSide = 12;  // 144 features

// A Fashion-MNIST-like IDX pair: a bright blob on a black background (most pixels 0), the
// blob's size and brightness varying per record; labels 0-9.
struct Idx {
  std::string images, labels;
};

Idx make_idx(std::uint32_t n, std::uint32_t seed) {
  Idx f{{'\0', '\0', '\x08', '\x03'}, {'\0', '\0', '\x08', '\x01'}};
  auto be32 = [](std::string& s, std::uint32_t v) {
    for (int k = 3; k >= 0; --k) s.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
  };
  be32(f.images, n), be32(f.images, kSide), be32(f.images, kSide), be32(f.labels, n);
  for (std::uint32_t i = 0; i < n; ++i) {
    const std::uint32_t r = (i * 2654435761u + seed) >> 7;
    const int radius = 2 + static_cast<int>(r % 4);
    const int c = static_cast<int>(kSide) / 2;
    for (int y = 0; y < static_cast<int>(kSide); ++y) {
      for (int x = 0; x < static_cast<int>(kSide); ++x) {
        const int d2 = (x - c) * (x - c) + (y - c) * (y - c);
        const int v = d2 <= radius * radius ? 255 - 9 * d2 - static_cast<int>((r >> 3) % 40) : 0;
        f.images.push_back(static_cast<char>(std::max(v, 0)));
      }
    }
    f.labels.push_back(static_cast<char>(r % 10));
  }
  return f;
}

io::IngestOptions idx_options(const std::string& dir, const std::string& out,
                              const std::string& compression, std::uint64_t chunk_rows) {
  io::IngestOptions o;
  o.idx = {dir + "/img", dir + "/lbl"};
  o.output = out;
  o.overwrite = true;
  o.normalize = io::Normalization::minmax;
  o.unit_bytes = 23 * kSide * kSide;  // 23 records per unit: units and chunks do not line up
  o.chunk_rows = chunk_rows;
  o.compression = io::parse_compression(compression);
  return o;
}

template <class T> bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Everything read_meta gives, compared bit for bit (provenance config aside: it is the
// effective INI, empty here).
void expect_same_meta(const io::DatasetMeta& a, const io::DatasetMeta& b) {
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(a.cols, b.cols);
  EXPECT_EQ(a.stats.count, b.stats.count);
  EXPECT_TRUE(same_bits(a.stats.mean, b.stats.mean));
  EXPECT_TRUE(same_bits(a.stats.m2, b.stats.m2));
  EXPECT_TRUE(same_bits(a.stats.min, b.stats.min));
  EXPECT_TRUE(same_bits(a.stats.max, b.stats.max));
  EXPECT_EQ(a.histogram.counts, b.histogram.counts);
  EXPECT_TRUE(same_bits(a.normalization.offset, b.normalization.offset));
  EXPECT_TRUE(same_bits(a.normalization.scale, b.normalization.scale));
  ASSERT_EQ(a.provenance.sources.size(), b.provenance.sources.size());
  for (std::size_t i = 0; i < a.provenance.sources.size(); ++i) {
    EXPECT_EQ(a.provenance.sources[i].crc32, b.provenance.sources[i].crc32) << "source_crc32";
    EXPECT_EQ(a.provenance.sources[i].bytes, b.provenance.sources[i].bytes);
  }
}

struct Filters {
  std::vector<H5Z_filter_t> ids;
  std::vector<unsigned> deflate_values;
  std::array<hsize_t, 2> chunk{0, 0};
};

// The filter pipeline and chunk shape of a dataset, straight from H5Pget_filter2.
Filters filters_of(const mpi::Comm& comm, const std::string& path, const char* name) {
  h5::File f = h5::File::open(comm, path, h5::File::Mode::read);
  h5::Id d(LOCUS_H5_CHECK(H5Dopen2(f.id(), name, H5P_DEFAULT)));
  h5::Id dcpl(LOCUS_H5_CHECK(H5Dget_create_plist(d.get())));
  Filters out;
  const int n = LOCUS_H5_CHECK(H5Pget_nfilters(dcpl.get()));
  for (int i = 0; i < n; ++i) {
    unsigned flags = 0, config = 0;
    std::size_t nvalues = 4;
    std::array<unsigned, 4> values{};
    const H5Z_filter_t id = LOCUS_H5_CHECK(H5Pget_filter2(
        dcpl.get(), static_cast<unsigned>(i), &flags, &nvalues, values.data(), 0, nullptr, &config));
    out.ids.push_back(id);
    if (id == H5Z_FILTER_DEFLATE) out.deflate_values.assign(values.begin(), values.begin() + nvalues);
  }
  const int ndims = LOCUS_H5_CHECK(H5Pget_chunk(dcpl.get(), 2, out.chunk.data()));
  if (ndims == 1) out.chunk[1] = 0;
  return out;
}

std::uint64_t file_size(const std::string& path) { return std::filesystem::file_size(path); }

// Bytes /features takes in the file (compressed chunks as stored).
std::uint64_t stored_bytes(const mpi::Comm& comm, const std::string& path) {
  h5::File f = h5::File::open(comm, path, h5::File::Mode::read);
  h5::Id d(LOCUS_H5_CHECK(H5Dopen2(f.id(), "/features", H5P_DEFAULT)));
  return H5Dget_storage_size(d.get());
}

}  // namespace

TEST(Compression, ParsesTheAllowedValuesAndRefusesTheRest) {
  EXPECT_EQ(io::parse_compression("none").deflate_level, 0);
  EXPECT_EQ(io::parse_compression("deflate").deflate_level, io::kDefaultDeflateLevel);
  for (int l = 1; l <= 9; ++l) {
    EXPECT_EQ(io::parse_compression(fmt::format("deflate:{}", l)).deflate_level, l);
    EXPECT_EQ(io::to_string(io::parse_compression(fmt::format("deflate:{}", l))),
              fmt::format("deflate:{}", l));
  }
  for (const char* bad : {"deflate:10", "deflate:0", "gzip", "deflate:x", "deflate:", "Deflate",
                          "deflate:4 ", "deflate:-1", "lz4", ""}) {
    try {
      io::parse_compression(bad);
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const ConfigError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("ingest.compression"), std::string::npos) << what;
      EXPECT_NE(what.find(fmt::format("'{}'", bad)), std::string::npos) << what;
      EXPECT_NE(what.find("none, deflate or deflate:1 ... deflate:9"), std::string::npos) << what;
    }
  }
  EXPECT_NO_THROW(io::check_compression_available(io::parse_compression("deflate:9")));
}

TEST(Compression, DeflateStoresTheSameValuesAndAttributesInASmallerFile) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Idx idx = make_idx(700, 3);
  test::write_shared(world, dir.file("img"), idx.images);
  test::write_shared(world, dir.file("lbl"), idx.labels);
  // chunk_rows 0: the default shape; 37: many chunks, each shared by the ranks of two units.
  for (const std::uint64_t chunk_rows : {std::uint64_t{0}, std::uint64_t{37}}) {
    SCOPED_TRACE(fmt::format("chunk_rows {}", chunk_rows));
    const std::string plain = dir.file(fmt::format("plain-{}.h5", chunk_rows));
    io::run_ingest(world, idx_options(dir.file(""), plain, "none", chunk_rows));
    const ReadBack want = read_back(world, plain);
    ASSERT_EQ(want.meta.rows, 700);
    EXPECT_TRUE(filters_of(world, plain, "/features").ids.empty());
    for (const int level : {1, 7}) {
      SCOPED_TRACE(fmt::format("deflate:{}", level));
      const std::string packed = dir.file(fmt::format("deflate{}-{}.h5", level, chunk_rows));
      const io::IngestResult r = io::run_ingest(
          world, idx_options(dir.file(""), packed, fmt::format("deflate:{}", level), chunk_rows));
      EXPECT_EQ(r.compression.deflate_level, level);
      const ReadBack got = read_back(world, packed);
      EXPECT_TRUE(same_bits(got.rows.features, want.rows.features)) << "features differ";
      EXPECT_TRUE(same_bits(got.rows.labels, want.rows.labels)) << "labels differ";
      expect_same_meta(got.meta, want.meta);
      // Mostly-black images: the features take a third of their 403 KB or less; the file is
      // smaller too (both carry up to 1 MiB of metadata-block slack, see file.cpp).
      EXPECT_LT(stored_bytes(world, packed) * 3, stored_bytes(world, plain));
      EXPECT_LT(file_size(packed), file_size(plain));
      for (const char* name : {"/features", "/labels"}) {
        const Filters f = filters_of(world, packed, name);
        ASSERT_EQ(f.ids, (std::vector<H5Z_filter_t>{H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE}))
            << name;
        ASSERT_EQ(f.deflate_values, std::vector<unsigned>{static_cast<unsigned>(level)}) << name;
        const std::uint64_t rows = chunk_rows > 0 ? chunk_rows
                                                  : io::default_chunk_rows(kSide * kSide,
                                                                           r.compression);
        EXPECT_EQ(f.chunk[0], rows) << name << ": rows per chunk";
      }
      EXPECT_EQ(filters_of(world, packed, "/features").chunk[1], kSide * kSide)
          << "a chunk spans whole rows";
    }
  }
}

TEST(Compression, CollectiveWriteWithARankThatHasNoRows) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  constexpr std::uint64_t cols = 9, rows = 301;
  const std::string path = dir.file("d.h5");
  // The last rank writes nothing (at 1 rank: everything); the others split the rows unevenly.
  const int writers = std::max(1, world.size() - 1);
  const h5::RowRange mine = world.rank() < writers
                                ? h5::partition_rows(rows, world.rank(), writers)
                                : h5::RowRange{rows, 0};
  std::vector<float> data(mine.count * cols);
  for (std::uint64_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<float>((mine.begin * cols + i) % 17) * 0.25f;
  {
    h5::File f = h5::File::create(world, path);
    {
      h5::Dataset d = h5::Dataset::create(f, {.name = "/x", .rows = rows, .cols = cols,
                                              .chunk_rows = 20, .extendible = true,
                                              .deflate_level = 3});
      d.write_rows<float>(mine.begin, data);
      EXPECT_TRUE(d.last_transfer().collective())
          << "mode " << d.last_transfer().mode << ", no-collective causes local "
          << d.last_transfer().local_no_collective_cause << " global "
          << d.last_transfer().global_no_collective_cause;
    }
    f.close();
  }
  h5::File f = h5::File::open(world, path, h5::File::Mode::read);
  h5::Dataset d = h5::Dataset::open(f, "/x");
  std::vector<float> all(rows * cols);
  d.read_rows<float>(0, all);
  for (std::uint64_t i = 0; i < all.size(); ++i)
    ASSERT_EQ(all[i], static_cast<float>(i % 17) * 0.25f) << "element " << i;
  EXPECT_EQ(io::compression_of(d.id()).deflate_level, 3);
}

TEST(Compression, AppendToACompressedDatasetEqualsAFullIngestAndKeepsTheFilters) {
  mpi::Comm world = mpi::Comm::world();
  test::SharedTempDir dir(world);
  const Idx all = make_idx(500, 11);
  // The first 320 records, then the remaining 180, as two IDX pairs.
  auto part = [&](std::uint32_t first, std::uint32_t n) {
    Idx p = make_idx(n, 0);  // headers for n records
    p.images.replace(16, std::string::npos, all.images.substr(16 + first * kSide * kSide, n * kSide * kSide));
    p.labels.replace(8, std::string::npos, all.labels.substr(8 + first, n));
    return p;
  };
  const Idx a = part(0, 320), b = part(320, 180);
  test::write_shared(world, dir.file("img"), all.images);
  test::write_shared(world, dir.file("lbl"), all.labels);
  if (world.is_root()) {
    std::filesystem::create_directories(dir.file("a"));
    std::filesystem::create_directories(dir.file("b"));
  }
  world.barrier();
  test::write_shared(world, dir.file("a/img"), a.images);
  test::write_shared(world, dir.file("a/lbl"), a.labels);
  test::write_shared(world, dir.file("b/img"), b.images);
  test::write_shared(world, dir.file("b/lbl"), b.labels);

  const std::string full = dir.file("full.h5"), out = dir.file("out.h5");
  // No normalization: an append reuses the first part's, a full ingest fits its own.
  auto options = [&](const std::string& in, const std::string& path, const char* compression) {
    io::IngestOptions o = idx_options(in, path, compression, 29);
    o.normalize = io::Normalization::none;
    return o;
  };
  io::run_ingest(world, options(dir.file(""), full, "none"));
  io::run_ingest(world, options(dir.file("a"), out, "deflate:5"));
  // The append names no compression: the dataset's own filters take the new rows.
  io::IngestOptions o = options(dir.file("b"), out, "none");
  o.overwrite = false;
  o.append = true;
  const io::IngestResult r = io::run_ingest(world, o);
  EXPECT_EQ(r.rows_added, 180);
  EXPECT_EQ(r.compression.deflate_level, 5);
  const ReadBack got = read_back(world, out), want = read_back(world, full);
  ASSERT_EQ(got.meta.rows, 500);
  EXPECT_TRUE(same_bits(got.rows.features, want.rows.features)) << "features differ";
  EXPECT_TRUE(same_bits(got.rows.labels, want.rows.labels)) << "labels differ";
  EXPECT_EQ(got.meta.stats.count, 500);
  EXPECT_TRUE(same_bits(got.meta.stats.min, want.meta.stats.min));
  EXPECT_TRUE(same_bits(got.meta.stats.max, want.meta.stats.max));
  for (const char* name : {"/features", "/labels"}) {
    const Filters f = filters_of(world, out, name);
    EXPECT_EQ(f.ids, (std::vector<H5Z_filter_t>{H5Z_FILTER_SHUFFLE, H5Z_FILTER_DEFLATE})) << name;
    EXPECT_EQ(f.deflate_values, std::vector<unsigned>{5}) << name;
  }
  EXPECT_LT(stored_bytes(world, out) * 3, stored_bytes(world, full));
}
