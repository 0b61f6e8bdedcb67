// The one-sided work queue: a fetch-and-add counter for fresh units, per-unit runs/winner/writes
// for speculation and the exactly-once check, all in one window on rank 0.
#include "locus/comm/work_queue.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <exception>

#include "locus/comm/quiet_wait.hpp"
#include "locus/comm/watchdog.hpp"

namespace locus::comm {

namespace {

constexpr std::int64_t kScanBlock = 1024;  // units read per step of a speculation scan

}  // namespace

WorkQueue::WorkQueue(const mpi::Comm& comm, std::int64_t units, bool speculate, int max_runs,
                     Schedule schedule)
    : comm_(comm.dup()),
      units_(units),
      speculate_(speculate && schedule == Schedule::dynamic),
      max_runs_(max_runs),
      schedule_(schedule) {
  if (schedule_ == Schedule::static_blocks) {
    // The balanced partition: the first units % size ranks get one more unit.
    const std::int64_t r = comm_.rank(), p = comm_.size();
    const std::int64_t base = units / p, extra = units % p;
    next_static_ = r * base + std::min(r, extra);
    end_static_ = next_static_ + base + (r < extra ? 1 : 0);
  }
  LOCUS_ASSERT(units >= 0 && max_runs >= 1, fmt::format("{} units, max_runs {}", units, max_runs));
  const MPI_Aint bytes =
      comm_.is_root() ? static_cast<MPI_Aint>((kHeader + 4 * units_) * sizeof(std::int64_t)) : 0;
  MPI_Info info = MPI_INFO_NULL;
  LOCUS_MPI_CHECK(MPI_Info_create(&info));
  // Every location sees only SUM updates and NO_OP reads.
  LOCUS_MPI_CHECK(MPI_Info_set(info, "accumulate_ops", "same_op_no_op"));
  std::int64_t* base = nullptr;
  const int rc = MPI_Win_allocate(bytes, sizeof(std::int64_t), info, comm_.get(), &base, &win_);
  MPI_Info_free(&info);
  LOCUS_MPI_CHECK(rc);
  LOCUS_MPI_CHECK(MPI_Win_set_errhandler(win_, MPI_ERRORS_RETURN));
  if (comm_.is_root()) std::fill(base, base + kHeader + 4 * units_, std::int64_t{0});
  comm_.barrier();  // nobody touches the window before rank 0 zeroed it
  LOCUS_MPI_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, win_));
}

WorkQueue::~WorkQueue() {
  if (win_ == MPI_WIN_NULL || std::uncaught_exceptions() > 0) return;
  MPI_Win_unlock_all(win_);
  MPI_Win_free(&win_);
}

std::int64_t WorkQueue::fetch_add(MPI_Aint index, std::int64_t add) {
  std::int64_t old = 0;
  LOCUS_MPI_CHECK(MPI_Fetch_and_op(&add, &old, MPI_INT64_T, 0, index, MPI_SUM, win_));
  LOCUS_MPI_CHECK(MPI_Win_flush(0, win_));
  return old;
}

void WorkQueue::add(MPI_Aint index, std::span<const std::int64_t> values) {
  LOCUS_MPI_CHECK(MPI_Accumulate(values.data(), static_cast<int>(values.size()), MPI_INT64_T, 0,
                                 index, static_cast<int>(values.size()), MPI_INT64_T, MPI_SUM,
                                 win_));
  LOCUS_MPI_CHECK(MPI_Win_flush(0, win_));
}

std::int64_t WorkQueue::read(MPI_Aint index) {
  std::int64_t dummy = 0, value = 0;
  LOCUS_MPI_CHECK(MPI_Fetch_and_op(&dummy, &value, MPI_INT64_T, 0, index, MPI_NO_OP, win_));
  LOCUS_MPI_CHECK(MPI_Win_flush(0, win_));
  return value;
}

WorkQueue::Claim WorkQueue::claim(std::span<const std::int64_t> held) {
  if (schedule_ == Schedule::static_blocks) {
    if (next_static_ >= end_static_) return {};
    const std::int64_t u = next_static_++;
    fetch_add(runs_at(u), 1);
    return {u, false};
  }
  if (fresh_left_) {
    const std::int64_t u = fetch_add(kNext, 1);
    if (u < units_) {
      fetch_add(runs_at(u), 1);
      return {u, false};
    }
    fresh_left_ = false;
  }
  if (!speculate_ || max_runs_ < 2) return {};
  const std::int64_t u = speculative_claim(held);
  return {u, u >= 0};
}

// Oldest first: units were handed out in order, so the lowest unfinished unit has been in
// flight longest and is the likeliest straggler.
std::int64_t WorkQueue::speculative_claim(std::span<const std::int64_t> held) {
  std::array<std::int64_t, kScanBlock> finishers{}, runs{};
  bool prefix_done = true;
  for (std::int64_t start = low_; start < units_; start += kScanBlock) {
    const std::int64_t n = std::min(kScanBlock, units_ - start);
    const int count = static_cast<int>(n);
    LOCUS_MPI_CHECK(MPI_Get_accumulate(nullptr, 0, MPI_INT64_T, finishers.data(), count,
                                       MPI_INT64_T, 0, finishers_at(start), count, MPI_INT64_T,
                                       MPI_NO_OP, win_));
    LOCUS_MPI_CHECK(MPI_Get_accumulate(nullptr, 0, MPI_INT64_T, runs.data(), count,
                                       MPI_INT64_T, 0, runs_at(start), count, MPI_INT64_T,
                                       MPI_NO_OP, win_));
    LOCUS_MPI_CHECK(MPI_Win_flush(0, win_));
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t u = start + i;
      const auto k = static_cast<std::size_t>(i);
      if (finishers[k] != 0) {
        if (prefix_done) low_ = u + 1;
        continue;
      }
      prefix_done = false;
      if (runs[k] >= max_runs_ || std::find(held.begin(), held.end(), u) != held.end()) continue;
      if (fetch_add(runs_at(u), 1) < max_runs_) {
        const std::int64_t one = 1;
        add(kReruns, {&one, 1});
        return u;
      }
      fetch_add(runs_at(u), -1);  // another rank took the last copy first
    }
  }
  return -1;
}

bool WorkQueue::finished(std::int64_t unit) { return read(finishers_at(unit)) != 0; }

bool WorkQueue::try_win(std::int64_t unit, std::int64_t amount) {
  if (fetch_add(finishers_at(unit), 1) != 0) return false;
  const std::int64_t winner = comm_.rank() + 1;
  add(winner_at(unit), {&winner, 1});
  const std::array<std::int64_t, 2> won{1, amount};  // kWon, kAmount
  add(kWon, won);
  return true;
}

WorkQueue::Counts WorkQueue::counts() {
  std::array<std::int64_t, kHeader> header{};
  LOCUS_MPI_CHECK(MPI_Get_accumulate(nullptr, 0, MPI_INT64_T, header.data(), kHeader,
                                     MPI_INT64_T, 0, 0, kHeader, MPI_INT64_T, MPI_NO_OP, win_));
  LOCUS_MPI_CHECK(MPI_Win_flush(0, win_));
  return {units_, header[kWon], header[kAmount], header[kReruns]};
}

void WorkQueue::wrote(std::int64_t unit) { fetch_add(writes_at(unit), 1); }

void WorkQueue::progress() {
  int flag = 0;
  LOCUS_MPI_CHECK(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, comm_.get(), &flag, MPI_STATUS_IGNORE));
}

WorkQueue::Summary WorkQueue::finish(const std::function<void()>& while_waiting) {
  // Every rank's operations completed (each was flushed). Ranks that ran out of units sleep
  // here rather than spin: the ranks still scoring may need the core (see quiet_wait.hpp).
  comm::progress("work queue end (a barrier: every rank's units done)");
  quiet_barrier(comm_, while_waiting);
  Summary s;
  s.units = units_;
  std::vector<std::int64_t> state(static_cast<std::size_t>(4 * units_));
  if (comm_.is_root() && units_ > 0) {
    // Read through the window, in pieces below INT_MAX elements.
    for (std::int64_t off = 0; off < 4 * units_; off += 1 << 28) {
      const std::int64_t n = std::min<std::int64_t>(1 << 28, 4 * units_ - off);
      LOCUS_MPI_CHECK(MPI_Get_accumulate(nullptr, 0, MPI_INT64_T,
                                         state.data() + off, static_cast<int>(n), MPI_INT64_T,
                                         0, kHeader + off, static_cast<int>(n), MPI_INT64_T,
                                         MPI_NO_OP, win_));
    }
    LOCUS_MPI_CHECK(MPI_Win_flush(0, win_));
  }
  LOCUS_MPI_CHECK(MPI_Win_unlock_all(win_));
  LOCUS_MPI_CHECK(MPI_Win_free(&win_));
  std::array<std::int64_t, 4> counts{};
  s.winner.assign(static_cast<std::size_t>(units_), -1);
  if (comm_.is_root()) {
    for (std::int64_t u = 0; u < units_; ++u) {
      const std::int64_t runs = state[static_cast<std::size_t>(u)];
      const std::int64_t win = state[static_cast<std::size_t>(2 * units_ + u)];
      const std::int64_t writes = state[static_cast<std::size_t>(3 * units_ + u)];
      counts[0] += writes == 1;
      counts[1] += writes == 0;
      counts[2] += writes > 1;
      counts[3] += std::max<std::int64_t>(runs - 1, 0);
      s.winner[static_cast<std::size_t>(u)] = static_cast<std::int32_t>(win - 1);
    }
  }
  comm_.bcast(std::span<std::int64_t>(counts));
  comm_.bcast(std::span<std::int32_t>(s.winner));
  s.written_once = counts[0];
  s.unwritten = counts[1];
  s.written_twice = counts[2];
  s.extra_runs = counts[3];
  return s;
}

}  // namespace locus::comm
