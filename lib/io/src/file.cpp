// MPI-IO HDF5 files: creation/opening with agreed errors, collective metadata.
#include "locus/io/file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <exception>
#include <filesystem>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"
#include "locus/comm/watchdog.hpp"

namespace locus::h5 {

namespace {

constexpr hsize_t kMetaBlockBytes = hsize_t{1} << 20;

Id mpio_fapl(const mpi::Comm& comm) {
  Id fapl(LOCUS_H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)));
  LOCUS_H5_CHECK(H5Pset_fapl_mpio(fapl.get(), comm.get(), MPI_INFO_NULL));
  // Metadata reads and writes collective: one rank reads and broadcasts, no metadata storms.
  LOCUS_H5_CHECK(H5Pset_all_coll_metadata_ops(fapl.get(), true));
  LOCUS_H5_CHECK(H5Pset_coll_metadata_write(fapl.get(), true));
  // The 1.8+ object format stores attributes above 64 KiB (per-feature statistics of wide
  // datasets) densely; every HDF5 since 1.8 and h5py read it.
  LOCUS_H5_CHECK(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_V110));
  // Metadata (chunk-index nodes above all) is allocated from 1 MiB blocks instead of 2 KiB
  // ones. With the default, index nodes land between runs of chunks, so every rank's row
  // range is cut into many transfers and a cold read fetches scattered index pages; with it,
  // each rank's rows are one file extent and the first dataset starts 1 MiB-aligned (the
  // usual Lustre stripe). Costs up to 1 MiB of slack per file (bench/RESULTS.md, I/O).
  LOCUS_H5_CHECK(H5Pset_meta_block_size(fapl.get(), kMetaBlockBytes));
  return fapl;
}

std::string parent_dir(const std::string& path) {
  auto dir = std::filesystem::path(path).parent_path();
  return dir.empty() ? std::string(".") : dir.string();
}

}  // namespace

// Root passes every access() check, so writability is probed by creating a file.
void check_writable_dir(const std::string& dir, const std::string& output) {
  const std::string probe =
      fmt::format("{}/.locus-probe.{}.{}", dir, mpi::hostname(), static_cast<long>(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  if (fd < 0) {
    throw IoError(fmt::format("cannot write '{}': directory '{}' is not writable ({}); "
                              "choose another output path or fix the permissions",
                              output, dir, std::strerror(errno)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
}

File File::create(const mpi::Comm& comm, const std::string& path) {
  init();
  mpi::agree_on(comm, [&] { check_writable_dir(parent_dir(path), path); });
  mpi::Comm own = comm.dup();
  Id fapl = mpio_fapl(own);
  Id id;
  mpi::agree_on(own, [&] {
    hid_t f = H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get());
    if (f < 0) {
      std::string stack = error_stack();
      H5Eclear2(H5E_DEFAULT);
      throw IoError(fmt::format("cannot create HDF5 file '{}' (is the file system full or "
                                "read-only?); HDF5 error stack:{}", path, stack));
    }
    id = Id(f);
  });
  return File(std::move(own), path, std::move(id));
}

File File::open(const mpi::Comm& comm, const std::string& path, Mode mode) {
  init();
  mpi::agree_on(comm, [&] {
    if (::access(path.c_str(), mode == Mode::read ? R_OK : (R_OK | W_OK)) != 0) {
      throw DataError(fmt::format("cannot open '{}': {}; check the path", path,
                                  std::strerror(errno)));
    }
  });
  mpi::Comm own = comm.dup();
  Id fapl = mpio_fapl(own);
  Id id;
  mpi::agree_on(own, [&] {
    hid_t f = H5Fopen(path.c_str(), mode == Mode::read ? H5F_ACC_RDONLY : H5F_ACC_RDWR,
                      fapl.get());
    if (f < 0) {
      std::string stack = error_stack();
      H5Eclear2(H5E_DEFAULT);
      throw DataError(fmt::format("'{}' is not a readable HDF5 file (truncated or corrupt?); "
                                  "HDF5 error stack:{}", path, stack));
    }
    id = Id(f);
  });
  return File(std::move(own), path, std::move(id));
}

File::~File() {
  if (std::uncaught_exceptions() > 0) static_cast<void>(id_.release());
}

void File::flush() { LOCUS_H5_CHECK(H5Fflush(id_.get(), H5F_SCOPE_GLOBAL)); }

void File::close() {
  if (!id_) return;
  // The MPI-IO driver only closes a file with no open objects (H5F_CLOSE_SEMI): say which.
  const ssize_t open_objects =
      H5Fget_obj_count(id_.get(), H5F_OBJ_DATASET | H5F_OBJ_GROUP | H5F_OBJ_ATTR |
                                      H5F_OBJ_DATATYPE | H5F_OBJ_LOCAL);
  LOCUS_ASSERT(open_objects == 0,
               fmt::format("'{}' closed with {} datasets/groups still open; destroy them first",
                           path_, open_objects));
  // A metadata write that fails on one rank only leaves the ranks in mismatched collectives
  // inside HDF5's close (rank 0 in the metadata cache's flush barrier, rank 1 in the driver's
  // truncate broadcast; HDF5 1.10 returns to neither): the watchdog names the file and ends
  // the job with exit 5 when the close makes no progress.
  comm::mark_progress_writing(fmt::format("closing '{}'", path_), path_);
  const hid_t id = id_.release();
  LOCUS_H5_WRITE_CHECK(path_, H5Fclose(id));
}

Id create_group(hid_t parent, const std::string& name) {
  return Id(LOCUS_H5_CHECK(H5Gcreate2(parent, name.c_str(), H5P_DEFAULT, H5P_DEFAULT,
                                      H5P_DEFAULT)));
}

Id open_group(hid_t parent, const std::string& name) {
  return Id(LOCUS_H5_CHECK(H5Gopen2(parent, name.c_str(), H5P_DEFAULT)));
}

bool exists(hid_t parent, const std::string& name) {
  return LOCUS_H5_CHECK(H5Lexists(parent, name.c_str(), H5P_DEFAULT)) > 0;
}

}  // namespace locus::h5
