// The checkpoint directory: its ownership lock, file names, listing, the `latest` pointer
// (atomic replace), the commit of one checkpoint (temporary name, fsync, rename, directory
// fsync, pointer) and retention.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <thread>

#include "checkpoint/checkpoint_detail.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/h5.hpp"
#include "locus/io/publish.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLatest = "latest";

std::string join_path(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

// Local: the run_id attribute of a checkpoint, read with HDF5's serial driver ("" when the
// file cannot be read: a damaged or foreign file).
std::string run_of(const std::string& path) {
  std::lock_guard lock(hdf5_mutex());
  h5::init();
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) {
    H5Eclear2(H5E_DEFAULT);
    return "";
  }
  h5::Id file(f);
  try {
    return h5::read_attr<std::string>(file.get(), "run_id");
  } catch (const Error&) {
    H5Eclear2(H5E_DEFAULT);
    return "";
  }
}

// Local (rank 0): deletes what retention gives up; returns the deleted names. Failures to
// delete are ignored: retention is housekeeping, never a reason to fail a save.
std::vector<std::string> prune(const std::string& dir, const std::string& newest,
                               const CheckpointMeta& meta, const RetentionOptions& r) {
  std::vector<std::string> removed;
  std::int64_t kept = 1;  // the new checkpoint
  for (const CheckpointEntry& e : list_checkpoints(dir)) {
    if (e.name == newest) continue;
    bool drop = std::ranges::find(r.retire, e.name) != r.retire.end();
    if (drop) {
    } else if (run_of(e.path) != meta.run_id) {
      drop = true;  // another run's (or unreadable)
    } else if (e.step > meta.step) {
      drop = true;  // a branch abandoned by resuming from an older checkpoint
    } else {
      ++kept;
      drop = r.keep_last > 0 && kept > r.keep_last;
    }
    if (drop && ::unlink(e.path.c_str()) == 0) removed.push_back(e.name);
  }
  static const std::regex temp(R"(^\.ckpt-\d+\.h5\.locus-tmp$)");
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(dir, ec)) {
    const std::string name = d.path().filename().string();
    if (std::regex_match(name, temp) && ::unlink(d.path().c_str()) == 0) removed.push_back(name);
  }
  return removed;
}

// ---- The lock (<dir>/.lock) ----

constexpr const char* kLockName = ".lock";

std::string slurm_job() {
  const char* job = std::getenv("SLURM_JOB_ID");
  return job != nullptr ? job : "";
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm {};
  ::gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

// The holder record: "key value" lines under a comment saying what the file is. watchdog_s:
// the holder ends itself after that long without progress (0: never).
std::string holder_record(const std::string& run_id, const std::string& since,
                          double watchdog_s) {
  const std::string job = slurm_job();
  return fmt::format("# locus checkpoint directory lock: while a training job uses this directory "
                     "its rank 0 holds an\n# exclusive flock(2) on this file; the lines name "
                     "the holder (or the last one)\nhost {}\npid {}\nslurm_job {}\nrun {}\n"
                     "since {}\nwatchdog_s {:g}\n", mpi::hostname(), static_cast<long>(::getpid()),
                     job.empty() ? "-" : job, run_id, since, watchdog_s);
}

// The holder's watchdog_s, 0 when it recorded none (or an earlier locus, or nonsense).
double holder_watchdog_s(const std::map<std::string, std::string>& r) {
  const auto it = r.find("watchdog_s");
  if (it == r.end()) return 0;
  char* end = nullptr;
  const double v = std::strtod(it->second.c_str(), &end);
  return end != it->second.c_str() && *end == '\0' && std::isfinite(v) && v > 0 ? v : 0;
}

// Best effort: the record is for people and for the message of a refused job; the lock
// itself is the flock. Overwritten in place, then cut to length, so a reader never finds it
// empty while it is rewritten.
void write_record(int fd, const std::string& text) {
  const auto n = static_cast<ssize_t>(text.size());
  if (::pwrite(fd, text.data(), text.size(), 0) != n) return;
  if (::ftruncate(fd, n) != 0) {
    // A longer record's tail stays; harmless: readers take the first value of each key.
  }
}

std::map<std::string, std::string> read_record(int fd) {
  std::string text(4096, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  std::map<std::string, std::string> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto space = line.find(' ');
    if (space != std::string::npos) out.emplace(line.substr(0, space), line.substr(space + 1));
  }
  return out;
}

std::string describe(const std::map<std::string, std::string>& r) {
  if (!r.contains("pid")) return "";
  const auto get = [&](const char* key) { return r.contains(key) ? r.at(key) : "?"; };
  const std::string job = get("slurm_job");
  const double watchdog_s = holder_watchdog_s(r);
  return fmt::format("host {}, pid {}{}, run {}, since {}{}", get("host"), get("pid"),
                     job == "-" || job == "?" ? "" : ", Slurm job " + job, get("run"),
                     get("since"),
                     watchdog_s > 0 ? fmt::format(", train.watchdog_s {:g}", watchdog_s) : "");
}

// The holder's record; a holder that has only just taken the lock may not have written it
// yet, so an empty one is read again for up to a second.
std::map<std::string, std::string> holder_of(int fd) {
  auto r = read_record(fd);
  for (int i = 0; i < 20 && !r.contains("pid"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    r = read_record(fd);
  }
  return r;
}

[[noreturn]] void refuse(const std::string& dir, const std::map<std::string, std::string>& r,
                         double waited_s) {
  const std::string holder = describe(r);
  const std::string job = r.contains("slurm_job") ? r.at("slurm_job") : "-";
  const std::string who =
      job != "-" ? "Slurm job " + job
                 : (r.contains("pid") ? fmt::format("process {} on {}", r.at("pid"),
                                                    r.contains("host") ? r.at("host") : "?")
                                      : "that job");
  throw ConfigError(fmt::format(
      "checkpoint.dir '{}' is in use by another training job ({}){}: two jobs in one checkpoint "
      "directory would delete each other's checkpoints. Set checkpoint.dir to another "
      "directory, or wait until {} ends and rerun (its lock on {} goes with its process, even "
      "if it is killed; --resume=auto then continues from its checkpoints)",
      dir, holder.empty() ? "holder not recorded" : holder,
      waited_s > 0 ? fmt::format(", an earlier instance of this Slurm job that did not end "
                                 "within {:g} s", waited_s)
                   : "",
      who, (fs::path(dir) / kLockName).string()));
}

}  // namespace

std::string checkpoint_file_name(std::int64_t step) { return fmt::format("ckpt-{:08d}.h5", step); }

std::vector<CheckpointEntry> list_checkpoints(const std::string& dir) {
  static const std::regex pattern(R"(^ckpt-(\d+)\.h5$)");
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(dir, ec)) {
    const std::string name = d.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, pattern) || !d.is_regular_file(ec)) continue;
    out.push_back({name, d.path().string(), std::stoll(m[1].str())});
  }
  std::ranges::sort(out, [](const auto& a, const auto& b) {
    return a.step != b.step ? a.step > b.step : a.name > b.name;
  });
  return out;
}

LatestPointer read_latest(const std::string& dir) {
  LatestPointer p;
  std::ifstream in(join_path(dir, kLatest));
  std::string key, value, line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    key.clear();
    value.clear();
    words >> key >> value;
    if (key == "run") {
      p.run_id = value;
      p.present = !value.empty();
    } else if (key == "latest") {
      p.file = value == "-" ? "" : value;
    }
  }
  return p;
}

void write_latest(const std::string& dir, const LatestPointer& p) {
  const std::string final_path = join_path(dir, kLatest);
  const std::string temp = io::temp_path_for(final_path);
  {
    std::FILE* f = std::fopen(temp.c_str(), "w");
    if (f == nullptr) {
      throw IoError(fmt::format("cannot write the checkpoint pointer '{}': {}", temp,
                                std::strerror(errno)));
    }
    const std::string text = fmt::format(
        "# locus checkpoint pointer: the run and its newest committed checkpoint\nrun {}\n"
        "latest {}\n", p.run_id, p.file.empty() ? "-" : p.file);
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() &&
                    std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    const int err = errno;
    std::fclose(f);
    if (!ok) {
      ::unlink(temp.c_str());
      throw IoError(fmt::format("cannot write the checkpoint pointer '{}': {}", temp,
                                std::strerror(err)));
    }
  }
  if (std::rename(temp.c_str(), final_path.c_str()) != 0) {
    throw IoError(fmt::format("cannot rename '{}' to '{}': {}", temp, final_path,
                              std::strerror(errno)));
  }
  io::fsync_path(dir, true);
}

SaveResult save_checkpoint(const mpi::Comm& comm, const std::string& dir,
                           const CheckpointData& data, const WriteOptions& write,
                           const RetentionOptions& retention) {
  const auto t0 = std::chrono::steady_clock::now();
  SaveResult r;
  r.step = data.meta.step;
  const std::string name = checkpoint_file_name(data.meta.step);
  r.path = join_path(dir, name);
  mpi::agree_on(comm, [&] {
    std::error_code ec;
    if (comm.is_root()) fs::create_directories(dir, ec);
    if (ec) {
      throw IoError(fmt::format("cannot create checkpoint.dir '{}': {}; choose another "
                                "directory or fix the permissions", dir, ec.message()));
    }
  });
  io::Publication pub(comm, r.path);
  if (write_checkpoint_file(comm, pub.temp_path(), data, write) == WriteOutcome::abandoned) {
    pub.abandon();
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }
  comm::progress("checkpoint commit of {}", r.path);
  test_hook("ckpt-before-rename");
  pub.commit();
  test_hook("ckpt-before-latest");
  mpi::agree_on(comm, [&] {
    if (comm.is_root()) write_latest(dir, {true, data.meta.run_id, name});
  });
  r.committed = true;
  if (comm.is_root()) {
    std::error_code ec;
    r.bytes = static_cast<std::uint64_t>(fs::file_size(r.path, ec));
    r.removed = prune(dir, name, data.meta, retention);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

CheckpointDirLock CheckpointDirLock::acquire(const mpi::Comm& comm, const std::string& dir,
                                             const std::string& run_id, const LockWait& wait,
                                             const std::function<void(const std::string&)>& say) {
  CheckpointDirLock lock;
  // Named for the watchdog, which keeps counting while rank 0 waits for a predecessor and the
  // other ranks wait for rank 0: a wait longer than this job's own train.watchdog_s ends it
  // (exit 70) with this line. With the predecessor's watchdog this job's outlives it: it was
  // armed later.
  comm::progress("taking the lock of checkpoint.dir {}", dir);
  mpi::agree_on(comm, [&] {
    if (!comm.is_root()) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      throw IoError(fmt::format("cannot create checkpoint.dir '{}': {}; choose another "
                                "directory or fix the permissions", dir, ec.message()));
    }
    const std::string path = join_path(dir, kLockName);
    // Created once and never removed: unlinking it would let a job lock a new file while
    // another still holds the old one. Only read access is needed to lock it.
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0 && (errno == EACCES || errno == EROFS)) fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      throw IoError(fmt::format("cannot open the lock file '{}' of checkpoint.dir '{}': {}; "
                                "fix the permissions or choose another checkpoint.dir",
                                path, dir, std::strerror(errno)));
    }
    io::Fd file(fd);
    const auto t0 = std::chrono::steady_clock::now();
    bool told = false;
    for (;;) {
      if (::flock(file.get(), LOCK_EX | LOCK_NB) == 0) break;
      const int err = errno;
      if (err == EINTR) continue;
      if (err == ENOLCK || err == ENOSYS || err == EOPNOTSUPP || err == EINVAL) {
        lock.warning_ = fmt::format(
            "warning: checkpoint.dir '{}' cannot be locked ({}: the file system does not "
            "support flock, e.g. Lustre mounted without -o flock); it is used unlocked, so make "
            "sure no other job uses it", dir, std::strerror(err));
        return;
      }
      if (err != EWOULDBLOCK) {
        throw IoError(fmt::format("cannot lock '{}': {}; choose another checkpoint.dir", path,
                                  std::strerror(err)));
      }
      const auto holder = holder_of(file.get());
      const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const bool same_job = !slurm_job().empty() && holder.contains("slurm_job") &&
                            holder.at("slurm_job") == slurm_job();
      // A predecessor stranded on a node cut off from its peers ends by its own watchdog.
      const double predecessor_watchdog_s = holder_watchdog_s(holder);
      const double limit_s = wait.same_job_s + predecessor_watchdog_s;
      if (!same_job || waited >= limit_s) refuse(dir, holder, same_job ? waited : 0);
      if (!told && say) {
        say(fmt::format("checkpoint.dir {} is held by an earlier instance of this Slurm job "
                        "({}): waiting up to {:g} s for it to end{}", dir, describe(holder),
                        limit_s,
                        predecessor_watchdog_s > 0
                            ? fmt::format(" (its train.watchdog_s = {:g} ends it that long after "
                                          "its last progress if it is stranded, e.g. on a node "
                                          "that lost its network)", predecessor_watchdog_s)
                            : ""));
      }
      told = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
    lock.run_id_ = run_id;
    lock.since_ = utc_now();
    lock.watchdog_s_ = wait.watchdog_s;
    write_record(file.get(), holder_record(run_id, lock.since_, lock.watchdog_s_));
    lock.fd_ = std::move(file);
  });
  return lock;
}

void CheckpointDirLock::set_run(const std::string& run_id) {
  if (!fd_ || run_id == run_id_) return;
  run_id_ = run_id;
  write_record(fd_.get(), holder_record(run_id_, since_, watchdog_s_));
}

std::string read_lock_holder(const std::string& dir) {
  const int fd = ::open(join_path(dir, kLockName).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  io::Fd file(fd);
  return describe(read_record(file.get()));
}

}  // namespace locus::train
