// The wrapper around every app's main, and the documented process exit codes.
#pragma once

#include <functional>

#include "locus/comm/error.hpp"
#include "locus/comm/mpi.hpp"

namespace locus {

// Process exit codes (documented in the README). Every rank exits with the same code.
namespace exit_code {
inline constexpr int ok = 0;
inline constexpr int config = 2;        // bad configuration / command line
inline constexpr int data = 3;          // bad input data
inline constexpr int gate = 4;          // a data-quality gate failed; nothing published
inline constexpr int io = 5;            // output could not be written (permissions, disk)
inline constexpr int internal = 70;     // bug or unexpected MPI/HDF5 failure (MPI_Abort)
inline constexpr int requeue = 75;      // checkpointed after a preemption signal: requeue me
}  // namespace exit_code

int exit_code_for(ErrorKind kind) noexcept;

// Prints "[rank r/n host] error: what" and ends the whole job with MPI_Abort(code): for a rank
// that cannot count on its peers joining another collective (they may be stuck in one it left).
[[noreturn]] void abort_job(const std::string& what, int code);

// Runs body(world) inside an mpi::Environment. An agreed locus::Error (same on all ranks) is
// printed once by rank 0 and returns its documented exit code after MPI_Finalize; any other
// exception prints "[rank r/n host] error: ..." and calls MPI_Abort with the matching code, so
// no rank ever leaves alone while its peers wait in a collective.
int run_app(int argc, char** argv, const std::function<int(mpi::Comm&)>& body,
            int thread_level = MPI_THREAD_FUNNELED);

}  // namespace locus
