// The progress watchdog (like nccl-tests' timeout): an app arms one Watchdog for its run, and
// the code marks progress where it enters an operation that waits on other ranks or on the
// file system (comm::progress("gradient all-reduce step {}", step)). When no progress is
// marked for the timeout, the watchdog's thread prints
//   [rank r/n host] watchdog: no progress for N s in <what> (<key> = N): ... HINT: ...
// and ends the whole job with MPI_Abort and exit 70 (README, "Exit codes"), so a stuck rank
// (a hung file system, a deadlock, a peer stopped alone) never holds the allocation until
// the scheduler's time limit.
//
// Suspension is not a hang: the thread sleeps in short ticks and counts a tick that overshot
// (the process was stopped by SIGSTOP, e.g. a suspended Slurm job, or not scheduled) as one
// tick, so time spent stopped does not count (as lib/comm/src/nccl_reducer.cpp's wait loop).
#pragma once

#include <fmt/format.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

namespace locus::comm {

class Watchdog {
 public:
  // Called on the watchdog's thread with the whole message; the default prints it on stderr
  // and aborts the job (MPI_Abort over MPI_COMM_WORLD with exit 70). Tests pass their own.
  using FireFn = std::function<void(const std::string& message)>;

  // Arms the process's watchdog: timeout_s <= 0 is off (no thread). `key` is the config key
  // that set the timeout, named in the message. At most one watchdog is armed at a time
  // (InternalError otherwise). tick: how often the thread looks (tests shorten it).
  Watchdog(double timeout_s, std::string key, FireFn fire = {},
           std::chrono::milliseconds tick = std::chrono::milliseconds(100));
  ~Watchdog();  // disarms and joins the thread
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  bool armed() const noexcept { return state_ != nullptr; }

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// Whether a watchdog is armed in this process (one relaxed atomic load).
bool watchdog_armed() noexcept;
// The armed watchdog's timeout and the config key that set it ({0, ""} when none is armed).
struct WatchdogSetting {
  double timeout_s = 0;
  std::string key;
};
WatchdogSetting armed_watchdog();
// Marks progress and names the operation now entered; thread-safe. Without an armed
// watchdog it does nothing.
void mark_progress(std::string_view what);
// mark_progress for an operation that completes writes of the output `path` (closing it): if
// the watchdog fires in it, its message names the file and says that a write failed or hangs,
// and the job ends with exit 5 ("an output could not be written") instead of 70.
void mark_progress_writing(std::string_view what, std::string_view path);

// mark_progress with a fmt format; the text is formatted only when a watchdog is armed.
template <class... Args>
void progress(fmt::format_string<Args...> format, Args&&... args) {
  if (!watchdog_armed()) return;
  mark_progress(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace locus::comm
