// Ownership of a file or directory by one job: one process of the job holds an exclusive
// flock(2) on a lock file whose text names the holder (host, pid, Slurm job and restart count,
// since when, its watchdog), for the message of a job refused and for people. The kernel drops
// the lock when the process ends in any way, SIGKILL included, so no stale lock outlives a job.
// The file itself stays: removing it would let a job lock a new file while another still holds
// the old one (on NFS, a name looked up from a stale cache makes that impossible to rule out).
// Users: train::CheckpointDirLock (<dir>/.lock) and io::OutputLock (publish.hpp).
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "locus/comm/error.hpp"
#include "locus/io/raw_io.hpp"

namespace locus::io {

// How long a taker waits for an earlier instance of its own Slurm job: the same SLURM_JOB_ID
// with a lower SLURM_RESTART_COUNT, requeued while its predecessor is still going away or is
// stranded. (Two steps of one allocation share the id and the count: they do not wait.)
struct LockWait {
  // For a predecessor that is going away (its node's lock released late, e.g. an NFS lease).
  double same_job_s = 0;
};

// What the holder record says besides host, pid, Slurm job and the start time.
struct LockRecord {
  std::string title;         // the comment on top: what the lock protects
  std::string run;           // "" : no run line
  double watchdog_s = 0;     // the holder ends itself after this long without progress (0: never)
  std::string watchdog_key;  // the config key of watchdog_s, for messages
};

// The lock is held by another process (after any wait): a ConfigError with a plain message,
// which the lock's user rewrites with what the lock protects and what to do.
class LockBusy : public ConfigError {
 public:
  LockBusy(std::string holder, std::string holder_name, double waited_s);
  // "host H, pid P, Slurm job J, run R, since T, KEY W" ("" when the holder left no record).
  const std::string& holder() const noexcept { return holder_; }
  // "Slurm job J", "process P on H" or "that job".
  const std::string& holder_name() const noexcept { return holder_name_; }
  // > 0: how long this job waited for an earlier instance of its own Slurm job.
  double waited_s() const noexcept { return waited_s_; }

 private:
  std::string holder_;
  std::string holder_name_;
  double waited_s_;
};

// Local: one process's lock. Move-only (the handle's move empties the source); the destructor
// releases the lock and keeps the file.
class FileLock {
 public:
  using Say = std::function<void(const std::string&)>;

  FileLock() = default;  // holds nothing

  // Opens `path` (created when missing) and takes an exclusive flock on it without blocking,
  // then writes the holder record. Held by another process: LockBusy, unless the holder is an
  // earlier instance of this Slurm job (LockWait), which is waited for wait.same_job_s plus its
  // recorded watchdog_s (a predecessor stranded on a node cut off from its peers ends by its
  // own watchdog), telling `say` once. (A second take in the process that holds the lock is
  // refused as another job's: flock(2) locks belong to open files.) On a file system without
  // locks (ENOLCK, ENOSYS, EOPNOTSUPP) nothing is held and warning() says so. `what` names the protected thing in
  // messages ("checkpoint.dir 'DIR'"). IoError naming the path when the file cannot be opened.
  static FileLock take(const std::string& path, std::string_view what, const LockRecord& record,
                       const LockWait& wait, const Say& say);

  bool held() const noexcept { return static_cast<bool>(fd_); }
  const std::string& warning() const noexcept { return warning_; }
  // Rewrites the holder record with another run (a no-op unless held and the run changed).
  void set_run(const std::string& run);

 private:
  Fd fd_;
  LockRecord record_;
  std::string since_;
  std::string warning_;
};

// Local, read-only: the holder record of the lock file `path` as one line ("" when there is
// none).
std::string describe_lock_holder(const std::string& path);

// How long a requeued Slurm job waits for its predecessor's lock (LockWait::same_job_s): 120 s,
// a process gone from a node that crashed keeping its lock on NFS until the server's lease ends
// (90 s by default in NFSv4); or LOCUS_TEST_REQUEUE_WAIT_S (test only: a test of a stranded
// predecessor cannot wait minutes). ConfigError when that is not a number of seconds.
double requeue_wait_s();

}  // namespace locus::io
