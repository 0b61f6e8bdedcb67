// Atomic publication of output files: everything is written under a temporary name beside the
// final one and renamed only after every rank closed it successfully, so a failed or killed run
// never leaves a file under the final name. The temporary name is deterministic, so a rerun
// overwrites its own leftovers; the output's lock (OutputLock) keeps a second job from writing
// the same output meanwhile.
#pragma once

#include <string>
#include <string_view>

#include "locus/comm/mpi.hpp"
#include "locus/io/file_lock.hpp"

namespace locus::io {

// The temporary path used for `final_path`: "<dir>/.<name>.locus-tmp".
std::string temp_path_for(const std::string& final_path);
// The lock file of the output `final_path`: "<dir>/.<name>.locus-lock".
std::string lock_path_for(const std::string& final_path);

// Collective over comm: whether `path` exists as comm's rank 0 sees it ("" does not), so that
// every rank takes the same branch (ranks on other nodes may see a publication late).
bool output_exists(const mpi::Comm& comm, const std::string& path);

// Ownership of an output by one job while it writes it (a publication, or an append or
// extension in place): comm's rank 0 holds a FileLock on lock_path_for(path) (the file stays,
// with the last holder's record). Without it, a second job writing the same output removes the
// first one's temporary file and writes its own under that name, and the first one then
// publishes the second one's partial file as its result (docs/RELIABILITY.md, "Two jobs, one
// output").
class OutputLock {
 public:
  OutputLock() = default;  // holds nothing

  // Collective over comm. Checks on every rank (rank 0 alone for Writer::rank_0) that the
  // output directory is writable (an agreed IoError otherwise); rank 0 takes the lock,
  // recording the process's armed watchdog.
  // Held by another job: a ConfigError (agreed) naming the output (and `key`, the config key
  // that set it, when given), the holder and what to do; nothing is changed. An earlier
  // instance of this Slurm job is waited for (requeue_wait_s() plus its recorded watchdog),
  // told once by `say` on rank 0 (default: standard error), as is the warning of a file system
  // without locks. A file rank 0 alone writes on its own node (a Prometheus file in
  // node_exporter's directory, which other nodes need not have) is `Writer::rank_0`: rank 0
  // alone checks its directory.
  enum class Writer { every_rank, rank_0 };
  static OutputLock acquire(const mpi::Comm& comm, const std::string& path,
                            std::string_view key = {}, const FileLock::Say& say = {},
                            Writer writer = Writer::every_rank);

  const std::string& path() const noexcept { return path_; }
  bool held() const noexcept { return lock_.held(); }  // rank 0, where locks work

 private:
  FileLock lock_;
  std::string path_;
};

class Publication {
 public:
  // Collective over comm. Takes the output's lock (OutputLock::acquire), then removes a
  // leftover temporary file of an earlier run.
  Publication(const mpi::Comm& comm, std::string final_path);
  // The same under the output's lock the caller holds already (taken before it read the output
  // it appends to); InternalError when `held` is another path's.
  Publication(const mpi::Comm& comm, std::string final_path, const OutputLock& held);
  // For an output whose whole directory the caller holds locked (train::CheckpointDirLock):
  // no lock of its own.
  struct DirectoryLocked {};
  Publication(const mpi::Comm& comm, std::string final_path, DirectoryLocked);
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
  void remove_leftover();

  OutputLock own_lock_;  // released last, after the destructor removed the temporary file
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
