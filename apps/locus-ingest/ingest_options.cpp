// Option registration and validation for locus-ingest.
#include "ingest_options.hpp"

#include <fmt/format.h>

namespace locus::app {

void IngestSettings::register_options(Config& c) {
  c.add_choice("ingest.source", source, {"idx", "csv"}, "input format");
  c.add("ingest.images", images, "IDX images file [N, ...] (gzip or plain)");
  c.add("ingest.labels", labels, "IDX labels file [N] (empty: no labels)");
  c.add("ingest.csv", csv, "CSV input file with a header line");
  c.add("ingest.csv_label", csv_label, "CSV label column name (empty: no labels)");
  c.add("ingest.csv_features", csv_features,
        "comma-separated CSV feature columns (empty: all but the label)");
  c.add("ingest.csv_delimiter", csv_delimiter, "CSV field delimiter (one character)",
        [](const std::string& v) { return v.size() == 1 ? "" : "exactly one character"; });
  c.add("ingest.output", output, "dataset file to publish");
  c.add("ingest.report", report, "gate report JSON (empty: <output>.gates.json)");
  c.add_choice("ingest.normalize", normalize, {"none", "standardize", "minmax"},
               "feature normalization applied before writing");
  c.add("ingest.num_classes", num_classes, "number of classes; labels must lie in [0, n) (0: unchecked)",
        at_least(0));
  c.add("ingest.chunk_rows", chunk_rows, "HDF5 chunk rows (0: about 1 MiB per chunk)", at_least(0));
  c.add("ingest.compression", compression,
        "none, or deflate[:level] (1-9, default 4): the shuffle and deflate filters on "
        "/features and /labels of a new dataset (an --append keeps the dataset's own)",
        [](const std::string& v) {
          try {
            io::parse_compression(v);
            return std::string();
          } catch (const ConfigError&) {
            return std::string(io::kCompressionAllowed);
          }
        });
  add_watchdog_option(c, "ingest.watchdog_s", watchdog_s);
  add_progress_option(c, "ingest.progress_s", progress_s);
  add_prometheus_option(c, "ingest.prometheus", prometheus);
  c.add("ingest.unit_bytes", unit_bytes,
        "input bytes per work unit handed out to the ranks (IDX: whole records of the "
        "decompressed data; 0: 1/64 of the input, between 1 MiB and 16 MiB); the statistics "
        "depend on it, never on the rank count or the schedule", at_least(0));
  c.add_choice("ingest.schedule", schedule, {"dynamic", "static"},
               "dynamic: units from a shared counter, faster ranks take more; static: rank r "
               "parses the r-th block of units, no speculation (a benchmark baseline)");
  c.add("ingest.speculate", speculate,
        "when no unit is left, re-run units still in flight on slower ranks (the first result "
        "wins)");
  c.add("ingest.join", join,
        "small CSV table broadcast to every rank and joined to each input row by ingest.join_key "
        "(CSV input only; empty: no join)");
  c.add("ingest.join_key", join_key,
        "column of both tables matching a row to its join row, compared as text; not a feature");
  c.add("ingest.join_columns", join_columns,
        "comma-separated numeric columns of ingest.join added as features, in this order (empty: "
        "all but the key)");
  c.add("ingest.join_max_mb", join_max_mb,
        "largest ingest.join table accepted (MiB); every rank holds a copy",
        in_range(std::int64_t{1}, std::int64_t{2047}));
  c.add("gates.features", features, "required feature count (0: unchecked)", at_least(0));
  c.add("gates.require_labels", require_labels, "fail when the input has no labels");
  c.add_choice("gates.nonfinite", nonfinite, {"fail", "drop"},
               "rows with NaN/Inf features: fail the gate, or drop them (counted)");
  c.add_choice("gates.join_missing", join_missing, {"fail", "drop"},
               "rows whose ingest.join_key the join table lacks: fail the gate, or drop them "
               "(counted)");
  c.add("gates.min_rows", min_rows, "minimum row count (0: unchecked)", at_least(0));
  c.add("gates.max_rows", max_rows, "maximum row count (0: unchecked)", at_least(0));
  c.add("gates.reference", reference, "reference dataset for the count and drift gates");
  c.add("gates.rows_within_pct", rows_within_pct,
        "row count within this % of the reference's (negative: unchecked)");
  c.add("gates.max_mean_shift", max_mean_shift,
        "max |mean - ref mean| / ref std over features (negative: unchecked)");
  c.add("gates.max_psi", max_psi,
        "max population stability index over features (negative: unchecked)");
  c.add("gates.psi_bins", psi_bins, "histogram bins stored for drift checks", in_range(std::int64_t{2}, std::int64_t{1000}));
  c.flag("validate-only", validate_only, "run the gates and write the report, publish nothing");
  c.flag("append", append, "add the input's rows to the existing output");
  c.flag("overwrite", overwrite, "replace an existing output");
}

io::IngestOptions IngestSettings::to_options(const Config& c) const {
  io::IngestOptions o;
  o.source = source == "csv" ? io::IngestOptions::Source::csv : io::IngestOptions::Source::idx;
  if (o.source == io::IngestOptions::Source::idx && images.empty())
    throw ConfigError("ingest.source = idx needs ingest.images (the IDX images file)");
  if (o.source == io::IngestOptions::Source::csv && csv.empty())
    throw ConfigError("ingest.source = csv needs ingest.csv (the CSV file)");
  o.idx = {images, labels};
  o.csv.path = csv;
  o.csv.delimiter = csv_delimiter.empty() ? ',' : csv_delimiter[0];
  o.csv.label_column = csv_label;
  o.csv.feature_columns = parse_word_list(csv_features);
  if (join.empty() && (!join_key.empty() || !join_columns.empty()))
    throw ConfigError("ingest.join_key and ingest.join_columns need ingest.join (the table to "
                      "join); set it, or unset them");
  o.join.path = join;
  o.join.key = join_key;
  o.join.columns = parse_word_list(join_columns);
  o.join.max_bytes = static_cast<std::uint64_t>(join_max_mb) << 20;
  o.output = output;
  o.report = report;
  o.normalize = io::parse_normalization(normalize);
  o.num_classes = num_classes;
  o.chunk_rows = static_cast<std::uint64_t>(chunk_rows);
  o.compression = io::parse_compression(compression);
  o.unit_bytes = static_cast<std::uint64_t>(unit_bytes);
  o.schedule = schedule == "static" ? comm::Schedule::static_blocks : comm::Schedule::dynamic;
  o.speculate = speculate;
  o.progress_s = progress_s;
  if (features > 0) o.gates.features = features;
  o.gates.require_labels = require_labels;
  o.gates.drop_nonfinite = nonfinite == "drop";
  o.gates.drop_join_missing = join_missing == "drop";
  if (min_rows > 0) o.gates.min_rows = min_rows;
  if (max_rows > 0) o.gates.max_rows = max_rows;
  if (min_rows > 0 && max_rows > 0 && min_rows > max_rows) {
    throw ConfigError(fmt::format("gates.min_rows = {} exceeds gates.max_rows = {}", min_rows,
                                  max_rows));
  }
  const bool drift = rows_within_pct >= 0 || max_mean_shift >= 0 || max_psi >= 0;
  if (drift && reference.empty()) {
    throw ConfigError("gates.rows_within_pct, gates.max_mean_shift and gates.max_psi compare "
                      "against a reference dataset: set gates.reference");
  }
  if (rows_within_pct >= 0) o.gates.rows_within_pct = rows_within_pct;
  if (max_mean_shift >= 0) o.gates.max_mean_shift = max_mean_shift;
  if (max_psi >= 0) o.gates.max_psi = max_psi;
  o.gates.psi_bins = static_cast<int>(psi_bins);
  o.reference = reference;
  o.validate_only = validate_only;
  o.append = append;
  o.overwrite = overwrite;
  o.effective_config = c.effective_ini();
  return o;
}

}  // namespace locus::app
