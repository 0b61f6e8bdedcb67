// The checked layer over the HDF5 C API: one owning handle type for every hid_t, a check
// macro that throws H5Error carrying HDF5's own error stack, and library initialisation
// (automatic error printing off).
#pragma once

#include <hdf5.h>

#include <exception>
#include <functional>
#include <string>

#include "locus/comm/error.hpp"
#include "locus/comm/handle.hpp"
#include "locus/comm/mpi.hpp"

namespace locus::h5 {

struct IdTraits {
  using value_type = hid_t;
  static constexpr hid_t invalid() noexcept { return H5I_INVALID_HID; }
  static void close(hid_t id) noexcept;
};
// An owned HDF5 identifier of any type (file, dataset, dataspace, property list, ...).
using Id = Handle<IdTraits>;

// Turns off HDF5's automatic error printing (errors are thrown with their stack instead).
// Called by every entry point that opens a file; cheap after the first call.
void init();

// The current HDF5 error stack, one line per frame (empty when there is none).
std::string error_stack();

namespace detail {
[[noreturn]] void h5_fail(const char* call, const char* file, int line);
// A failed call that writes to `path`: when HDF5's error stack shows that the file system
// refused a write (the driver's write or truncate failed: disk full, quota, I/O error), an
// IoError naming the file (exit 5: "an output could not be written"); otherwise an H5Error
// as h5_fail's, naming the file too.
// `path` is called only after HDF5's error stack was taken (any HDF5 call, H5Fget_name
// included, clears it).
[[noreturn]] void h5_write_fail(const char* call, const std::function<std::string()>& path,
                                const char* file, int line);
// The name of the file an HDF5 object belongs to ("?" when it cannot be had).
std::string file_of(hid_t obj);
// Collective over comm, right after a collective HDF5 write (a dataset's piece, a flush) that
// may have failed on some ranks only; own: this rank's error (null: it succeeded), path: the
// file. Every rank learns of a failure here, before any goes on into the next collective,
// where it would wait for the failed rank forever. When every rank failed, each rethrows its
// own error (the caller agrees them). When only some did, the job ends here by MPI_Abort with
// the error's exit code: HDF5's state then differs between the ranks, so even a collective
// close hangs in mismatched internal collectives (seen: rank 0 in the metadata cache's flush
// barrier, rank 1 in the driver's truncate broadcast); callers write temporary files, which
// the next run removes, so nothing is published. The failed rank's peers may still be inside
// the collective (an exchange of Open MPI's two-phase write, the metadata flush's barrier):
// it waits 30 s for them at most.
void settle_collective_write(const mpi::Comm& comm, std::exception_ptr own,
                             const std::string& path);
}

}  // namespace locus::h5

// Evaluates an HDF5 call returning hid_t or herr_t/htri_t; a negative value throws H5Error
// with the call text, file:line, rank and HDF5's error stack. Yields the call's value.
#define LOCUS_H5_CHECK(call)                                                       \
  ([&]() {                                                                         \
    auto locus_h5_rc_ = (call);                                                    \
    if (locus_h5_rc_ < 0) ::locus::h5::detail::h5_fail(#call, __FILE__, __LINE__); \
    return locus_h5_rc_;                                                           \
  }())

// LOCUS_H5_CHECK for calls that write to a file (H5Dwrite, H5Fclose's flush, ...): `path` is
// the file's name (or an expression giving it, evaluated only on failure).
#define LOCUS_H5_WRITE_CHECK(path, call)                                                  \
  ([&]() {                                                                                \
    auto locus_h5_rc_ = (call);                                                           \
    if (locus_h5_rc_ < 0)                                                                 \
      ::locus::h5::detail::h5_write_fail(#call, [&] { return std::string(path); }, __FILE__, \
                                         __LINE__);                                       \
    return locus_h5_rc_;                                                                  \
  }())
