// run_app: one exit path for every app. Agreed errors exit cleanly on all ranks with their
// documented code; anything else aborts the whole job so no rank is left in a collective.
#include "locus/comm/app.hpp"

#include <cstdio>
#include <exception>

#include <fmt/format.h>

namespace locus {

int exit_code_for(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::config: return exit_code::config;
    case ErrorKind::data: return exit_code::data;
    case ErrorKind::gate: return exit_code::gate;
    case ErrorKind::io: return exit_code::io;
    default: return exit_code::internal;
  }
}

[[noreturn]] void abort_job(const std::string& what, int code) {
  std::fprintf(stderr, "[rank %d/%d %s] error: %s\n", mpi::world_rank(), mpi::world_size(),
               mpi::hostname().c_str(), what.c_str());
  std::fflush(stderr);
  mpi::abort(MPI_COMM_WORLD, code);
}

int run_app(int argc, char** argv, const std::function<int(mpi::Comm&)>& body,
            int thread_level) {
  int code = exit_code::ok;
  try {
    mpi::Environment env(argc, argv, thread_level);
    try {
      mpi::Comm world = mpi::Comm::world();
      code = body(world);
    } catch (const Error& e) {
      if (!e.agreed()) abort_job(e.what(), exit_code_for(e.kind()));
      if (mpi::world_rank() == 0) {
        std::fprintf(stderr, "error: %s\n", e.what());
        std::fflush(stderr);
      }
      code = exit_code_for(e.kind());
    } catch (const std::exception& e) {
      abort_job(e.what(), exit_code::internal);
    }
    // What the body printed goes out before MPI_Finalize: once a peer has exited non-zero,
    // mpirun ends the ranks still in their teardown, and a buffered stdout would be lost.
    std::fflush(stdout);
    std::fflush(stderr);
  } catch (const std::exception& e) {  // MPI could not even start
    std::fprintf(stderr, "error: %s\n", e.what());
    return exit_code::internal;
  }
  return code;
}

}  // namespace locus
