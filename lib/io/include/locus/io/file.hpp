// HDF5 files opened through the MPI-IO driver on a communicator, with collective metadata
// operations, plus groups.
#pragma once

#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/io/h5.hpp"

namespace locus::h5 {

class File {
 public:
  enum class Mode { read, read_write };

  // Collective over comm. Creates (truncating) `path`. An unwritable directory is an IoError
  // (agreed on every rank) naming the directory.
  static File create(const mpi::Comm& comm, const std::string& path);
  // Collective over comm. A missing or non-HDF5 file is a DataError naming it (agreed).
  static File open(const mpi::Comm& comm, const std::string& path, Mode mode);

  File(File&&) noexcept = default;
  File& operator=(File&&) noexcept = default;
  // Closes without checking; call close() to see errors. While an exception unwinds, the
  // file is left open instead: closing is collective, and a rank failing alone would wait
  // forever for peers that are not closing. The job then either aborts (an error on one rank)
  // or every rank unwinds alike and HDF5 closes the file at MPI_Finalize.
  ~File();

  hid_t id() const noexcept { return id_.get(); }
  const mpi::Comm& comm() const noexcept { return comm_; }
  const std::string& path() const noexcept { return path_; }
  bool is_open() const noexcept { return static_cast<bool>(id_); }

  // Collective: flushes HDF5's buffers to the file system.
  void flush();
  // Collective: closes the file and throws if HDF5 reports an error (e.g. a failed write of
  // cached metadata). Idempotent.
  void close();

 private:
  File(mpi::Comm comm, std::string path, Id id)
      : comm_(std::move(comm)), path_(std::move(path)), id_(std::move(id)) {}

  mpi::Comm comm_;  // a dup of the caller's communicator, owned
  std::string path_;
  Id id_;
};

// Throws IoError naming `output` and `dir` unless a file can be created in `dir` (probed by
// creating one: root passes every access() check even on read-only file systems).
void check_writable_dir(const std::string& dir, const std::string& output);

// Group helpers (collective over the file's communicator).
Id create_group(hid_t parent, const std::string& name);
Id open_group(hid_t parent, const std::string& name);
bool exists(hid_t parent, const std::string& name);

}  // namespace locus::h5
