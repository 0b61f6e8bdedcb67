// The Loader: option checks, the producer thread and its ring of batch buffers, the hand-off
// to next() (which gathers in-memory batches itself when the ring is empty), the synchronous
// fallback, and data-wait accounting. Batch contents come from loader_feed.cpp.
#include "locus/train/data/loader.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "data/loader_feed.hpp"
#include "data/stage_copy.hpp"
#include "locus/comm/agree.hpp"

namespace locus::train {

Shuffle parse_shuffle(const std::string& s) {
  if (s == "local") return Shuffle::local;
  if (s == "global") return Shuffle::global;
  if (s == "none") return Shuffle::none;
  throw ConfigError(fmt::format("unknown shuffle mode '{}'; use local, global or none", s));
}

const char* to_string(Shuffle s) {
  switch (s) {
    case Shuffle::local: return "local";
    case Shuffle::global: return "global";
    case Shuffle::none: return "none";
  }
  return "?";
}

const char* to_string(Residency r) {
  switch (r) {
    case Residency::partition: return "partition";
    case Residency::dataset: return "dataset";
    case Residency::streamed: return "streamed";
    case Residency::per_batch: return "per-batch";
  }
  return "?";
}

namespace {

void check_options(const LoaderOptions& o) {
  if (o.path.empty()) throw ConfigError("the loader has no data path; set the dataset file");
  if (o.features.empty()) {
    throw ConfigError(fmt::format("the loader of '{}' has an empty features dataset name; set "
                                  "it (locus datasets use /features)", o.path));
  }
  if (o.global_batch < 1) {
    throw ConfigError(fmt::format("global_batch = {} for '{}'; it must be at least 1",
                                  o.global_batch, o.path));
  }
  if (o.global_batch > INT32_MAX) {
    throw ConfigError(fmt::format("global_batch = {} for '{}' is above {}; lower it",
                                  o.global_batch, o.path, INT32_MAX));
  }
  if (o.prefetch_depth < 1) {
    throw ConfigError(fmt::format("prefetch_depth = {} for '{}'; it must be at least 1",
                                  o.prefetch_depth, o.path));
  }
}

bool thread_multiple() {
  int level = MPI_THREAD_SINGLE;
  LOCUS_MPI_CHECK(MPI_Query_thread(&level));
  return level == MPI_THREAD_MULTIPLE;
}

// SCHED_BATCH: a woken producer waits for a free core or the next tick instead of preempting
// the thread that woke it, which is inside next() (see "Hand-off" in loader.hpp). Best effort:
// the loader works the same without it.
void stop_wakeup_preemption() {
#ifdef SCHED_BATCH
  sched_param p{};
  p.sched_priority = 0;
  static_cast<void>(pthread_setschedparam(pthread_self(), SCHED_BATCH, &p));
#endif
}

// The paced producer's sleeps (idle_wait()), in seconds: paced, and after looks that found
// nothing to do.
constexpr double kIdleWaitMin = 20e-6, kIdleWaitMax = 2e-3, kIdleWaitLongest = 0.1;
// Elements of a permutation the idle producer computes before it looks for work again.
constexpr std::uint64_t kOrderPiece = 16384;

}  // namespace

struct Loader::Impl {
  using Buffer = detail::BatchBuffer;

  Impl(mpi::Comm c, LoaderOptions o) : opts(std::move(o)), comm(std::move(c)) {}

  LoaderOptions opts;
  mpi::Comm comm;  // a dup of the caller's communicator: only the producer uses it
  // The node's staged copy (stage_dir set), made by the constructor; declared before the
  // feeder, whose Source reads it over staged->topo.node().
  std::unique_ptr<detail::StagedCopy> staged;
  bool threaded = false;
  // Made by the producer thread (threaded) or the constructor; its HDF5 calls happen on that
  // thread only, but next() may gather() from it concurrently (in memory).
  std::unique_ptr<detail::Feeder> feeder;

  // Copied from the feeder once it is open (read by the main thread without a lock).
  std::int64_t rows = 0, cols = 0, steps = 0;
  bool has_labels = false;
  Residency residency = Residency::partition;
  bool in_memory = false;
  ResidentData resident;

  std::mutex m;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Buffer>> storage;
  std::deque<Buffer*> pool, ready;  // empty buffers; filled ones in step order
  Buffer* held = nullptr;
  std::uint64_t generation = 0;
  bool started = false, stop = false, close_file = true;
  bool early = false;  // may produce epoch 0 before the first start_epoch (no HDF5 needed)
  bool init_done = false;
  bool producer_idle = false;  // the producer waits on cv and nobody has woken it yet
  // The consumer's pace: a moving average of the time between next() calls (0: none yet),
  // from which the idle producer times its sleep (see idle_wait()).
  double pace_s = 0;
  std::chrono::steady_clock::time_point last_next{};
  std::int64_t ordered_epoch = -1;  // the last epoch whose order the idle producer prepared
  bool producer_backing_off = false;  // its sleep is one of the doubling ones (idle_wait())
  // For tests (LoaderTestAccess): next()'s wake-ups of the producer, the producer's timed
  // sleeps (paced_producer).
  std::int64_t consumer_wakeups = 0, paced_sleeps = 0;
  bool held_back = false;      // LoaderTestAccess::hold_producer
  std::exception_ptr error;  // from opening (init) or from a read
  std::int64_t epoch = -1;         // the epoch next() serves (-1 before start_epoch)
  std::int64_t produce_epoch = 0;  // the epoch the producer fills: `epoch`, or epoch + 1
                                   // once it is done with `epoch` (speculation, see below)
  std::int64_t produce_step = 0;  // next step the producer starts
  std::int64_t consume_step = 0;  // next step next() returns
  std::thread producer;

  double wait_total = 0, wait_last = 0;
  std::int64_t consumer_batches = 0;

  void adopt(const detail::Feeder& f) {
    rows = static_cast<std::int64_t>(f.geometry().rows());
    cols = static_cast<std::int64_t>(f.cols());
    steps = static_cast<std::int64_t>(f.geometry().steps());
    has_labels = f.has_labels();
    residency = f.residency();
    in_memory = f.in_memory();
    resident = f.resident();
  }
  void run();
  bool has_work();
  std::chrono::microseconds idle_wait(int idle) const;
  bool prepare_next_order(std::unique_lock<std::mutex>& lk, detail::Feeder& f);
  void produce(detail::Feeder& f);
  bool keep_speculation(std::int64_t e, std::int64_t first_step);
  Buffer* claim_step();
  const LoadedBatch* next_threaded(std::chrono::steady_clock::time_point called);
  const LoadedBatch* next_sync();
  const LoadedBatch* peek_threaded();
  const LoadedBatch* peek_next_epoch_threaded();
};

// The producer thread: every HDF5 call of a threaded loader happens here.
void Loader::Impl::run() {
  pthread_setname_np(pthread_self(), "locus-loader");  // for top -H, perf and the bench
  detail::Feeder* f = nullptr;
  try {
    auto made = std::make_unique<detail::Feeder>(comm, opts, staged.get());
    std::lock_guard<std::mutex> lk(m);
    feeder = std::move(made);
    f = feeder.get();
    adopt(*f);
    init_done = true;
  } catch (...) {
    std::lock_guard<std::mutex> lk(m);
    error = std::current_exception();
    init_done = true;
  }
  cv.notify_all();
  if (f == nullptr) return;
  stop_wakeup_preemption();
  produce(*f);
  if (!close_file) {
    f->abandon();
    return;
  }
  try {
    f->close();
  } catch (const std::exception& e) {
    // Nobody is left to rethrow to: the destructor asked for the close.
    std::fprintf(stderr, "[rank %d] warning: closing '%s' failed: %s\n", mpi::world_rank(),
                 opts.path.c_str(), e.what());
  }
}

// Called with m held. Once every batch of the epoch is produced, the producer goes on with
// the first batches of the next epoch (at most the ring's depth), so the first steps after a
// start_epoch(epoch + 1) — the trainer's usual next call — find their batches ready. For
// shuffle none the batches do not depend on the epoch, so any start_epoch(e, 0) takes them.
// Before the first start_epoch (epoch = -1) the in-memory residencies prepare epoch 0.
bool Loader::Impl::has_work() {
  if (!(started || early) || error || pool.empty() || held_back) return false;
  if (produce_step >= steps && produce_epoch == epoch) {
    produce_epoch = epoch + 1;
    produce_step = 0;
  }
  return produce_step < steps;
}

// Called with m held: whether start_epoch(e, first_step) can take the speculated batches;
// if so, drops what is left of the old epoch from the ring.
bool Loader::Impl::keep_speculation(std::int64_t e, std::int64_t first_step) {
  const bool speculating = produce_epoch != epoch;
  if (!threaded || !speculating || first_step != 0) return false;
  if (e != produce_epoch && opts.shuffle != Shuffle::none) return false;
  while (!ready.empty() && ready.front()->batch.epoch != produce_epoch) {
    pool.push_back(ready.front());
    ready.pop_front();
  }
  return true;
}

// Called with m held, nothing to produce (the ring full, as a rule), paced_producer: how long
// the producer sleeps after `idle` looks that found nothing to do. It comes back by itself
// when the consumer, at its pace, should have taken the ring down to half its depth: between
// 20 µs and 2 ms. While the consumer pauses (evaluation, a checkpoint, another loader's turn)
// each look that finds nothing doubles the sleep, up to 100 ms; the consumer resuming finds
// the ring full, and wakes the producer should it empty the ring first.
std::chrono::microseconds Loader::Impl::idle_wait(int idle) const {
  const auto half = static_cast<std::size_t>(opts.prefetch_depth / 2);
  const double above = ready.size() > half ? static_cast<double>(ready.size() - half) : 1.0;
  double s = pace_s > 0 ? std::clamp(pace_s * above, kIdleWaitMin, kIdleWaitMax) : kIdleWaitMax;
  s = std::min(std::ldexp(s, idle), kIdleWaitLongest);
  return std::chrono::microseconds(static_cast<std::int64_t>(s * 1e6));
}

// Called with m held, nothing to produce: computes the permutation of the epoch after the
// consumer's, so that the epoch's first batches do not wait for it (a shuffled 60000-row order
// took about 0.7 ms on the 2-core VM, up to 3 ms with the first touch of its memory: an epoch of
// 8192-row steps on a GPU is about 2 ms). In pieces of kOrderPiece elements (~0.2 ms), m
// released meanwhile, so the producer looks for work between them. Returns whether it worked
// on it (and so released m).
bool Loader::Impl::prepare_next_order(std::unique_lock<std::mutex>& lk, detail::Feeder& f) {
  if (stop || error || epoch < 0 || ordered_epoch == epoch + 1) return false;
  const std::int64_t next = epoch + 1;
  lk.unlock();
  bool done = true;
  try {
    done = f.prepare_order(next, kOrderPiece);
  } catch (...) {
    // Only an allocation can fail here: the epoch's first fill() computes it again (and
    // reports what fails then).
  }
  lk.lock();
  if (done) ordered_epoch = next;  // if the consumer moved meanwhile, the next look redoes it
  return true;
}

void Loader::Impl::produce(detail::Feeder& f) {
  for (;;) {
    Buffer* buf = nullptr;
    std::uint64_t gen = 0;
    std::int64_t e = 0, step = 0;
    {
      std::unique_lock<std::mutex> lk(m);
      int idle = 0;  // looks that found nothing to do
      while (!stop && !has_work()) {
        if (prepare_next_order(lk, f)) continue;  // it unlocked m: look again
        producer_idle = true;  // next() and start_epoch() wake it only when this is set
        if (opts.paced_producer) {
          ++paced_sleeps;
          producer_backing_off = idle > 0;
          cv.wait_for(lk, idle_wait(idle));
          producer_backing_off = false;
          idle = std::min(idle + 1, 16);
        } else {
          cv.wait(lk);
        }
      }
      producer_idle = false;
      if (stop) return;
      buf = pool.front();
      pool.pop_front();
      gen = generation;
      e = produce_epoch;
      step = produce_step++;
    }
    std::exception_ptr failed;
    try {
      f.fill(e, step, *buf);
      buf->generation = gen;
    } catch (...) {
      failed = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lk(m);
      if (failed && gen == generation) error = failed;
      // A batch of an earlier start_epoch() is dropped: its buffer goes back to the pool.
      (failed || gen != generation ? pool : ready).push_back(buf);
    }
    cv.notify_all();
  }
}

Loader::Loader(const mpi::Comm& comm, LoaderOptions opts) {
  mpi::agree_on(comm, [&] { check_options(opts); });
  impl_ = std::make_unique<Impl>(comm.dup(), std::move(opts));
  Impl& s = *impl_;
  // Staging comes first, on this thread: the copy is complete before the first read.
  if (!s.opts.stage_dir.empty()) s.staged = detail::stage_dataset(s.comm, s.opts);
  s.threaded = s.opts.background && thread_multiple();
  HostMemory* memory = s.opts.host_memory.get();
  if (!s.threaded) {
    s.feeder = std::make_unique<detail::Feeder>(s.comm, s.opts, s.staged.get());
    s.adopt(*s.feeder);
    s.storage.push_back(std::make_unique<Impl::Buffer>(memory));
    s.feeder->reserve(*s.storage.back());
    return;
  }
  // depth buffers the producer may fill, plus the one the consumer holds.
  for (int i = 0; i <= s.opts.prefetch_depth; ++i) {
    s.storage.push_back(std::make_unique<Impl::Buffer>(memory));
    s.pool.push_back(s.storage.back().get());
  }
  s.producer = std::thread([&s] { s.run(); });
  std::unique_lock<std::mutex> lk(s.m);
  s.cv.wait(lk, [&] { return s.init_done; });
  if (s.error) {
    const std::exception_ptr e = s.error;
    lk.unlock();
    s.producer.join();
    std::rethrow_exception(e);  // agreed on every rank: the file is closed everywhere
  }
  // The producer takes no buffer before start_epoch() or `early`: allocate them here, on the
  // caller's thread (a device backend's page-locked memory belongs to the caller's device).
  lk.unlock();
  for (const auto& b : s.storage) s.feeder->reserve(*b);
  lk.lock();
  // In-memory batches need no HDF5 call, so epoch 0 may be prepared before the first
  // start_epoch without racing other threads' HDF5 calls (the trainer's set-up).
  s.early = s.in_memory;
  lk.unlock();
  s.cv.notify_all();
}

Loader::~Loader() {
  Impl& s = *impl_;
  // While an exception unwinds on this rank alone, peers may never close: leave the file.
  const bool unwinding = std::uncaught_exceptions() > 0;
  if (s.threaded) {
    {
      std::lock_guard<std::mutex> lk(s.m);
      s.stop = true;
      s.close_file = !unwinding;
    }
    s.cv.notify_all();
    if (s.producer.joinable()) s.producer.join();
    return;
  }
  if (unwinding) {
    s.feeder->abandon();
    return;
  }
  try {
    s.feeder->close();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[rank %d] warning: closing '%s' failed: %s\n", mpi::world_rank(),
                 s.opts.path.c_str(), e.what());
  }
}

std::int64_t Loader::rows() const { return impl_->rows; }
std::int64_t Loader::cols() const { return impl_->cols; }
bool Loader::has_labels() const { return impl_->has_labels; }
std::int64_t Loader::steps_per_epoch() const { return impl_->steps; }
Residency Loader::residency() const { return impl_->residency; }
bool Loader::threaded() const { return impl_->threaded; }
ResidentData Loader::resident() const { return impl_->resident; }
std::int64_t Loader::consumer_batches() const { return impl_->consumer_batches; }
double Loader::wait_seconds() const { return impl_->wait_total; }
const StageReport& Loader::stage_report() const {
  static const StageReport none;
  return impl_->staged ? impl_->staged->report : none;
}
double Loader::last_wait_seconds() const { return impl_->wait_last; }

void Loader::start_epoch(std::int64_t epoch, std::int64_t first_step) {
  Impl& s = *impl_;
  if (epoch < 0 || first_step < 0 || first_step > s.steps) {
    throw ConfigError(fmt::format("cannot start epoch {} at step {} of '{}': the epoch must be "
                                  "≥ 0 and the step in [0, {}] (steps per epoch)", epoch,
                                  first_step, s.opts.path, s.steps));
  }
  {
    std::lock_guard<std::mutex> lk(s.m);
    s.started = true;
    if (s.held) s.pool.push_back(s.held);
    s.held = nullptr;
    if (s.keep_speculation(epoch, first_step)) {
      s.produce_epoch = epoch;  // only differs for shuffle none, whose batches are alike
    } else {
      ++s.generation;  // whatever is ready or in flight is for another position: drop it
      while (!s.ready.empty()) {
        s.pool.push_back(s.ready.front());
        s.ready.pop_front();
      }
      s.produce_epoch = epoch;
      s.produce_step = first_step;
    }
    s.epoch = epoch;
    s.consume_step = first_step;
    s.producer_idle = false;
  }
  s.cv.notify_all();
}

// Called with m held, the ring empty: takes the next step away from the producer when it
// has not started it and the samples are in memory, so next() gathers it instead of waiting
// for the producer to be scheduled (the producer goes on with the step after). Not when the
// epoch's permutation is still to be computed: the producer has most of it done (its pieces,
// prepare_next_order()), and waiting for the rest costs less than computing it all here.
Loader::Impl::Buffer* Loader::Impl::claim_step() {
  if (!in_memory || pool.empty() || produce_epoch != epoch || produce_step != consume_step) {
    return nullptr;
  }
  if (!held_back && !feeder->has_order(epoch)) return nullptr;
  Buffer* buf = pool.front();
  pool.pop_front();
  ++produce_step;
  return buf;
}

const LoadedBatch* Loader::Impl::next_threaded(std::chrono::steady_clock::time_point called) {
  std::unique_lock<std::mutex> lk(m);
  if (held) {
    pool.push_back(held);
    held = nullptr;
  }
  if (error) std::rethrow_exception(error);
  // The freed buffer may be work for a sleeping producer. It is woken outside the lock (so it
  // does not block on m at once) and not at all while it works (it looks at the pool before it
  // sleeps). A wake-up is a system call on this thread, the one that launches the device's
  // next step, so it is rationed: only once the ring is down to half its depth (then the
  // producer refills several buffers per wake-up), and with paced_producer only when the ring
  // is empty (the producer comes back by itself at this thread's pace, idle_wait()).
  if (opts.paced_producer && last_next.time_since_epoch().count() != 0) {
    // A pause (evaluation, a checkpoint, an epoch's end) counts as at most four steps, and
    // nothing above idle_wait()'s paced maximum matters.
    double dt = std::min(std::chrono::duration<double>(called - last_next).count(), kIdleWaitMax);
    if (pace_s > 0) dt = std::min(dt, 4 * pace_s);
    pace_s = pace_s > 0 ? pace_s + (dt - pace_s) / 4 : dt;
  }
  last_next = called;
  const std::size_t low =
      opts.paced_producer ? 0 : static_cast<std::size_t>(opts.prefetch_depth / 2);
  bool wake = producer_idle && ready.size() <= low;
  if (wake) producer_idle = false;
  const auto unlock_and_wake = [&] {
    if (wake) ++consumer_wakeups;
    lk.unlock();
    if (wake) cv.notify_all();
    wake = false;
  };
  if (consume_step >= steps) {
    unlock_and_wake();
    return nullptr;
  }
  if (ready.empty()) {
    if (Buffer* buf = claim_step()) {
      const std::int64_t step = consume_step++;
      held = buf;
      ++consumer_batches;
      // The producer, where it is to be woken, only after this gather: two gathers at once
      // share the copy pool (one of them would copy alone, CopyPool::run), and this is the
      // batch the caller waits for. (The producer, marked not idle, cannot be woken twice.)
      const bool wake_after = wake;
      if (wake_after) ++consumer_wakeups;
      wake = false;
      lk.unlock();
      try {
        feeder->gather(epoch, step, *buf, false);  // memory only: nothing to fail but an allocation
      } catch (...) {
        if (wake_after) cv.notify_all();
        throw;
      }
      if (wake_after) cv.notify_all();
      return &buf->batch;
    }
    if (wake) {  // before sleeping: the producer may have to fill this very batch
      unlock_and_wake();
      lk.lock();
    }
    cv.wait(lk, [&] { return !ready.empty() || error; });
    if (error) std::rethrow_exception(error);
  }
  held = ready.front();
  ready.pop_front();
  if (opts.paced_producer && ready.empty() && producer_idle && producer_backing_off) {
    // This took the last batch while the producer is on a long sleep (the consumer paused):
    // wake it now, not at the next call, which would find nothing. (A producer on its paced
    // sleep is about to come back by itself.)
    wake = true;
    producer_idle = false;
  }
  if (opts.shuffle == Shuffle::none) held->batch.epoch = epoch;  // speculated as epoch + 1
  LOCUS_ASSERT(held->batch.step == consume_step && held->batch.epoch == epoch,
               fmt::format("loader produced epoch {} step {}, expected epoch {} step {}",
                           held->batch.epoch, held->batch.step, epoch, consume_step));
  ++consume_step;
  Buffer* out = held;
  unlock_and_wake();
  return &out->batch;
}

void LoaderTestAccess::hold_producer(Loader& l, bool hold) {
  Loader::Impl& s = *l.impl_;
  {
    std::lock_guard<std::mutex> lk(s.m);
    s.held_back = hold;
  }
  s.cv.notify_all();
}

std::size_t LoaderTestAccess::ready_batches(Loader& l) {
  Loader::Impl& s = *l.impl_;
  std::lock_guard<std::mutex> lk(s.m);
  return s.ready.size();
}

std::int64_t LoaderTestAccess::consumer_wakeups(Loader& l) {
  Loader::Impl& s = *l.impl_;
  std::lock_guard<std::mutex> lk(s.m);
  return s.consumer_wakeups;
}

std::int64_t LoaderTestAccess::paced_sleeps(Loader& l) {
  Loader::Impl& s = *l.impl_;
  std::lock_guard<std::mutex> lk(s.m);
  return s.paced_sleeps;
}

// The front of the ring when it is the step next() hands out next (for none, batches
// speculated for epoch + 1 are alike: next() relabels them).
const LoadedBatch* Loader::Impl::peek_threaded() {
  const std::lock_guard<std::mutex> lk(m);
  if (error || consume_step >= steps || ready.empty()) return nullptr;
  const Buffer* front = ready.front();
  if (front->batch.step != consume_step ||
      (front->batch.epoch != epoch && opts.shuffle != Shuffle::none)) {
    return nullptr;
  }
  return &front->batch;
}

const LoadedBatch* Loader::peek() {
  Impl& s = *impl_;
  return s.started && s.threaded ? s.peek_threaded() : nullptr;
}

// Once the epoch is handed out, the ring holds only the speculated batches of the next one
// (has_work()), in step order; the front is its first when the producer has begun it.
const LoadedBatch* Loader::Impl::peek_next_epoch_threaded() {
  const std::lock_guard<std::mutex> lk(m);
  if (error || consume_step < steps || produce_epoch == epoch || ready.empty()) return nullptr;
  const Buffer* front = ready.front();
  if (front->batch.step != 0 || front->batch.epoch != produce_epoch) return nullptr;
  return &front->batch;
}

const LoadedBatch* Loader::peek_next_epoch() {
  Impl& s = *impl_;
  return s.started && s.threaded ? s.peek_next_epoch_threaded() : nullptr;
}

const LoadedBatch* Loader::Impl::next_sync() {
  if (consume_step >= steps) return nullptr;
  Buffer& buf = *storage.front();
  feeder->fill(epoch, consume_step, buf);
  ++consume_step;
  return &buf.batch;
}

const LoadedBatch* Loader::next() {
  Impl& s = *impl_;
  if (!s.started) {
    throw InternalError(fmt::format("Loader::next() on '{}' before start_epoch(); start an "
                                    "epoch first", s.opts.path));
  }
  const auto t0 = std::chrono::steady_clock::now();
  const LoadedBatch* b = s.threaded ? s.next_threaded(t0) : s.next_sync();
  s.wait_last = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s.wait_total += s.wait_last;
  return b;
}

}  // namespace locus::train
