// CSV input source: each rank parses the lines that start in its byte range of the file.
#pragma once

#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/io/table.hpp"

namespace locus::io {

struct CsvOptions {
  std::string path;
  char delimiter = ',';
  std::string label_column;                  // "" = no labels
  std::vector<std::string> feature_columns;  // empty = every column except the label
};

// Collective over comm. The first line is the header (column names, whitespace trimmed,
// surrounding double quotes and a UTF-8 BOM stripped; names must be unique). The rest of the
// file is split into comm.size() byte ranges; rank r parses every line that STARTS in its
// range, so each line is parsed by exactly one rank and rank r's rows precede rank r+1's.
// Only selected columns are parsed (unselected columns may hold text); each row must have
// exactly one field per header column. Features parse as float (std::from_chars; an
// optional '+', surrounding quotes and nan/inf in any case are accepted), labels as int32.
// Lines ending in \r\n are accepted, the final newline is optional, and blank (whitespace
// only) lines are skipped anywhere, as pandas does by default. Quoting is only stripped, never
// interpreted: a delimiter or newline inside quotes is not supported (numeric data has none).
//
// Throws DataError, identical on every rank, naming the file, the 1-based line number, the
// column and the value: missing file, no data rows, missing label / feature column (listing
// the columns and suggesting the closest name), ragged row, empty field, non-numeric value,
// non-integer label. Throws ConfigError for contradictory options (a column both label and
// feature, a feature listed twice, a delimiter of '"', '\r' or '\n').
Table read_csv(const mpi::Comm& comm, const CsvOptions& opts);

}  // namespace locus::io
