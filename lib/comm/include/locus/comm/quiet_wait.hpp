// Waiting for other ranks without holding a core: the end of a work queue (a rank that ran out
// of units) or rank 0's fsync before a publication, where the other ranks would otherwise spin
// in MPI.
//
// Why: Open MPI's blocking collectives busy-poll. When ranks run at real-time priority (a job
// shielded with chrt, as the benchmarks are), a spinning rank yields its core only to other
// real-time tasks, so the kernel threads that complete rank 0's fsync (writeback, journal,
// per-CPU work items) starve on that core: the publication of a 2-rank run took 0.1-1.2 s
// instead of 0.05 s. Sleeping between polls gives them the core.
#pragma once

#include <exception>
#include <functional>
#include <span>
#include <utility>

#include "locus/comm/agree.hpp"
#include "locus/comm/mpi.hpp"

namespace locus::comm {

// Collective over comm: a barrier whose waiting ranks sleep between polls (MPI_Ibarrier, tested
// every 200 µs) instead of spinning, calling while_waiting (when given) between polls.
void quiet_barrier(const mpi::Comm& comm, const std::function<void()>& while_waiting = {});

// Collective over comm: each element of values replaced by its maximum over the ranks, polled
// with sleeps like quiet_barrier. With seconds > 0, gives up after that long and returns false
// (values unchanged, the request left behind: for a rank about to abort the job because its
// peers are stuck elsewhere).
bool allreduce_max_within(const mpi::Comm& comm, std::span<int> values, double seconds);

// Collective over comm: rank 0 runs fn (an fsync, say) while the other ranks wait in
// quiet_barrier; an error thrown by fn is re-thrown, agreed, on every rank.
template <class Fn>
void on_root_quietly(const mpi::Comm& comm, Fn&& fn) {
  std::exception_ptr error;
  if (comm.is_root()) {
    try {
      std::forward<Fn>(fn)();
    } catch (...) {
      error = std::current_exception();
    }
  }
  quiet_barrier(comm);
  mpi::agree_on(comm, [&] {
    if (error) std::rethrow_exception(error);
  });
}

}  // namespace locus::comm
