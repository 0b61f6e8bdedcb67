// The compute thread: the engine's work stripe by stripe (forward passes into the unit's logits
// on the cpu, the whole device pipeline on a GPU), the test hooks
// that make a rank slow, and the events that tell the main thread which buffers are free again.
#include "compute_thread.hpp"

#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <utility>

namespace locus::infer::detail {

namespace {

using Clock = std::chrono::steady_clock;

// Sleeps `d` in short slices, returning early once cancel is set.
void sleep_unless(std::chrono::duration<double> d, const std::atomic<bool>& cancel) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(d);
  while (!cancel.load(std::memory_order_relaxed) && Clock::now() < until) {
    std::this_thread::sleep_for(
        std::min<Clock::duration>(std::chrono::milliseconds(2), until - Clock::now()));
  }
}

// Keeps the core busy for `d` (a slower CPU still occupies its core), returning early once cancel
// is set.
void spin_unless(std::chrono::duration<double> d, const std::atomic<bool>& cancel) {
  const auto until = Clock::now() + std::chrono::duration_cast<Clock::duration>(d);
  while (!cancel.load(std::memory_order_relaxed) && Clock::now() < until) {
  }
}

}  // namespace

ComputeThread::ComputeThread(Engine& engine, SlowDown slow, std::size_t wake_after)
    : engine_(engine), slow_(slow), wake_after_(std::max<std::size_t>(wake_after, 1)) {
  thread_ = std::thread([this] { loop(); });
  ::pthread_setname_np(thread_.native_handle(), "locus-compute");  // for top -H, perf
}

ComputeThread::~ComputeThread() {
  {
    std::lock_guard lock(m_);
    quit_ = true;
  }
  work_.notify_all();
  thread_.join();
}

void ComputeThread::submit(Stripe& s) {
  {
    std::lock_guard lock(m_);
    todo_.push_back(&s);
  }
  work_.notify_all();
}

bool ComputeThread::wait_for(std::chrono::milliseconds d, Events& ev) {
  std::unique_lock lock(m_);
  if (!events_.wait_for(lock, d, [this] { return !happened_.freed.empty(); })) return false;
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  ev.freed.insert(ev.freed.end(), happened_.freed.begin(), happened_.freed.end());
  ev.done.insert(ev.done.end(), happened_.done.begin(), happened_.done.end());
  happened_.freed.clear();
  happened_.done.clear();
  return true;
}

double ComputeThread::busy_seconds() {
  std::lock_guard lock(m_);
  return busy_;
}

double ComputeThread::cpu_seconds() {
  clockid_t clock{};
  timespec ts{};
  if (::pthread_getcpuclockid(thread_.native_handle(), &clock) != 0 ||
      ::clock_gettime(clock, &ts) != 0) {
    return 0.0;
  }
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

void ComputeThread::loop() {
  std::unique_lock lock(m_);
  try {
    engine_.on_compute_thread();
  } catch (...) {
    error_ = std::current_exception();  // reported with the first stripe's events
  }
  while (true) {
    work_.wait(lock, [this] { return quit_ || !todo_.empty(); });
    if (quit_) return;
    Stripe* s = todo_.front();
    todo_.pop_front();
    lock.unlock();
    const auto t0 = Clock::now();
    std::exception_ptr err;
    try {
      run(*s);
    } catch (...) {
      err = std::current_exception();
    }
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    lock.lock();
    busy_ += took;
    if (err && !error_) error_ = err;
    happened_.freed.push_back(s);
    if (s->last) happened_.done.push_back(s->unit);
    if (s->last || err || todo_.empty() || happened_.freed.size() >= wake_after_)
      events_.notify_all();
  }
}

void ComputeThread::run(Stripe& s) {
  UnitWork& u = *s.unit;
  if (s.first && slow_.ms > 0) sleep_unless(std::chrono::milliseconds(slow_.ms), u.cancel);
  auto last = Clock::now();
  auto stop = [&] {
    if (slow_.factor > 1.0) {  // stretch each batch to factor x its compute time
      spin_unless((Clock::now() - last) * (slow_.factor - 1.0), u.cancel);
      last = Clock::now();
    }
    return u.cancel.load(std::memory_order_relaxed);
  };
  if (u.completed && !u.cancel.load()) {
    u.completed = engine_.run(s, stop);
  } else {
    u.completed = false;
  }
}

}  // namespace locus::infer::detail
