// The Loader: option checks, the producer thread and its ring of batch buffers, the
// synchronous fallback, and data-wait accounting. Batch contents come from loader_feed.cpp.
#include "locus/train/data/loader.hpp"

#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <exception>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "data/loader_feed.hpp"
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

}  // namespace

struct Loader::Impl {
  using Buffer = detail::BatchBuffer;

  Impl(mpi::Comm c, LoaderOptions o) : opts(std::move(o)), comm(std::move(c)) {}

  LoaderOptions opts;
  mpi::Comm comm;  // a dup of the caller's communicator: only the producer uses it
  bool threaded = false;
  std::unique_ptr<detail::Feeder> feeder;  // owned here only in synchronous mode

  // Copied from the feeder once it is open (read by the main thread without a lock).
  std::int64_t rows = 0, cols = 0, steps = 0;
  bool has_labels = false;
  Residency residency = Residency::partition;

  std::mutex m;
  std::condition_variable cv;
  std::vector<std::unique_ptr<Buffer>> storage;
  std::deque<Buffer*> pool, ready;  // empty buffers; filled ones in step order
  Buffer* held = nullptr;
  std::uint64_t generation = 0;
  bool started = false, stop = false, close_file = true;
  bool early = false;  // may produce epoch 0 before the first start_epoch (no HDF5 needed)
  bool init_done = false;
  std::exception_ptr error;  // from opening (init) or from a read
  std::int64_t epoch = -1;         // the epoch next() serves (-1 before start_epoch)
  std::int64_t produce_epoch = 0;  // the epoch the producer fills: `epoch`, or epoch + 1
                                   // once it is done with `epoch` (speculation, see below)
  std::int64_t produce_step = 0;  // next step the producer starts
  std::int64_t consume_step = 0;  // next step next() returns
  std::thread producer;

  double wait_total = 0, wait_last = 0;

  void adopt(const detail::Feeder& f) {
    rows = static_cast<std::int64_t>(f.geometry().rows());
    cols = static_cast<std::int64_t>(f.cols());
    steps = static_cast<std::int64_t>(f.geometry().steps());
    has_labels = f.has_labels();
    residency = f.residency();
  }
  void run();
  bool has_work();
  void produce(detail::Feeder& f);
  bool keep_speculation(std::int64_t e, std::int64_t first_step);
  const LoadedBatch* next_threaded();
  const LoadedBatch* next_sync();
};

// The producer thread: every HDF5 call of a threaded loader happens here.
void Loader::Impl::run() {
  pthread_setname_np(pthread_self(), "locus-loader");  // for top -H, perf and the bench
  std::unique_ptr<detail::Feeder> f;
  try {
    f = std::make_unique<detail::Feeder>(comm, opts);
  } catch (...) {
    std::lock_guard<std::mutex> lk(m);
    error = std::current_exception();
    init_done = true;
    cv.notify_all();
    return;
  }
  {
    std::lock_guard<std::mutex> lk(m);
    adopt(*f);
    // In-memory batches need no HDF5 call, so epoch 0 may be prepared before the first
    // start_epoch without racing other threads' HDF5 calls (the trainer's set-up).
    early = residency == Residency::partition || residency == Residency::dataset;
    init_done = true;
  }
  cv.notify_all();
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
  if (!(started || early) || error || pool.empty()) return false;
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

void Loader::Impl::produce(detail::Feeder& f) {
  for (;;) {
    Buffer* buf = nullptr;
    std::uint64_t gen = 0;
    std::int64_t e = 0, step = 0;
    {
      std::unique_lock<std::mutex> lk(m);
      cv.wait(lk, [&] {
        return stop || has_work();
      });
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
  s.threaded = s.opts.background && thread_multiple();
  if (!s.threaded) {
    s.feeder = std::make_unique<detail::Feeder>(s.comm, s.opts);
    s.adopt(*s.feeder);
    s.storage.push_back(std::make_unique<Impl::Buffer>());
    return;
  }
  // depth buffers the producer may fill, plus the one the consumer holds.
  for (int i = 0; i <= s.opts.prefetch_depth; ++i) {
    s.storage.push_back(std::make_unique<Impl::Buffer>());
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
double Loader::wait_seconds() const { return impl_->wait_total; }
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
  }
  s.cv.notify_all();
}

const LoadedBatch* Loader::Impl::next_threaded() {
  std::unique_lock<std::mutex> lk(m);
  if (held) {
    pool.push_back(held);
    held = nullptr;
    cv.notify_all();
  }
  if (error) std::rethrow_exception(error);
  if (consume_step >= steps) return nullptr;
  cv.wait(lk, [&] { return !ready.empty() || error; });
  if (error) std::rethrow_exception(error);
  held = ready.front();
  ready.pop_front();
  if (opts.shuffle == Shuffle::none) held->batch.epoch = epoch;  // speculated as epoch + 1
  LOCUS_ASSERT(held->batch.step == consume_step && held->batch.epoch == epoch,
               fmt::format("loader produced epoch {} step {}, expected epoch {} step {}",
                           held->batch.epoch, held->batch.step, epoch, consume_step));
  ++consume_step;
  return &held->batch;
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
  const LoadedBatch* b = s.threaded ? s.next_threaded() : s.next_sync();
  s.wait_last = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  s.wait_total += s.wait_last;
  return b;
}

}  // namespace locus::train
