// The per-rank scoring loop (private): claims units from the work queue, reads them on the
// I/O (main) thread stripe by stripe just ahead of the compute thread's forward passes, and
// post-processes and writes results that won. Only the main thread calls MPI and HDF5.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "locus/comm/queue_progress.hpp"
#include "locus/infer/infer.hpp"
#include "locus/infer/prediction_file.hpp"
#include "locus/infer/scorer.hpp"
#include "locus/infer/work_queue.hpp"
#include "compute_thread.hpp"
#include "engine.hpp"
#include "input.hpp"
#include "locus/io/dataset.hpp"

namespace locus::infer::detail {

// Unit u of a run covers absolute unit k = first_unit + u: rows [k * unit_rows, (k + 1) *
// unit_rows) clipped to [row_begin, row_end). Units and batches sit on an absolute grid, so a
// row is scored identically by a full run and by any incremental run.
struct UnitGrid {
  std::uint64_t row_begin = 0, row_end = 0, unit_rows = 1;
  std::uint64_t first_unit() const { return row_begin / unit_rows; }
  std::int64_t units() const {
    if (row_end <= row_begin) return 0;
    return static_cast<std::int64_t>((row_end + unit_rows - 1) / unit_rows - first_unit());
  }
  std::uint64_t origin(std::int64_t u) const {
    return (first_unit() + static_cast<std::uint64_t>(u)) * unit_rows;
  }
  h5::RowRange rows(std::int64_t u) const {
    const std::uint64_t lo = std::max(origin(u), row_begin);
    const std::uint64_t hi = std::min(origin(u) + unit_rows, row_end);
    return {lo, hi - lo};
  }
};

struct LoopResult {
  RankStats stats;
  Metrics metrics;                  // merged over this rank's won units (log_loss_sum unused)
  std::vector<double> unit_loss;    // per unit: its log-loss sum if this rank won it, else 0
};

// Rows per stripe (see compute_thread.hpp): read_rows rounded up to a multiple of the batch,
// or about 2 MiB of features when read_rows is 0; at most the unit (rounded up likewise).
std::uint64_t stripe_rows(std::uint64_t read_rows, std::uint64_t batch_rows,
                          std::uint64_t unit_rows, std::uint64_t cols);

// Local to this rank except for the one-sided queue operations; every rank calls it once.
// Polls the ticker between the loop's steps and while it waits for the compute thread; a won
// unit counts its rows.
LoopResult run_units(WorkQueue& queue, const UnitGrid& grid, Engine& engine,
                     LocalInput& input, PredictionFile& out, int rank,
                     const SlowDown& slow, std::uint64_t read_rows,
                     comm::ProgressTicker& ticker);

}  // namespace locus::infer::detail
