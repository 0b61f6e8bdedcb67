// Input sources cut into units of work for locus-ingest's dynamic schedule (IDX: a run of
// records; CSV: the lines that start in a byte range). Unit boundaries depend only on the input
// and the unit size, never on the rank count or on which rank parses a unit, so the rows and
// the statistics of a unit are the same bits whoever parses it, and it may be parsed twice.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "locus/comm/error.hpp"
#include "locus/comm/mpi.hpp"
#include "locus/io/csv.hpp"
#include "locus/io/idx.hpp"
#include "locus/io/join.hpp"
#include "locus/io/table.hpp"

namespace locus::io {

// What went wrong in one unit. The message is final except for CSV line errors, whose global
// line number needs the line counts of the earlier units (UnitSource::describe).
struct UnitError {
  ErrorKind kind = ErrorKind::data;
  std::string message;
  std::int64_t line = -1;  // CSV: the offending line, 0-based among the unit's lines; -1: none
};

// A row of the input whose ingest.join key the join table lacks (left out of the rows).
struct JoinMiss {
  std::int64_t line = -1;  // 0-based among the unit's lines, as UnitError::line
  std::string key;
};

struct UnitParse {
  std::int64_t lines = 0;   // CSV: physical lines that start in the unit (blank ones included)
  bool abandoned = false;   // keep_going() said stop: the rows appended are incomplete
  std::optional<UnitError> error;
  std::int64_t join_missing = 0;          // rows left out for a key the join table lacks
  std::optional<JoinMiss> first_missing;  // the first of them
};

class UnitSource {
 public:
  virtual ~UnitSource() = default;

  // Units 0..units()-1 (at least 1: an empty input is one empty unit).
  virtual std::int64_t units() const = 0;
  // Input bytes per unit (IDX: of the decompressed records; the last unit may hold fewer).
  virtual std::uint64_t unit_bytes() const = 0;
  // A Table without rows with the source's columns, names and labels flag (the same on every
  // rank).
  virtual const Table& header() const = 0;
  // Local (no communication): parses unit u, appending its rows to t, which has header()'s
  // columns. Calls keep_going() about every MiB of input and stops, returning abandoned, when it
  // says false. Never throws for bad data: the error comes back in the result, so every rank
  // still reaches the collectives after its units.
  virtual UnitParse parse(std::int64_t unit, Table& t, const std::function<bool()>& keep_going) = 0;
  // The message of an error of some unit after `lines_before` lines of the units before it.
  virtual std::string describe(const UnitError& e, std::int64_t lines_before) const = 0;
  // Local: throws DataError when the input's total row count is not acceptable (CSV: no data
  // rows), the same on every rank.
  virtual void check_total_rows(std::int64_t rows) const { (void)rows; }
};

// The unit size when none is configured (unit_bytes = 0): 1/64 of the input's bytes (IDX: the
// decompressed records), at least 1 MiB and at most 16 MiB -- enough units for 2-4 ranks to
// balance and re-run on MNIST-sized inputs (47 MB: 45 units), few enough per-unit records on
// multi-GB ones (16 MiB units: 64 per GiB).
std::uint64_t auto_unit_bytes(std::uint64_t input_bytes);

// Collective over comm: opens the IDX images (and labels) file and checks the headers as
// read_idx does (errors agreed on every rank). A unit is max(1, unit_bytes / record bytes)
// records (unit_bytes = 0: auto_unit_bytes). Each rank reads its units through its own
// streams: positional reads for plain files; for gzip a forward-only zlib stream that skips by
// decompressing, reopened (decompressing from the start again) when a unit lies before the
// stream's position. The unit holding the last record also reads to the end of the stream (the
// gzip CRC check and trailing data, as read_idx).
std::unique_ptr<UnitSource> open_idx_units(const mpi::Comm& comm, const IdxOptions& opts,
                                           std::uint64_t unit_bytes);

// Collective over comm: opens the CSV file and reads its header as read_csv does (errors agreed).
// Unit u is the lines that start in bytes [b + u·unit_bytes, b + (u+1)·unit_bytes) after the
// header (b: the first data byte; rank 0's file size ends the last unit), parsed as read_csv
// parses a rank's range. With a join table, its key column (join->key()) must be in the header
// and is no feature; each row gets the key's join->columns() appended after the input's
// features, and a row whose key the table lacks is left out and counted (join_missing).
std::unique_ptr<UnitSource> open_csv_units(const mpi::Comm& comm, const CsvOptions& opts,
                                           std::uint64_t unit_bytes,
                                           std::shared_ptr<const JoinTable> join = nullptr);

}  // namespace locus::io
