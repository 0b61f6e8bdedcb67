// quiet_barrier: MPI_Ibarrier polled with sleeps.
#include "locus/comm/quiet_wait.hpp"

#include <time.h>

#include "locus/comm/error.hpp"

namespace locus::comm {

void quiet_barrier(const mpi::Comm& comm) {
  if (comm.size() == 1) return;
  MPI_Request req = MPI_REQUEST_NULL;
  LOCUS_MPI_CHECK(MPI_Ibarrier(comm.get(), &req));
  int done = 0;
  while (true) {
    LOCUS_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (done != 0) return;
    const timespec pause{0, 200'000};
    ::nanosleep(&pause, nullptr);
  }
}

}  // namespace locus::comm
