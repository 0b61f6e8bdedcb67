// The parse phase of locus-ingest (private): units of the input handed out through the
// one-sided work queue, speculative re-runs of units still in flight on slower ranks, and the
// schedule-independent results -- each rank's won units in unit order, their rows in the
// dataset, and statistics merged in unit order.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/comm/queue_progress.hpp"
#include "locus/comm/work_queue.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/gates.hpp"
#include "locus/io/ingest.hpp"
#include "locus/io/stats.hpp"
#include "locus/io/unit_source.hpp"

namespace locus::io::detail {

struct UnitLoopOptions {
  comm::Schedule schedule = comm::Schedule::dynamic;
  bool speculate = true;
  bool drop_nonfinite = false;  // drop rows with NaN/Inf per unit (else keep them for the gate)
  double progress_s = 0;        // IngestOptions's
  comm::ProgressTicker::Sink on_progress;
};

struct ParsedUnits {
  Table table;                          // this rank's won units, in unit order, back to back
  std::vector<h5::RowRange> file_rows;  // where those rows go (adjacent units merged), ascending
  std::vector<RowRun> runs;             // the same for the gates' row numbers
  FeatureStats stats;                   // of all units, merged in unit order (every rank)
  std::int64_t rows = 0;                // over all units, after dropping (every rank)
  std::int64_t dropped = 0;             // rows dropped for NaN/Inf (every rank)
  std::int64_t join_missing = 0;        // rows left out: the join table lacks their key (every rank)
  std::string join_missing_first;       // the first of them, "'in.csv' line 57: key 'x'" (every rank)
  IngestSchedule schedule;              // every rank's counts (every rank)
  double seconds = 0;  // since the first unit was handed out, by this rank's progress clock
};

// Collective over comm: parses every unit of src exactly once as far as the results go (a unit
// parsed by two ranks counts once: the first to finish keeps it, the other discards its rows
// and statistics), then agrees on errors -- the error of the lowest failing unit, with its CSV
// line number counted over the earlier units, thrown on every rank -- and on the totals.
// LOCUS_TEST_HOOK=ingest-unit:slow<F>@r / delay<MS>@r makes world rank r slower per unit.
ParsedUnits parse_units(const mpi::Comm& comm, UnitSource& src, const UnitLoopOptions& opts);

}  // namespace locus::io::detail
