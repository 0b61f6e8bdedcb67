// Dynamic work distribution (locus-infer's scoring units, locus-ingest's parse units): units
// handed out through an MPI one-sided atomic counter on rank 0, per-unit state (runs, winner,
// writes) in the same window, and speculative re-runs of the oldest unfinished units once the
// counter is spent.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "locus/comm/mpi.hpp"

namespace locus::comm {

// Window layout (int64, on rank 0): a header of counters --
//   [0] the next fresh unit, [1] units won so far, [2] the sum of their amounts (try_win's:
//   rows, bytes), [3] speculative re-runs started --
// then per unit u
//   runs[u]      ranks that started u (fresh claim or speculative re-run),
//   finishers[u] ranks that finished u; the one that moved it from 0 won (its result counts),
//   winner[u]    1 + the winning rank (added by the winner alone),
//   writes[u]    how many times u's rows were written (must end at exactly 1).
// Every operation is an atomic MPI_Fetch_and_op / MPI_Get_accumulate (SUM or NO_OP) inside one
// MPI_Win_lock_all passive-target epoch, so no rank ever waits for another to hand out work.
// MPI_Compare_and_swap is avoided on purpose: Open MPI 4.1's osc/rdma over btl/vader crashes
// in it (open-mpi/ompi#11349); a fetch-and-add that returns 0 elects the winner just as well.
// How fresh units are handed out: dynamic (the shared counter: faster ranks take more) or
// static blocks (rank r takes the r-th contiguous block of units, whatever its speed; no
// speculation): the baseline the benchmarks compare the dynamic schedule with.
enum class Schedule { dynamic, static_blocks };

class WorkQueue {
 public:
  // Collective over comm: a queue of units 0..units-1. A unit is run by at most max_runs
  // ranks at once (1 fresh + max_runs - 1 speculative copies); speculate = false disables
  // re-runs (so does the static schedule).
  WorkQueue(const mpi::Comm& comm, std::int64_t units, bool speculate, int max_runs = 2,
            Schedule schedule = Schedule::dynamic);
  WorkQueue(const WorkQueue&) = delete;
  WorkQueue& operator=(const WorkQueue&) = delete;
  // Frees the window unless finish() did; skipped while an exception unwinds (freeing is
  // collective and peers may not be here: the job then aborts or every rank unwinds alike).
  ~WorkQueue();

  struct Claim {
    std::int64_t unit = -1;    // -1: nothing left for this rank
    bool speculative = false;  // a re-run of a unit another rank already started
  };

  // Local (one-sided). A fresh unit from the counter while any is left; then, with
  // speculation on, the oldest unfinished unit that fewer than max_runs ranks started and
  // that this rank does not hold (`held`: units this rank has claimed and not finished).
  Claim claim(std::span<const std::int64_t> held);
  // Local: whether some rank has won `unit` (its result counts).
  bool finished(std::int64_t unit);
  // Local: claims the result of `unit` for this rank (first finisher wins). True when
  // this rank won: it must then write the unit's rows and call wrote(); `amount` (the unit's
  // size in the caller's measure: rows, bytes) then counts in counts().amount. False when
  // another rank won first: the caller discards its result.
  bool try_win(std::int64_t unit, std::int64_t amount);
  // Local: counts one write of `unit`'s rows (the exactly-once check).
  void wrote(std::int64_t unit);
  // Local: ensures passive-target requests of other ranks make progress on this rank
  // (needed by MPI implementations without asynchronous progress); cheap.
  void progress();

  // How far the whole job is, for progress lines.
  struct Counts {
    std::int64_t units = 0;   // in the queue
    std::int64_t won = 0;     // units some rank won (finished first) so far
    std::int64_t amount = 0;  // the sum of the won units' amounts (try_win)
    std::int64_t reruns = 0;  // speculative re-runs started so far
  };
  // Local (one-sided, one read of rank 0's header): the counters as they stand now. Each is
  // exact, but MPI makes accumulates atomic element by element only, so a read racing a win
  // may see its unit counted in `won` and not yet in `amount`, or the other way round.
  Counts counts();

  struct Summary {
    std::int64_t units = 0;
    std::int64_t written_once = 0;   // units written exactly once
    std::int64_t unwritten = 0;      // units never written (a bug)
    std::int64_t written_twice = 0;  // units written more than once (a bug)
    std::int64_t extra_runs = 0;     // sum over units of runs - 1 (speculative re-runs)
    std::vector<std::int32_t> winner;  // rank that won each unit
  };
  // Collective over comm: ends the epoch, frees the window and returns the per-unit summary
  // on every rank. Ranks that arrive early wait without spinning, calling while_waiting
  // (when given) between polls: rank 0 keeps its progress line going (counts() still works).
  Summary finish(const std::function<void()>& while_waiting = {});

  std::int64_t units() const noexcept { return units_; }
  // One rank alone: nobody else can take or finish its units.
  bool solo() const noexcept { return comm_.size() == 1; }
  // Whether other ranks may re-run this rank's units.
  bool speculating() const noexcept { return speculate_ && max_runs_ >= 2; }
  Schedule schedule() const noexcept { return schedule_; }

 private:
  std::int64_t fetch_add(MPI_Aint index, std::int64_t add);
  std::int64_t read(MPI_Aint index);
  void add(MPI_Aint index, std::span<const std::int64_t> values);
  static constexpr MPI_Aint kNext = 0, kWon = 1, kAmount = 2, kReruns = 3, kHeader = 4;
  MPI_Aint runs_at(std::int64_t u) const { return kHeader + u; }
  MPI_Aint finishers_at(std::int64_t u) const { return kHeader + units_ + u; }
  MPI_Aint winner_at(std::int64_t u) const { return kHeader + 2 * units_ + u; }
  MPI_Aint writes_at(std::int64_t u) const { return kHeader + 3 * units_ + u; }
  std::int64_t speculative_claim(std::span<const std::int64_t> held);

  mpi::Comm comm_;
  MPI_Win win_ = MPI_WIN_NULL;
  std::int64_t units_ = 0;
  bool speculate_ = true;
  int max_runs_ = 2;
  Schedule schedule_ = Schedule::dynamic;
  std::int64_t next_static_ = 0, end_static_ = 0;  // this rank's block (static schedule)
  bool fresh_left_ = true;
  std::int64_t low_ = 0;  // every unit below is known finished (speculation scans from here)
};

}  // namespace locus::comm
