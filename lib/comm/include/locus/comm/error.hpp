// The one error hierarchy of locus, and the check macros that raise it with the call's text,
// file:line and the MPI rank. Libraries throw; only apps/ (through run_app) turns errors into
// exit codes.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace locus {

// What kind of failure, which also decides the process exit code (see exit_code()).
enum class ErrorKind : int {
  internal = 0,  // a bug or an unexpected library failure: MPI_Abort
  config = 1,    // bad configuration or command line
  data = 2,      // bad input data (missing file, corrupt, malformed)
  gate = 3,      // a data-quality gate rejected the dataset
  io = 4,        // the environment refused an operation (unwritable dir, disk full)
  mpi = 5,       // an MPI call failed
  hdf5 = 6,      // an HDF5 call failed
  cuda = 7,
  nccl = 8,
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& what) : std::runtime_error(what), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }
  // True when every rank of the communicator is known to throw the same error (set by agree()),
  // so the app may exit cleanly instead of aborting.
  bool agreed() const noexcept { return agreed_; }
  void mark_agreed() noexcept { agreed_ = true; }

 private:
  ErrorKind kind_;
  bool agreed_ = false;
};

#define LOCUS_DEFINE_ERROR(Name, Kind)                                             \
  class Name : public Error {                                                      \
   public:                                                                         \
    explicit Name(const std::string& what) : Error(ErrorKind::Kind, what) {}       \
  };
LOCUS_DEFINE_ERROR(InternalError, internal)
LOCUS_DEFINE_ERROR(ConfigError, config)
LOCUS_DEFINE_ERROR(DataError, data)
LOCUS_DEFINE_ERROR(GateError, gate)
LOCUS_DEFINE_ERROR(IoError, io)
LOCUS_DEFINE_ERROR(MpiError, mpi)
LOCUS_DEFINE_ERROR(H5Error, hdf5)
LOCUS_DEFINE_ERROR(CudaError, cuda)
LOCUS_DEFINE_ERROR(NcclError, nccl)
#undef LOCUS_DEFINE_ERROR
// A cuBLAS / cuBLASLt failure: a CudaError (same kind and exit path) of its own type.
class CublasError : public CudaError {
 public:
  explicit CublasError(const std::string& what) : CudaError(what) {}
};

// Rebuilds an error of the given kind (used to re-raise an agreed error on every rank).
[[noreturn]] void throw_error(ErrorKind kind, const std::string& what, bool agreed);

// "where (rank r/n host)" text for messages; rank is -1 before MPI is initialised.
std::string where(std::string_view file, int line);

namespace detail {
[[noreturn]] void mpi_fail(int rc, const char* call, const char* file, int line);
[[noreturn]] void assert_fail(const char* cond, const std::string& msg, const char* file,
                              int line);
}  // namespace detail

}  // namespace locus

// Checks the return code of an MPI call and throws MpiError with the call text on failure.
#define LOCUS_MPI_CHECK(call)                                                      \
  do {                                                                             \
    const int locus_mpi_rc_ = (call);                                              \
    if (locus_mpi_rc_ != MPI_SUCCESS)                                              \
      ::locus::detail::mpi_fail(locus_mpi_rc_, #call, __FILE__, __LINE__);         \
  } while (0)

// Always-on invariant check (never compiled out; never put side effects in cond).
#define LOCUS_ASSERT(cond, msg)                                                    \
  do {                                                                             \
    if (!(cond)) ::locus::detail::assert_fail(#cond, (msg), __FILE__, __LINE__);   \
  } while (0)
