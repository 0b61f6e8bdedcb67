// The scoring loop: two unit slots (one computing, one prefetched), a compute thread that only
// does arithmetic, and a main thread that claims, reads, polls for stragglers and writes.
#include "pipeline.hpp"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>

#include <time.h>

namespace locus::infer::detail {

namespace {

using Clock = std::chrono::steady_clock;

double cpu_seconds(clockid_t clock) {
  timespec ts{};
  ::clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
constexpr auto kPoll = std::chrono::milliseconds(2);  // straggler check while computing

struct Slot {
  std::int64_t unit = -1;  // -1: free
  bool speculative = false;
  h5::RowRange rows;
  std::uint64_t origin = 0;
  std::vector<float> x;
  std::vector<std::int32_t> y;
  Scores scores;
  bool completed = false;  // scored to the end (not abandoned)
  double compute_seconds = 0;
  double compute_cpu_seconds = 0;
  std::atomic<bool> cancel{false};
};

// Sleeps `d` in short slices, returning early once cancel is set.
void sleep_unless(std::chrono::duration<double> d, const std::atomic<bool>& cancel) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(d);
  while (!cancel.load(std::memory_order_relaxed) && Clock::now() < until)
    std::this_thread::sleep_for(std::min<Clock::duration>(kPoll, until - Clock::now()));
}

// Keeps the core busy for `d` (a slower CPU still occupies its core), returning early once cancel
// is set.
void spin_unless(std::chrono::duration<double> d, const std::atomic<bool>& cancel) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(d);
  while (!cancel.load(std::memory_order_relaxed) && Clock::now() < until) {
  }
}

// The compute thread: scores one slot at a time; no MPI, no HDF5.
class ComputeThread {
 public:
  ComputeThread(Scorer& scorer, SlowDown slow) : scorer_(scorer), slow_(slow) {
    thread_ = std::thread([this] { loop(); });
  }
  ComputeThread(const ComputeThread&) = delete;
  ComputeThread& operator=(const ComputeThread&) = delete;
  ~ComputeThread() {
    {
      std::lock_guard lock(m_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  void start(Slot& s) {
    {
      std::lock_guard lock(m_);
      job_ = &s;
      done_ = false;
    }
    cv_.notify_all();
  }
  // True once the job finished (rethrowing its exception, if any).
  bool wait_for(std::chrono::milliseconds d) {
    std::unique_lock lock(m_);
    if (!cv_.wait_for(lock, d, [this] { return done_; })) return false;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
    return true;
  }

 private:
  void loop() {
    std::unique_lock lock(m_);
    while (true) {
      cv_.wait(lock, [this] { return quit_ || job_ != nullptr; });
      if (quit_) return;
      Slot* s = std::exchange(job_, nullptr);
      lock.unlock();
      std::exception_ptr err;
      try {
        score(*s);
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      error_ = err;
      done_ = true;
      cv_.notify_all();
    }
  }

  void score(Slot& s) {
    const auto t0 = Clock::now();
    const double c0 = cpu_seconds(CLOCK_THREAD_CPUTIME_ID);
    if (slow_.ms > 0) sleep_unless(std::chrono::milliseconds(slow_.ms), s.cancel);
    auto last = Clock::now();
    auto stop = [&] {
      if (slow_.factor > 1.0) {  // stretch each batch to factor x its compute time
        spin_unless((Clock::now() - last) * (slow_.factor - 1.0), s.cancel);
        last = Clock::now();
      }
      return s.cancel.load(std::memory_order_relaxed);
    };
    s.completed = !s.cancel.load() && scorer_.score(s.origin, s.rows.begin, s.x, s.y, s.scores, stop);
    s.compute_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    s.compute_cpu_seconds = cpu_seconds(CLOCK_THREAD_CPUTIME_ID) - c0;
  }

  Scorer& scorer_;
  SlowDown slow_;
  std::mutex m_;
  std::condition_variable cv_;
  Slot* job_ = nullptr;
  bool done_ = false, quit_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

class Loop {
 public:
  Loop(WorkQueue& q, const UnitGrid& g, Scorer& sc, LocalInput& in, PredictionFile& out,
       int rank, const SlowDown& slow)
      : queue_(q), grid_(g), in_(in), out_(out), rank_(rank), worker_(sc, slow),
        width_(static_cast<std::size_t>(in.cols())) {
    res_.unit_loss.assign(static_cast<std::size_t>(g.units()), 0.0);
    res_.metrics.reset(in.has_labels() ? sc.outputs() : 0);
  }
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;
  // Stops a unit still computing (only when an error unwinds) before the thread is joined.
  ~Loop() {
    for (Slot& s : slots_) s.cancel = true;
  }

  LoopResult run() {
    const double cpu0 = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID);
    int computing = -1, ready = -1, finished = -1;
    bool exhausted = false;
    while (true) {
      if (computing < 0 && ready >= 0) {  // keep the compute thread busy first
        Slot& s = slots_[ready];
        ready = -1;
        if (queue_.finished(s.unit)) {  // a faster rank already scored it
          ++res_.stats.abandoned;
          s.unit = -1;
          continue;
        }
        computing = static_cast<int>(&s - slots_);
        worker_.start(s);
      }
      if (finished >= 0) {  // write while the next unit computes
        complete(slots_[finished]);
        finished = -1;
      }
      if (ready < 0 && !exhausted) {
        if (!prefetch(ready)) exhausted = true;
        continue;
      }
      if (computing < 0) break;
      wait(slots_[computing]);
      finished = std::exchange(computing, -1);
    }
    res_.stats.cpu_seconds = cpu_seconds(CLOCK_PROCESS_CPUTIME_ID) - cpu0;
    return std::move(res_);
  }

 private:
  // Claims a unit into the free slot and reads it; false when nothing is left.
  bool prefetch(int& ready) {
    Slot* s = slots_[0].unit < 0 ? &slots_[0] : &slots_[1];
    LOCUS_ASSERT(s->unit < 0, "no free slot to prefetch into");
    std::int64_t held[2] = {slots_[0].unit, slots_[1].unit};
    const WorkQueue::Claim c = queue_.claim(held);
    if (c.unit < 0) return false;
    const double t0 = MPI_Wtime();
    s->unit = c.unit;
    s->speculative = c.speculative;
    s->rows = grid_.rows(c.unit);
    s->origin = grid_.origin(c.unit);
    s->completed = false;
    s->cancel = false;
    s->x.resize(s->rows.count * width_);
    s->y.resize(in_.has_labels() ? s->rows.count : 0);
    in_.read(s->rows.begin, s->x, s->y);
    res_.stats.seconds_read += MPI_Wtime() - t0;
    ++(c.speculative ? res_.stats.speculative : res_.stats.claimed);
    ready = static_cast<int>(s - slots_);
    return true;
  }

  // Waits for the compute thread. With other ranks, polls meanwhile whether one of them
  // finished this unit first (then the compute is stopped) and lets MPI progress the one-sided
  // requests other ranks make to this rank's window.
  void wait(Slot& s) {
    const double t0 = MPI_Wtime();
    const auto poll = queue_.solo() ? std::chrono::milliseconds(1000) : kPoll;
    while (!worker_.wait_for(poll)) {
      if (queue_.solo()) continue;
      queue_.progress();
      if (queue_.speculating() && !s.cancel.load() && queue_.finished(s.unit)) s.cancel = true;
    }
    res_.stats.seconds_wait += MPI_Wtime() - t0;
    res_.stats.seconds_compute += s.compute_seconds;
    res_.stats.cpu_seconds_compute += s.compute_cpu_seconds;
  }

  void complete(Slot& s) {
    if (s.completed && queue_.try_win(s.unit)) {
      const double t0 = MPI_Wtime();
      out_.write(s.rows.begin, s.scores, rank_);
      queue_.wrote(s.unit);
      res_.stats.seconds_write += MPI_Wtime() - t0;
      ++res_.stats.written;
      res_.stats.speculative_wins += s.speculative;
      res_.stats.rows += static_cast<std::int64_t>(s.rows.count);
      if (in_.has_labels()) {
        res_.unit_loss[static_cast<std::size_t>(s.unit)] = s.scores.metrics.log_loss_sum;
        res_.metrics.merge(s.scores.metrics);
      }
    } else {
      ++res_.stats.abandoned;
    }
    s.unit = -1;
  }

  WorkQueue& queue_;
  UnitGrid grid_;
  LocalInput& in_;
  PredictionFile& out_;
  int rank_;
  Slot slots_[2];
  ComputeThread worker_;
  std::size_t width_;
  LoopResult res_;
};

}  // namespace

LoopResult run_units(WorkQueue& queue, const UnitGrid& grid, Scorer& scorer,
                     LocalInput& input, PredictionFile& out, int rank,
                     const SlowDown& slow) {
  return Loop(queue, grid, scorer, input, out, rank, slow).run();
}

}  // namespace locus::infer::detail
