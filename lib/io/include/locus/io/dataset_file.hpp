// The locus dataset file (docs/FORMATS.md): /features float32 [N, D], optional /labels int32
// [N], and attributes for schema, statistics, normalization and provenance. Readers use the
// `committed_rows` attribute, written last, as the row count.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "locus/io/compression.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "locus/io/gates.hpp"
#include "locus/io/stats.hpp"
#include "locus/io/table.hpp"

namespace locus::io {

inline constexpr std::int64_t kDatasetSchemaVersion = 1;
inline constexpr const char* kDatasetFormat = "locus-dataset";

struct Provenance {
  std::vector<SourceFile> sources;  // every input ever ingested into this file, in order
  std::string tool_version;
  std::string git_revision;
  std::string config;               // effective config (INI) of the latest ingest
};

struct DatasetMeta {
  std::int64_t schema_version = kDatasetSchemaVersion;
  std::int64_t rows = 0;          // committed rows
  std::int64_t cols = 0;
  std::int64_t num_classes = 0;   // 0: unchecked / not a classification set
  bool has_labels = false;
  std::vector<std::string> feature_names;
  std::string label_name;
  FeatureStats stats;             // of the raw (un-normalized) features
  Histogram histogram;            // raw features over [stats.min, stats.max] at ingest time
  NormalizationParams normalization;
  Provenance provenance;
};

// Rows per chunk of /features when chunk_rows is 0: about 1 MiB uncompressed, about 256 KiB
// (of uncompressed rows) compressed. A chunk always spans whole rows (every reader reads rows).
// A compressed chunk is decompressed whole by any read that touches it, so smaller chunks cost
// less for a few scattered rows (the loader's per-batch reads), while deflate's ratio hardly
// changes (Fashion-MNIST: 1 MiB chunks store 1% less than 256 KiB ones;
// bench/io/run_compression_bench.sh). Much smaller chunks mean more chunk-index entries and
// more per-chunk work in parallel HDF5's collective filtered writes.
std::uint64_t default_chunk_rows(std::uint64_t cols, const Compression& compression);

// Collective over file.comm(): creates /features (and /labels) sized for `total_rows`, writes
// this rank's rows of `local` at `first_row`, then every attribute of `meta`, committed_rows
// last. All ranks pass the same meta. With compression, both datasets get the shuffle and
// deflate filters (docs/FORMATS.md).
void write_dataset(h5::File& file, const Table& local, std::uint64_t first_row,
                   std::uint64_t total_rows, const DatasetMeta& meta, std::uint64_t chunk_rows = 0,
                   const Compression& compression = {});
// The same, with this rank's rows at several ascending file row ranges (`local` holds them back
// to back in that order): one collective write of a union of hyperslabs (Dataset::
// write_row_ranges). locus-ingest writes the units each rank won this way.
void write_dataset(h5::File& file, const Table& local, std::span<const h5::RowRange> rows,
                   std::uint64_t total_rows, const DatasetMeta& meta, std::uint64_t chunk_rows = 0,
                   const Compression& compression = {});

// Collective over file.comm(): grows the datasets by the rows of every rank's `local`, writes
// this rank's rows at `first_row` (≥ the old committed_rows), then the new attributes with
// committed_rows last.
void append_dataset(h5::File& file, const Table& local, std::uint64_t first_row,
                    std::uint64_t total_rows, const DatasetMeta& meta);
void append_dataset(h5::File& file, const Table& local, std::span<const h5::RowRange> rows,
                    std::uint64_t total_rows, const DatasetMeta& meta);

// Collective: reads and validates the attributes of a locus dataset. A file that is not a
// locus dataset, or one of a newer schema version, is a DataError naming it.
DatasetMeta read_meta(h5::File& file);

// Throws DataError naming the file unless append_dataset can grow it: parallel HDF5 only
// writes new chunks of unfiltered datasets allocated early (as write_dataset creates them);
// compressed chunks as write_dataset creates them (shuffle + deflate, never filled) it
// allocates in the collective write itself. An append keeps the dataset's compression.
void check_appendable(h5::File& file);

// Collective: reads rows [range) of /features (and /labels) into a Table.
Table read_rows(h5::File& file, const DatasetMeta& meta, h5::RowRange range);

// The drift reference view of a dataset's statistics.
ReferenceStats reference_stats(const DatasetMeta& meta, const std::string& path);

}  // namespace locus::io
