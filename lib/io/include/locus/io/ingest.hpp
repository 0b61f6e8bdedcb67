// The ingest pipeline behind locus-ingest: every rank parses its own share of the input,
// statistics are merged map-side, quality gates run before anything is written, and the
// dataset is published atomically (or appended to a copy that replaces the original).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/io/csv.hpp"
#include "locus/io/dataset_file.hpp"
#include "locus/io/gates.hpp"
#include "locus/io/idx.hpp"
#include "locus/io/stats.hpp"

namespace locus::io {

struct IngestOptions {
  enum class Source { idx, csv };
  Source source = Source::idx;
  IdxOptions idx;
  CsvOptions csv;
  std::string output;              // final dataset path
  std::string report;              // gate report (JSON); "" → "<output>.gates.json"
  Normalization normalize = Normalization::none;
  std::int64_t num_classes = 0;    // recorded; with gates it bounds the labels
  std::uint64_t chunk_rows = 0;    // 0 → about 1 MiB per chunk
  GateConfig gates;
  std::string reference;           // reference dataset for record-count and drift gates
  bool validate_only = false;      // run the gates, write only the report
  bool append = false;             // add rows to an existing output
  bool overwrite = false;          // replace an existing output
  std::string effective_config;    // recorded in the provenance
};

struct IngestResult {
  GateReport report;
  DatasetMeta meta;                // of the published dataset (after an append: of the whole)
  std::int64_t rows_added = 0;
  std::uint64_t input_bytes = 0;   // bytes of the input files (as stored)
  double seconds_parse = 0, seconds_gates = 0, seconds_write = 0;
  bool published = false;
  // --append only: the inputs are already the dataset's last recorded sources (same paths,
  // sizes and CRC-32s), i.e. this append was done before, typically by a run that was killed
  // or preempted after its publication and then rerun. Nothing was read or written.
  bool already_appended = false;
};

// Collective over comm. Throws GateError (agreed, after writing the JSON report) when a gate
// fails; ConfigError/DataError/IoError for bad options, inputs or outputs. Publishes nothing
// unless every gate passed and every rank wrote its rows.
IngestResult run_ingest(const mpi::Comm& comm, const IngestOptions& opts);

// Collective over comm: opens a published dataset and reads its metadata.
DatasetMeta read_dataset_meta(const mpi::Comm& comm, const std::string& path);

}  // namespace locus::io
