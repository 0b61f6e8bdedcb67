// quiet_barrier and allreduce_max_within: non-blocking MPI collectives polled with sleeps.
#include "locus/comm/quiet_wait.hpp"

#include <time.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "locus/comm/error.hpp"

namespace locus::comm {

namespace {

// Tests req every 200 us, sleeping (and calling between, when given) in between; false once
// seconds (> 0) have passed first.
bool poll(MPI_Request& req, double seconds, const std::function<void()>& between = {}) {
  const auto start = std::chrono::steady_clock::now();
  int done = 0;
  while (true) {
    LOCUS_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (done != 0) return true;
    if (seconds > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
                               .count() > seconds) {
      return false;
    }
    if (between) between();
    const timespec pause{0, 200'000};
    ::nanosleep(&pause, nullptr);
  }
}

}  // namespace

void quiet_barrier(const mpi::Comm& comm, const std::function<void()>& while_waiting) {
  if (comm.size() == 1) return;
  MPI_Request req = MPI_REQUEST_NULL;
  LOCUS_MPI_CHECK(MPI_Ibarrier(comm.get(), &req));
  poll(req, 0.0, while_waiting);
}

bool allreduce_max_within(const mpi::Comm& comm, std::span<int> values, double seconds) {
  if (comm.size() == 1 || values.empty()) return true;
  // The result lands in a buffer of its own: on a timeout the request still owns it.
  static thread_local std::vector<int> out;
  out.assign(values.size(), 0);
  MPI_Request req = MPI_REQUEST_NULL;
  LOCUS_MPI_CHECK(MPI_Iallreduce(values.data(), out.data(), static_cast<int>(values.size()),
                                 MPI_INT, MPI_MAX, comm.get(), &req));
  if (!poll(req, seconds)) return false;
  std::copy(out.begin(), out.end(), values.begin());
  return true;
}

}  // namespace locus::comm
