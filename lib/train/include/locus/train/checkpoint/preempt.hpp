// Preemption signals: handlers that only set an async-signal-safe flag, so a training job
// told to leave (SIGUSR1 from Slurm before the time limit, SIGTERM at preemption) finishes its
// step, checkpoints at a step boundary agreed by every rank and exits 75. The flag is read
// by the Checkpointer; nothing else happens inside a handler.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace locus::train {

// "USR1,TERM" (names with or without SIG, case-insensitive, or numbers) -> signal numbers.
// "" or "none" -> {}. ConfigError naming `key` for an unknown name or an uncatchable signal
// (KILL, STOP).
std::vector<int> parse_signals(std::string_view list, std::string_view key = "checkpoint.signals");
// "SIGTERM" for 15.
std::string signal_name(int signal);

// Installs flag-setting handlers for `signals` (SA_RESTART, so interrupted system calls
// resume) and restores the previous dispositions on destruction. One instance at a time.
class PreemptSignals {
 public:
  explicit PreemptSignals(const std::vector<int>& signals);
  ~PreemptSignals();
  PreemptSignals(const PreemptSignals&) = delete;
  PreemptSignals& operator=(const PreemptSignals&) = delete;

  // The last handled signal of this process (0: none since the handlers were installed).
  static int pending() noexcept;

  // From destruction on the signals are ignored instead of getting their previous
  // dispositions back: a process that checkpointed and is leaving with exit 75 must not be
  // killed by a later one, which would turn its exit code into 128 + the signal's. Under Slurm
  // that later signal comes by itself: the batch script passes the scheduler's SIGTERM on to
  // the ranks when its trap runs, which may be after they have stopped.
  void ignore_after() noexcept { ignore_after_ = true; }

 private:
  std::vector<int> signals_;
  bool ignore_after_ = false;
  std::vector<char> saved_;  // the previous struct sigaction of each signal, opaque here
};

}  // namespace locus::train
