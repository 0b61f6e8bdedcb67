// The scoring loop's main thread: claims units (two at most: one computing, the next being
// read), reads them stripe by stripe into a ring of buffers just ahead of the compute thread,
// finishes (softmax, argmax, metrics on the cpu; metrics from the device's outputs on a GPU)
// and writes the units it won, and polls for stragglers. The compute thread runs the engine
// (forward passes, or the device pipeline), and never waits for this thread as long as the
// ring holds a stripe.
#include "pipeline.hpp"

#include <mpi.h>
#include <time.h>

#include <algorithm>

#include "huge_pages.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/comm/watchdog.hpp"

namespace locus::infer::detail {

namespace {

double process_cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

constexpr auto kPoll = std::chrono::milliseconds(2);  // straggler check while computing
constexpr std::uint64_t kStripeBytes = std::uint64_t{2} << 20;
constexpr std::uint64_t kRingBytes = std::uint64_t{16} << 20;  // read-ahead: ~20 ms of compute
constexpr std::uint64_t kMinStripes = 3;

// Stripes in the ring: about kRingBytes of them, but no more than two units need.
std::size_t ring_stripes(std::uint64_t stripe_rows, std::uint64_t unit_rows, std::uint64_t cols) {
  const std::uint64_t per_unit = (unit_rows + stripe_rows - 1) / stripe_rows + 1;
  const std::uint64_t by_bytes = kRingBytes / (stripe_rows * cols * sizeof(float));
  return static_cast<std::size_t>(
      std::max<std::uint64_t>(kMinStripes, std::min(by_bytes, 2 * per_unit)));
}

class Loop {
 public:
  Loop(WorkQueue& q, const UnitGrid& g, Engine& sc, LocalInput& in, PredictionFile& out,
       int rank, const SlowDown& slow, std::uint64_t read_rows, comm::ProgressTicker& ticker)
      : queue_(q), grid_(g), engine_(sc), in_(in), out_(out), rank_(rank), ticker_(ticker),
        stripe_rows_(stripe_rows(read_rows, static_cast<std::uint64_t>(sc.spec().batch_rows),
                                 g.unit_rows, in.cols())),
        stripes_(ring_stripes(stripe_rows_, g.unit_rows, in.cols())),
        ring_(stripes_.size() * stripe_rows_ * in.cols()),
        attached_(sc.attach(ring_, stripe_rows_, g.unit_rows)),
        worker_(sc, slow, stripes_.size() / 2) {
    units_[1].slot = 1;
    res_.unit_loss.assign(static_cast<std::size_t>(g.units()), 0.0);
    res_.metrics.reset(in.has_labels() ? sc.outputs() : 0);
  }
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;
  // Stops the units still queued or computing (only when an error unwinds) before the thread
  // is joined.
  ~Loop() {
    for (UnitWork& u : units_) u.cancel = true;
  }

  LoopResult run() {
    const double cpu0 = process_cpu_seconds();
    const double compute_cpu0 = worker_.cpu_seconds();
    const double t0 = MPI_Wtime();
    bool exhausted = false;
    while (true) {
      ticker_.poll(queue_);
      Stripe* s = free_stripe();
      UnitWork* reading = reading_unit();
      if (s != nullptr && reading != nullptr) {
        read_stripe(*reading, *s);
        worker_.submit(*s);
        continue;
      }
      UnitWork* spare = free_unit();
      if (s != nullptr && spare != nullptr && !exhausted) {
        if (!claim(*spare)) exhausted = true;
        continue;
      }
      if (std::none_of(std::begin(units_), std::end(units_), [](const UnitWork& u) {
            return u.unit >= 0;
          })) {
        break;
      }
      wait();
    }
    res_.stats.cpu_seconds = process_cpu_seconds() - cpu0;
    res_.stats.seconds_compute = worker_.busy_seconds();
    res_.stats.cpu_seconds_compute = worker_.cpu_seconds() - compute_cpu0;
    res_.stats.seconds_idle = MPI_Wtime() - t0 - res_.stats.seconds_compute;
    return std::move(res_);
  }

 private:
  Stripe* free_stripe() {
    for (Stripe& s : stripes_)
      if (s.unit == nullptr) return &s;
    return nullptr;
  }
  UnitWork* free_unit() {
    for (UnitWork& u : units_)
      if (u.unit < 0) return &u;
    return nullptr;
  }
  // The claimed unit with rows not yet read (claims happen only once the previous unit is read
  // to its end, so there is at most one).
  UnitWork* reading_unit() {
    for (UnitWork& u : units_)
      if (u.unit >= 0 && u.next_read < u.rows.end()) return &u;
    return nullptr;
  }

  // Claims a unit into u (and reads its labels); false when nothing is left.
  bool claim(UnitWork& u) {
    const std::int64_t held[2] = {units_[0].unit, units_[1].unit};
    if (res_.stats.claimed + res_.stats.speculative == 1 && !held_) {
      held_ = true;  // a test may hold the job here, mid-run (LOCUS_TEST_HOLD)
      test_hold("infer-second-unit", [&] {
        ticker_.poll(queue_);
        queue_.progress();
      });
    }
    comm::progress("work queue fetch (one-sided, on rank 0's window)");
    test_hook("infer-claim");  // a rank dies or stalls as its peers use the window
    const WorkQueue::Claim c = queue_.claim(held);
    if (c.unit < 0) return false;
    ++(c.speculative ? res_.stats.speculative : res_.stats.claimed);
    if (!queue_.solo() && queue_.finished(c.unit)) {  // a faster rank already scored it
      ++res_.stats.abandoned;
      return true;
    }
    const double t0 = MPI_Wtime();
    u.unit = c.unit;
    u.speculative = c.speculative;
    u.rows = grid_.rows(c.unit);
    u.origin = grid_.origin(c.unit);
    u.next_read = u.rows.begin;
    u.y.resize(in_.has_labels() ? u.rows.count : 0);
    if (!u.y.empty()) in_.read_labels(u.rows.begin, u.y);
    engine_.start_unit(u);
    u.completed = true;
    u.cancel = false;
    res_.stats.seconds_read += MPI_Wtime() - t0;
    return true;
  }

  // Reads u's next rows, up to the next stripe boundary of its batch grid (so no batch is cut),
  // into s. A unit another rank finished is not read any further: its remainder goes to the
  // compute thread as one empty stripe, to be skipped.
  void read_stripe(UnitWork& u, Stripe& s) {
    comm::progress("reading rows from {} of unit {}", u.next_read, u.unit);
    const double t0 = MPI_Wtime();
    const std::uint64_t boundary =
        u.origin + ((u.next_read - u.origin) / stripe_rows_ + 1) * stripe_rows_;
    const bool cancelled = u.cancel.load();
    const std::uint64_t end = cancelled ? u.rows.end() : std::min(boundary, u.rows.end());
    s.unit = &u;
    s.first_row = u.next_read;
    s.rows = end - u.next_read;
    s.first = u.next_read == u.rows.begin;
    s.last = end == u.rows.end();
    s.x = {};
    if (!cancelled) {
      const auto index = static_cast<std::size_t>(&s - stripes_.data());
      s.x = std::span<float>(ring_).subspan(index * stripe_rows_ * in_.cols(), s.rows * in_.cols());
      in_.read(s.first_row, s.x, {});
    }
    u.next_read = end;
    res_.stats.seconds_read += MPI_Wtime() - t0;
  }

  // Waits for the compute thread to free stripes, then completes the units it finished. With
  // other ranks, polls meanwhile whether one of them finished a unit in flight first (its
  // remaining stripes are then skipped) and lets MPI progress the one-sided requests other
  // ranks make to this rank's window.
  void wait() {
    const double t0 = MPI_Wtime();
    const auto poll = queue_.solo() ? std::chrono::milliseconds(1000) : kPoll;
    events_.freed.clear();
    events_.done.clear();
    comm::progress("scoring (waiting for the compute thread)");
    while (!worker_.wait_for(poll, events_)) {
      ticker_.poll(queue_);
      if (queue_.solo()) continue;
      queue_.progress();
      if (!queue_.speculating()) continue;
      for (UnitWork& u : units_)
        if (u.unit >= 0 && !u.cancel.load() && queue_.finished(u.unit)) u.cancel = true;
    }
    res_.stats.seconds_wait += MPI_Wtime() - t0;
    for (Stripe* s : events_.freed) s->unit = nullptr;
    for (UnitWork* u : events_.done) complete(*u);
  }

  // Post-processes and writes a unit whose forward passes this rank finished first.
  void complete(UnitWork& u) {
    if (u.completed && queue_.try_win(u.unit, static_cast<std::int64_t>(u.rows.count))) {
      comm::progress("writing the predictions of unit {}", u.unit);
      const double t0 = MPI_Wtime();
      engine_.finish(u);
      out_.write(u.rows.begin, u.scores, rank_);
      queue_.wrote(u.unit);
      out_.start_writeback();  // overlap the disk writes with the remaining units
      res_.stats.seconds_write += MPI_Wtime() - t0;
      ++res_.stats.written;
      res_.stats.speculative_wins += u.speculative;
      res_.stats.rows += static_cast<std::int64_t>(u.rows.count);
      if (in_.has_labels()) {
        res_.unit_loss[static_cast<std::size_t>(u.unit)] = u.scores.metrics.log_loss_sum;
        res_.metrics.merge(u.scores.metrics);
      }
    } else {
      ++res_.stats.abandoned;
    }
    u.unit = -1;
  }

  WorkQueue& queue_;
  UnitGrid grid_;
  Engine& engine_;
  LocalInput& in_;
  PredictionFile& out_;
  int rank_;
  comm::ProgressTicker& ticker_;
  bool held_ = false;  // past the test hold point
  std::uint64_t stripe_rows_;
  UnitWork units_[2];
  std::vector<Stripe> stripes_;
  std::vector<float, HugePageAllocator<float>> ring_;  // stripes_.size() x stripe_rows_ rows
  std::unique_ptr<Engine::Attachment> attached_;       // released after worker_ is joined
  ComputeThread::Events events_;
  ComputeThread worker_;  // last: joined before the units and stripes it uses are destroyed
  LoopResult res_;
};

}  // namespace

std::uint64_t stripe_rows(std::uint64_t read_rows, std::uint64_t batch_rows,
                          std::uint64_t unit_rows, std::uint64_t cols) {
  batch_rows = std::max<std::uint64_t>(batch_rows, 1);
  auto round_up = [&](std::uint64_t rows) {
    return std::max<std::uint64_t>(1, (rows + batch_rows - 1) / batch_rows) * batch_rows;
  };
  const std::uint64_t wanted =
      read_rows > 0 ? read_rows : kStripeBytes / (std::max<std::uint64_t>(cols, 1) * sizeof(float));
  return std::min(round_up(wanted), round_up(unit_rows));
}

LoopResult run_units(WorkQueue& queue, const UnitGrid& grid, Engine& engine,
                     LocalInput& input, PredictionFile& out, int rank,
                     const SlowDown& slow, std::uint64_t read_rows,
                     comm::ProgressTicker& ticker) {
  return Loop(queue, grid, engine, input, out, rank, slow, read_rows, ticker).run();
}

}  // namespace locus::infer::detail
