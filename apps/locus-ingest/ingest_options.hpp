// The [ingest] and [gates] config sections of locus-ingest and their mapping onto
// io::IngestOptions.
#pragma once

#include <cstdint>
#include <string>

#include "config.hpp"
#include "locus/io/ingest.hpp"

namespace locus::app {

struct IngestSettings {
  // [ingest]
  std::string source = "idx";
  std::string images, labels, csv, csv_label, csv_features, csv_delimiter = ",";
  std::string output, report, normalize = "none", compression = "none", prometheus;
  std::int64_t num_classes = 0, chunk_rows = 0, unit_bytes = 0;
  std::string schedule = "dynamic";
  bool speculate = true;
  std::string join, join_key, join_columns;
  std::int64_t join_max_mb = 256;
  double watchdog_s = kWatchdogDefaultS, progress_s = kProgressDefaultS;
  // [gates]
  std::int64_t features = 0, min_rows = 0, max_rows = 0, psi_bins = 10;
  bool require_labels = false;
  std::string nonfinite = "fail", join_missing = "fail", reference;
  double rows_within_pct = -1, max_mean_shift = -1, max_psi = -1;
  // command-line switches
  bool validate_only = false, append = false, overwrite = false;

  void register_options(Config& c);
  io::IngestOptions to_options(const Config& c) const;
};

// The embedded default pipeline config (configs/fashion-mnist.ini at build time).
const std::string& default_pipeline_config();

}  // namespace locus::app
