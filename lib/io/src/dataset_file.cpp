// Reading and writing the locus dataset layout.
#include "locus/io/dataset_file.hpp"

#include <fmt/format.h>

#include "locus/io/attribute.hpp"

namespace locus::io {

namespace {

template <class T> std::span<const T> cspan(const std::vector<T>& v) { return {v.data(), v.size()}; }

void write_attributes(h5::File& file, const DatasetMeta& m) {
  const hid_t root = file.id();
  h5::write_attr(root, "locus_format", kDatasetFormat);
  h5::write_attr(root, "schema_version", m.schema_version);
  h5::write_attr(root, "num_classes", m.num_classes);
  h5::write_attr(root, "label_name", m.label_name);
  h5::write_attr(root, "tool_version", m.provenance.tool_version);
  h5::write_attr(root, "git_revision", m.provenance.git_revision);
  h5::write_attr(root, "config", m.provenance.config);
  std::vector<std::string> paths;
  std::vector<std::int64_t> bytes, crcs;
  for (const auto& s : m.provenance.sources) {
    paths.push_back(s.path);
    bytes.push_back(static_cast<std::int64_t>(s.bytes));
    crcs.push_back(static_cast<std::int64_t>(s.crc32));
  }
  h5::write_attr(root, "source_files", paths);
  h5::write_attr(root, "source_bytes", cspan(bytes));
  h5::write_attr(root, "source_crc32", cspan(crcs));

  h5::Id features = h5::Id(LOCUS_H5_CHECK(H5Dopen2(root, "/features", H5P_DEFAULT)));
  const hid_t f = features.get();
  h5::write_attr(f, "feature_names", m.feature_names);
  h5::write_attr(f, "count", m.stats.count);
  h5::write_attr(f, "mean", cspan(m.stats.mean));
  h5::write_attr(f, "std", cspan(m.stats.stddev()));
  h5::write_attr(f, "min", cspan(m.stats.min));
  h5::write_attr(f, "max", cspan(m.stats.max));
  h5::write_attr(f, "m2", cspan(m.stats.m2));
  h5::write_attr(f, "hist_bins", static_cast<std::int64_t>(m.histogram.bins));
  h5::write_attr(f, "hist_lo", cspan(m.histogram.lo));
  h5::write_attr(f, "hist_hi", cspan(m.histogram.hi));
  h5::write_attr(f, "hist_counts", cspan(m.histogram.counts));
  h5::write_attr(f, "normalization", std::string(to_string(m.normalization.mode)));
  h5::write_attr(f, "norm_offset", cspan(m.normalization.offset));
  h5::write_attr(f, "norm_scale", cspan(m.normalization.scale));
  // Written last: readers trust only rows below this mark.
  h5::write_attr(root, "committed_rows", m.rows);
}

void write_local_rows(h5::File& file, const Table& local, std::span<const h5::RowRange> rows,
                      bool has_labels) {
  h5::Dataset features = h5::Dataset::open(file, "/features");
  features.write_row_ranges<float>(rows, local.features);
  if (has_labels) {
    h5::Dataset labels = h5::Dataset::open(file, "/labels");
    labels.write_row_ranges<std::int32_t>(rows, local.labels);
  }
}

h5::RowRange all_rows_at(const Table& local, std::uint64_t first_row) {
  return {first_row, static_cast<std::uint64_t>(local.rows())};
}

}  // namespace

std::uint64_t default_chunk_rows(std::uint64_t cols, const Compression& compression) {
  const std::uint64_t target = compression.enabled() ? (256u << 10) : (1u << 20);
  return std::max<std::uint64_t>(1, target / (std::max<std::uint64_t>(cols, 1) * sizeof(float)));
}

void write_dataset(h5::File& file, const Table& local, std::uint64_t first_row,
                   std::uint64_t total_rows, const DatasetMeta& meta, std::uint64_t chunk_rows,
                   const Compression& compression) {
  const h5::RowRange rows = all_rows_at(local, first_row);
  write_dataset(file, local, std::span<const h5::RowRange>(&rows, 1), total_rows, meta,
                chunk_rows, compression);
}

void write_dataset(h5::File& file, const Table& local, std::span<const h5::RowRange> rows,
                   std::uint64_t total_rows, const DatasetMeta& meta, std::uint64_t chunk_rows,
                   const Compression& compression) {
  const auto cols = static_cast<std::uint64_t>(meta.cols);
  const std::uint64_t feature_chunk =
      chunk_rows > 0 ? chunk_rows : default_chunk_rows(cols, compression);
  h5::Dataset::create(file, {.name = "/features", .dtype = h5::Dtype::f32, .rows = total_rows,
                             .cols = cols, .chunk_rows = feature_chunk, .extendible = true,
                             .deflate_level = compression.deflate_level});
  if (meta.has_labels) {
    // Label chunks hold as many rows as feature chunks so an append touches few chunks
    // (uncompressed and chunk_rows 0: about 1 MiB of labels, as before).
    h5::Dataset::create(file, {.name = "/labels", .dtype = h5::Dtype::i32, .rows = total_rows,
                               .chunk_rows = compression.enabled() ? feature_chunk : chunk_rows,
                               .extendible = true, .deflate_level = compression.deflate_level});
  }
  write_local_rows(file, local, rows, meta.has_labels);
  write_attributes(file, meta);
}

void append_dataset(h5::File& file, const Table& local, std::uint64_t first_row,
                    std::uint64_t total_rows, const DatasetMeta& meta) {
  const h5::RowRange rows = all_rows_at(local, first_row);
  append_dataset(file, local, std::span<const h5::RowRange>(&rows, 1), total_rows, meta);
}

void append_dataset(h5::File& file, const Table& local, std::span<const h5::RowRange> rows,
                    std::uint64_t total_rows, const DatasetMeta& meta) {
  {
    h5::Dataset features = h5::Dataset::open(file, "/features");
    features.resize(total_rows);
    if (meta.has_labels) h5::Dataset::open(file, "/labels").resize(total_rows);
  }
  write_local_rows(file, local, rows, meta.has_labels);
  write_attributes(file, meta);
}

void check_appendable(h5::File& file) {
  h5::Dataset features = h5::Dataset::open(file, "/features");
  h5::Id dcpl(LOCUS_H5_CHECK(H5Dget_create_plist(features.id())));
  H5D_alloc_time_t when{};
  LOCUS_H5_CHECK(H5Pget_alloc_time(dcpl.get(), &when));
  H5D_fill_time_t fill{};
  LOCUS_H5_CHECK(H5Pget_fill_time(dcpl.get(), &fill));
  // Compressed chunks as locus-ingest writes them (allocated by the collective write, never
  // filled; see Dataset::create) can be appended to. A filtered dataset written otherwise
  // (h5py's gzip: fill values written when a chunk is allocated) hung the collective append
  // with HDF5 1.10.8, so it is refused like any lazily allocated one.
  const bool locus_filtered =
      compression_of(features.id()).deflate_level > 0 && fill == H5D_FILL_TIME_NEVER;
  if (when != H5D_ALLOC_TIME_EARLY && !locus_filtered) {
    throw DataError(fmt::format("cannot append to '{}': its /features dataset allocates chunks "
                                "lazily (as h5py does by default), which parallel HDF5 cannot "
                                "extend; re-ingest the data with locus-ingest and append to "
                                "that file", file.path()));
  }
}

DatasetMeta read_meta(h5::File& file) {
  const hid_t root = file.id();
  if (!h5::has_attr(root, "locus_format") ||
      h5::read_attr<std::string>(root, "locus_format") != kDatasetFormat) {
    throw DataError(fmt::format("'{}' is not a locus dataset (no locus_format = \"{}\" "
                                "attribute); write it with locus-ingest or see docs/FORMATS.md",
                                file.path(), kDatasetFormat));
  }
  DatasetMeta m;
  m.schema_version = h5::read_attr<std::int64_t>(root, "schema_version");
  if (m.schema_version > kDatasetSchemaVersion) {
    throw DataError(fmt::format("'{}' has dataset schema version {}, newer than this locus "
                                "reads ({}); upgrade locus", file.path(), m.schema_version,
                                kDatasetSchemaVersion));
  }
  m.rows = h5::read_attr<std::int64_t>(root, "committed_rows");
  m.num_classes = h5::read_attr<std::int64_t>(root, "num_classes");
  m.label_name = h5::read_attr<std::string>(root, "label_name");
  m.has_labels = h5::exists(root, "/labels");
  m.provenance.tool_version = h5::read_attr<std::string>(root, "tool_version");
  m.provenance.git_revision = h5::read_attr<std::string>(root, "git_revision");
  m.provenance.config = h5::read_attr<std::string>(root, "config");
  const auto paths = h5::read_attr<std::vector<std::string>>(root, "source_files");
  const auto bytes = h5::read_attr<std::vector<std::int64_t>>(root, "source_bytes");
  const auto crcs = h5::read_attr<std::vector<std::int64_t>>(root, "source_crc32");
  for (std::size_t i = 0; i < paths.size() && i < bytes.size() && i < crcs.size(); ++i) {
    m.provenance.sources.push_back({paths[i], static_cast<std::uint64_t>(bytes[i]),
                                    static_cast<std::uint32_t>(crcs[i])});
  }

  h5::Dataset features = h5::Dataset::open(file, "/features");
  m.cols = static_cast<std::int64_t>(features.cols());
  if (features.rows() < static_cast<std::uint64_t>(m.rows)) {
    throw DataError(fmt::format("'{}': committed_rows = {} but /features has only {} rows; the "
                                "file is damaged, re-ingest it", file.path(), m.rows,
                                features.rows()));
  }
  const hid_t f = features.id();
  m.feature_names = h5::read_attr<std::vector<std::string>>(f, "feature_names");
  m.stats.count = h5::read_attr<std::int64_t>(f, "count");
  m.stats.mean = h5::read_attr<std::vector<double>>(f, "mean");
  m.stats.m2 = h5::read_attr<std::vector<double>>(f, "m2");
  m.stats.min = h5::read_attr<std::vector<double>>(f, "min");
  m.stats.max = h5::read_attr<std::vector<double>>(f, "max");
  m.histogram.bins = static_cast<int>(h5::read_attr<std::int64_t>(f, "hist_bins"));
  m.histogram.lo = h5::read_attr<std::vector<double>>(f, "hist_lo");
  m.histogram.hi = h5::read_attr<std::vector<double>>(f, "hist_hi");
  m.histogram.counts = h5::read_attr<std::vector<std::int64_t>>(f, "hist_counts");
  m.normalization.mode = parse_normalization(h5::read_attr<std::string>(f, "normalization"));
  m.normalization.offset = h5::read_attr<std::vector<double>>(f, "norm_offset");
  m.normalization.scale = h5::read_attr<std::vector<double>>(f, "norm_scale");
  return m;
}

Table read_rows(h5::File& file, const DatasetMeta& meta, h5::RowRange range) {
  Table t;
  t.cols = meta.cols;
  t.has_labels = meta.has_labels;
  t.feature_names = meta.feature_names;
  t.label_name = meta.label_name;
  t.features.resize(range.count * static_cast<std::uint64_t>(meta.cols));
  h5::Dataset::open(file, "/features").read_rows<float>(range.begin, t.features);
  if (meta.has_labels) {
    t.labels.resize(range.count);
    h5::Dataset::open(file, "/labels").read_rows<std::int32_t>(range.begin, t.labels);
  }
  return t;
}

ReferenceStats reference_stats(const DatasetMeta& meta, const std::string& path) {
  return {.path = path, .rows = meta.rows, .cols = meta.cols, .mean = meta.stats.mean,
          .stddev = meta.stats.stddev(), .min = meta.stats.min, .max = meta.stats.max};
}

}  // namespace locus::io
