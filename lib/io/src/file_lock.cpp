// The lock file: flock(2), the holder record, and the wait for an earlier instance of one's own
// Slurm job.
#include "locus/io/file_lock.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <sstream>
#include <thread>
#include <utility>

#include "locus/comm/mpi.hpp"

namespace locus::io {

namespace {

using Record = std::map<std::string, std::string>;

std::string slurm_job() {
  const char* job = std::getenv("SLURM_JOB_ID");
  return job != nullptr ? job : "";
}

// SLURM_RESTART_COUNT: how often Slurm requeued the job (0 on its first run; -1 for a record
// written before locus recorded it or something that is not a count).
long restart_count(const char* text) {
  if (text == nullptr || *text == '\0') return 0;
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return *end == '\0' && v >= 0 ? v : -1;
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm {};
  ::gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

// "key value" lines under comments saying what the file is.
std::string record_text(const LockRecord& r, const std::string& since) {
  const std::string job = slurm_job();
  std::string text = fmt::format("# {}\n# while it is in use, a process of the job holds an "
                                 "exclusive flock(2) on this file; the\n# lines name the holder "
                                 "(or the last one)\nhost {}\npid {}\nslurm_job {}\n"
                                 "slurm_restart_count {}\n",
                                 r.title, mpi::hostname(), static_cast<long>(::getpid()),
                                 job.empty() ? "-" : job,
                                 restart_count(std::getenv("SLURM_RESTART_COUNT")));
  if (!r.run.empty()) text += fmt::format("run {}\n", r.run);
  text += fmt::format("since {}\nwatchdog_s {:g}\n", since, r.watchdog_s);
  if (r.watchdog_s > 0 && !r.watchdog_key.empty())
    text += fmt::format("watchdog_key {}\n", r.watchdog_key);
  return text;
}

// The holder's watchdog_s, 0 when it recorded none (or an earlier locus, or nonsense).
double holder_watchdog_s(const Record& r) {
  const auto it = r.find("watchdog_s");
  if (it == r.end()) return 0;
  char* end = nullptr;
  const double v = std::strtod(it->second.c_str(), &end);
  return end != it->second.c_str() && *end == '\0' && std::isfinite(v) && v > 0 ? v : 0;
}

// The config key of the holder's watchdog (records before watchdog_key were training's).
std::string holder_watchdog_key(const Record& r) {
  const auto it = r.find("watchdog_key");
  return it != r.end() ? it->second : "train.watchdog_s";
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
  // Flushed, so a job on another node (NFS) soon reads this record, not the last holder's.
  ::fdatasync(fd);
}

Record read_record(int fd) {
  std::string text(4096, '\0');
  const ssize_t n = ::pread(fd, text.data(), text.size(), 0);
  text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  Record out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] == '#') continue;
    const auto space = line.find(' ');
    if (space != std::string::npos) out.emplace(line.substr(0, space), line.substr(space + 1));
  }
  return out;
}

std::string describe(const Record& r) {
  if (!r.contains("pid")) return "";
  const auto get = [&](const char* key) { return r.contains(key) ? r.at(key) : "?"; };
  const std::string job = get("slurm_job");
  const double watchdog_s = holder_watchdog_s(r);
  const long restarts = restart_count(r.contains("slurm_restart_count")
                                          ? r.at("slurm_restart_count").c_str()
                                          : "0");
  return fmt::format("host {}, pid {}{}{}{}, since {}{}", get("host"), get("pid"),
                     job == "-" || job == "?" ? "" : ", Slurm job " + job,
                     job != "-" && job != "?" && restarts > 0
                         ? fmt::format(" (restart {})", restarts) : "",
                     r.contains("run") ? ", run " + r.at("run") : "", get("since"),
                     watchdog_s > 0
                         ? fmt::format(", {} {:g}", holder_watchdog_key(r), watchdog_s)
                         : "");
}

std::string holder_name(const Record& r) {
  const std::string job = r.contains("slurm_job") ? r.at("slurm_job") : "-";
  if (job != "-") return "Slurm job " + job;
  if (r.contains("pid"))
    return fmt::format("process {} on {}", r.at("pid"), r.contains("host") ? r.at("host") : "?");
  return "that job";
}

// Whether a record names a process of this host that has ended: the last holder's record, not
// the current holder's (one that writes none, e.g. flock(1), or one about to write its own).
bool ended_holder(const Record& r) {
  if (!r.contains("pid") || !r.contains("host") || r.at("host") != mpi::hostname()) return false;
  const long pid = std::strtol(r.at("pid").c_str(), nullptr, 10);
  return pid > 0 && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

// The holder's record; a holder that has only just taken the lock may not have written it
// yet, so a missing or ended one is read again for up to a second.
Record holder_of(int fd) {
  auto r = read_record(fd);
  for (int i = 0; i < 20 && (!r.contains("pid") || ended_holder(r)); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    r = read_record(fd);
  }
  return r;
}

}  // namespace

LockBusy::LockBusy(std::string holder, std::string holder_name, double waited_s)
    : ConfigError(fmt::format("locked by {}", holder.empty() ? holder_name : holder)),
      holder_(std::move(holder)), holder_name_(std::move(holder_name)), waited_s_(waited_s) {}

FileLock FileLock::take(const std::string& path, std::string_view what, const LockRecord& record,
                        const LockWait& wait, const Say& say) {
  // Only read access is needed to lock; a lock file another user created may be read-only.
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0 && (errno == EACCES || errno == EROFS))
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw IoError(fmt::format("cannot open the lock file '{}' of {}: {}; fix the permissions "
                              "or choose another path", path, what, std::strerror(errno)));
  }
  FileLock lock;
  Fd file(fd);
  const auto t0 = std::chrono::steady_clock::now();
  bool told = false;
  for (;;) {
    if (::flock(file.get(), LOCK_EX | LOCK_NB) == 0) break;
    const int err = errno;
    if (err == EINTR) continue;
    if (err == ENOLCK || err == ENOSYS || err == EOPNOTSUPP || err == EINVAL) {
      lock.warning_ = fmt::format(
          "warning: {} cannot be locked ({}: the file system does not support flock, e.g. "
          "Lustre mounted without -o flock); it is used unlocked, so make sure no other job "
          "uses it", what, std::strerror(err));
      return lock;
    }
    if (err != EWOULDBLOCK) {
      throw IoError(fmt::format("cannot lock '{}' of {}: {}; choose another path", path, what,
                                std::strerror(err)));
    }
    const Record holder = holder_of(file.get());
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // An earlier instance: the same Slurm job, requeued fewer times.
    const bool same_job = !slurm_job().empty() && holder.contains("slurm_job") &&
                          holder.at("slurm_job") == slurm_job() &&
                          restart_count(holder.contains("slurm_restart_count")
                                            ? holder.at("slurm_restart_count").c_str()
                                            : "-") <
                              restart_count(std::getenv("SLURM_RESTART_COUNT"));
    const double predecessor_watchdog_s = holder_watchdog_s(holder);
    const double limit_s = wait.same_job_s + predecessor_watchdog_s;
    if (!same_job || waited >= limit_s) {
      // A record of an ended process is not named as the holder's. Only the message: across
      // PID namespaces (containers with the host's name) a live holder can look ended.
      const Record named = ended_holder(holder) ? Record{} : holder;
      throw LockBusy(describe(named), holder_name(named), same_job ? waited : 0);
    }
    if (!told && say) {
      say(fmt::format("{} is held by an earlier instance of this Slurm job ({}): waiting up to "
                      "{:g} s for it to end{}", what, describe(holder), limit_s,
                      predecessor_watchdog_s > 0
                          ? fmt::format(" (its {} = {:g} ends it that long after its last "
                                        "progress if it is stranded, e.g. on a node that lost "
                                        "its network)", holder_watchdog_key(holder),
                                        predecessor_watchdog_s)
                          : ""));
    }
    told = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  lock.fd_ = std::move(file);
  lock.record_ = record;
  lock.since_ = utc_now();
  write_record(lock.fd_.get(), record_text(lock.record_, lock.since_));
  return lock;
}

void FileLock::set_run(const std::string& run) {
  if (!fd_ || run == record_.run) return;
  record_.run = run;
  write_record(fd_.get(), record_text(record_, since_));
}

std::string describe_lock_holder(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  Fd file(fd);
  return describe(read_record(file.get()));
}

double requeue_wait_s() {
  constexpr double kRequeueWaitSeconds = 120;
  const char* text = std::getenv("LOCUS_TEST_REQUEUE_WAIT_S");
  if (text == nullptr || *text == '\0') return kRequeueWaitSeconds;
  char* end = nullptr;
  const double v = std::strtod(text, &end);
  if (end == text || *end != '\0' || !std::isfinite(v) || v < 0) {
    throw ConfigError(fmt::format("LOCUS_TEST_REQUEUE_WAIT_S = '{}' is not a number of seconds "
                                  "(test only: how long a requeued job waits for its "
                                  "predecessor's lock); unset it", text));
  }
  return v;
}

}  // namespace locus::io
