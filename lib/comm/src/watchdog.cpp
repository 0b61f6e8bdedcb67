// The progress watchdog (see watchdog.hpp): one process-wide armed state that mark_progress
// updates, and a thread that counts the time since the last mark in short ticks.
#include "locus/comm/watchdog.hpp"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "locus/comm/app.hpp"
#include "locus/comm/error.hpp"
#include "locus/comm/mpi.hpp"

namespace locus::comm {

using Clock = std::chrono::steady_clock;

struct Watchdog::State {
  double timeout_s = 0;
  std::string key;
  FireFn fire;
  std::chrono::milliseconds tick{100};
  // Progress: a count bumped by every mark, and the operation named last (under `mutex`).
  std::atomic<std::uint64_t> marks{0};
  std::mutex mutex;
  std::string what = "start-up";
  std::string writing;  // the output being written when marked by mark_progress_writing
  // Stop request for the thread.
  std::mutex stop_mutex;
  std::condition_variable stop_cv;
  bool stop = false;
  std::thread thread;
};

namespace {

std::atomic<bool> g_armed{false};
std::mutex g_mutex;  // guards g_state
std::shared_ptr<Watchdog::State> g_state;

// The exit code of the message being fired: io when it names an output being written.
std::atomic<int> g_fire_code{exit_code::internal};

[[noreturn]] void abort_job(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  // From this thread while the main thread may sit inside MPI: Open MPI's abort goes through
  // the runtime's own channel to mpirun (tested under FUNNELED in tests/apps).
  const int code = g_fire_code.load();
  // Ranks stuck in one collective fire together, and Open MPI 4.1's mpirun can fail on two
  // MPI_Aborts at once (seen: "ORTE_ERROR_LOG: Data unpack would read past end of buffer" in
  // show_help.c, then mpirun killed, exit -9, instead of this code): the lowest rank goes
  // first, each other rank half a second later per rank (at most 4 s), by when the first
  // abort has usually ended it.
  std::this_thread::sleep_for(std::chrono::milliseconds(500) * std::min(mpi::world_rank(), 8));
  mpi::abort(MPI_COMM_WORLD, code);
}

std::string message_for(const Watchdog::State& s, double idle_s, const std::string& what,
                        const std::string& writing) {
  if (!writing.empty()) {
    return fmt::format(
        "[rank {}/{} {}] watchdog: no progress for {:.0f} s in {} ({} = {:g}): cannot write "
        "'{}': the file system did not complete the writes of this rank or of a peer (a write "
        "that failed on one rank only -- disk full, over quota, an I/O error -- leaves the "
        "others waiting in HDF5's collective metadata flush; or the file system hangs); the "
        "job is aborted with exit {} and nothing is published. HINT: look at the other "
        "ranks' lines above for a failed write (e.g. 'mca_fbtl_posix_pwritev: error in "
        "writev: No space left on device'), free space or choose another output path, then "
        "rerun; raise {} if this legitimately takes longer",
        mpi::world_rank(), mpi::world_size(), mpi::hostname(), idle_s, what, s.key,
        s.timeout_s, writing, exit_code::io, s.key);
  }
  return fmt::format(
      "[rank {}/{} {}] watchdog: no progress for {:.0f} s in {} ({} = {:g}): this rank or a "
      "peer it waits for is stuck (a hung file system, a deadlock, or a rank stopped or "
      "killed alone); the job is aborted with exit {}. HINT: the first rank to report names "
      "the operation; look at the other ranks' lines above for an earlier error, attach a "
      "debugger to a stuck rank (gdb -p PID, then 'thread apply all bt'), or raise {} if "
      "this operation legitimately takes longer (0: no watchdog)",
      mpi::world_rank(), mpi::world_size(), mpi::hostname(), idle_s, what, s.key, s.timeout_s,
      exit_code::internal, s.key);
}

void watch(Watchdog::State& s) {
  // A tick counts at most twice its length: a tick that overshot by far means the process was
  // stopped (SIGSTOP/SIGCONT) or starved, and neither is a lack of progress.
  const auto cap = std::chrono::duration_cast<Clock::duration>(2 * s.tick);
  const auto limit = std::chrono::duration<double>(s.timeout_s);
  Clock::duration idle{};
  std::uint64_t seen = s.marks.load();
  auto last = Clock::now();
  std::unique_lock lock(s.stop_mutex);
  while (!s.stop_cv.wait_for(lock, s.tick, [&] { return s.stop; })) {
    const auto now = Clock::now();
    idle += std::min<Clock::duration>(now - last, cap);
    last = now;
    const std::uint64_t marks = s.marks.load();
    if (marks != seen) {
      seen = marks;
      idle = Clock::duration::zero();
      continue;
    }
    if (idle > limit) {
      std::string what, writing;
      {
        std::lock_guard g(s.mutex);
        what = s.what;
        writing = s.writing;
      }
      g_fire_code.store(writing.empty() ? exit_code::internal : exit_code::io);
      s.fire(message_for(s, std::chrono::duration<double>(idle).count(), what, writing));
      return;  // a test's fire function returns; the default one never does
    }
  }
}

}  // namespace

Watchdog::Watchdog(double timeout_s, std::string key, FireFn fire,
                   std::chrono::milliseconds tick) {
  if (!(timeout_s > 0)) return;
  auto s = std::make_shared<State>();
  s->timeout_s = timeout_s;
  s->key = std::move(key);
  s->fire = fire ? std::move(fire) : FireFn(abort_job);
  s->tick = std::max(tick, std::chrono::milliseconds(1));
  {
    std::lock_guard g(g_mutex);
    if (g_state) throw InternalError("a second progress watchdog was armed in this process");
    g_state = s;
    g_armed.store(true);
  }
  s->thread = std::thread([st = s.get()] { watch(*st); });
  state_ = std::move(s);
}

Watchdog::~Watchdog() {
  if (!state_) return;
  {
    std::lock_guard g(g_mutex);
    g_armed.store(false);
    g_state.reset();
  }
  {
    std::lock_guard g(state_->stop_mutex);
    state_->stop = true;
  }
  state_->stop_cv.notify_all();
  if (state_->thread.joinable()) state_->thread.join();
}

bool watchdog_armed() noexcept { return g_armed.load(std::memory_order_relaxed); }

WatchdogSetting armed_watchdog() {
  std::lock_guard g(g_mutex);
  if (!g_state) return {};
  return {g_state->timeout_s, g_state->key};
}

namespace {

// Names the operation entered (and the output it writes, "" for none) and counts a mark.
void mark(std::string_view what, std::string_view writing) {
  std::shared_ptr<Watchdog::State> s;
  {
    std::lock_guard g(g_mutex);
    s = g_state;
  }
  if (!s) return;
  {
    std::lock_guard g(s->mutex);
    s->what.assign(what);
    s->writing.assign(writing);
  }
  s->marks.fetch_add(1);
}

}  // namespace

void mark_progress(std::string_view what) { mark(what, {}); }

void mark_progress_writing(std::string_view what, std::string_view path) { mark(what, path); }

}  // namespace locus::comm
