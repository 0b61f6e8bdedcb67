// Error construction and the check-macro failure paths.
#include "locus/comm/error.hpp"

#include <mpi.h>

#include <fmt/format.h>

#include "locus/comm/mpi.hpp"

namespace locus {

namespace {
template <class E>
[[noreturn]] void raise(const std::string& what, bool agreed) {
  E e(what);
  if (agreed) e.mark_agreed();
  throw e;
}
}  // namespace

void throw_error(ErrorKind kind, const std::string& what, bool agreed) {
  switch (kind) {
    case ErrorKind::config: raise<ConfigError>(what, agreed);
    case ErrorKind::data: raise<DataError>(what, agreed);
    case ErrorKind::gate: raise<GateError>(what, agreed);
    case ErrorKind::io: raise<IoError>(what, agreed);
    case ErrorKind::mpi: raise<MpiError>(what, agreed);
    case ErrorKind::hdf5: raise<H5Error>(what, agreed);
    case ErrorKind::cuda: raise<CudaError>(what, agreed);
    case ErrorKind::nccl: raise<NcclError>(what, agreed);
    case ErrorKind::internal: break;
  }
  raise<InternalError>(what, agreed);
}

std::string where(std::string_view file, int line) {
  const auto slash = file.rfind("/lib/");
  if (slash != std::string_view::npos) file.remove_prefix(slash + 1);
  return fmt::format("{}:{} (rank {}/{} {})", file, line, mpi::world_rank(), mpi::world_size(),
                     mpi::hostname());
}

namespace detail {

void mpi_fail(int rc, const char* call, const char* file, int line) {
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized == 0 || MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw MpiError(fmt::format("{} failed with code {} ({}) at {}", call, rc,
                             std::string(text, static_cast<std::size_t>(len)), where(file, line)));
}

void assert_fail(const char* cond, const std::string& msg, const char* file, int line) {
  throw InternalError(
      fmt::format("internal check failed: {} ({}) at {}", cond, msg, where(file, line)));
}

}  // namespace detail
}  // namespace locus
