// Atomic publication of output files: everything is written under a temporary name beside the
// final one and renamed only after every rank closed it successfully, so a failed or killed run
// never leaves a file under the final name. The temporary name is deterministic, so a rerun
// overwrites its own leftovers.
#pragma once

#include <string>

#include "locus/comm/mpi.hpp"

namespace locus::io {

// The temporary path used for `final_path`: "<dir>/.<name>.locus-tmp".
std::string temp_path_for(const std::string& final_path);

class Publication {
 public:
  // Collective over comm. Checks on every rank that the output directory is writable (an
  // agreed IoError otherwise) and removes a leftover temporary file of an earlier run.
  Publication(const mpi::Comm& comm, std::string final_path);
  Publication(const Publication&) = delete;
  Publication& operator=(const Publication&) = delete;
  // Without a commit, removes the temporary file (rank 0, best effort).
  ~Publication();

  const std::string& temp_path() const noexcept { return temp_; }
  const std::string& final_path() const noexcept { return final_; }

  // Collective over comm; call after every rank closed the temporary file. Agrees that no rank
  // failed, then rank 0 fsyncs the file, renames it over the final name and fsyncs the
  // directory. Any failure is an agreed IoError and leaves the final name untouched.
  void commit();
  // Collective over comm: gives up; the temporary file is removed.
  void abandon();

 private:
  mpi::Comm comm_;
  std::string final_;
  std::string temp_;
  bool done_ = false;
};

// Collective over comm: copies `src` to `dst` (created or truncated) in parallel, each rank
// copying its own byte range in the kernel (copy_file_range) and fsyncing it.
void copy_file_parallel(const mpi::Comm& comm, const std::string& src, const std::string& dst);

// fsync a file or directory by path; throws IoError naming it.
void fsync_path(const std::string& path, bool directory);

}  // namespace locus::io
