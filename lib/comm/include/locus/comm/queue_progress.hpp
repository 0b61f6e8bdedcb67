// Progress of a long run over a work queue (locus-infer's scoring, locus-ingest's parsing), for
// the person watching the job: every interval, rank 0 reads the queue's counters (one-sided,
// a few bytes) and hands them to the app, which prints a line such as
//   scoring: 12 of 40 units, 98304 of 327680 rows (30%) in 35 s, 2809 rows/s, 1 re-run; about
//   82 s left
// The ticker is polled from the loop that drives the queue (and from the wait at its end), so
// it costs a clock read per poll and nothing on the ranks without a sink.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "locus/comm/work_queue.hpp"

namespace locus::comm {

struct QueueProgress {
  WorkQueue::Counts counts;
  std::int64_t total_amount = 0;  // of all units together (0: not known ahead, e.g. CSV rows)
  double seconds = 0;             // since the ticker started
};

// The share of the work done: of the amounts when the total is known, else of the units (1
// for a queue without units).
double done_share(const QueueProgress& p);

// The seconds left if the rate so far holds; negative when that cannot be said (nothing done
// yet) and 0 once everything is done.
double seconds_left(const QueueProgress& p);

// "<verb>: <won> of <units> units, <amount> of <total> <measure> (<pct>%) in <t>, <rate>
// <measure>/s[, <n> re-runs]; about <t> left". The share and the time left come from the
// amounts when the total is known, else from the units; "about" assumes the rate so far holds.
std::string describe(const QueueProgress& p, std::string_view verb, std::string_view measure);

// Seconds as a person reads them: "4.2 s", "42 s", "3.5 min", "2.1 h".
std::string human_seconds(double seconds);

class ProgressTicker {
 public:
  using Sink = std::function<void(const QueueProgress&)>;
  // Calls sink every interval_s seconds of polling (never when interval_s <= 0 or sink is
  // empty: a rank that does not print passes none). total_amount: see QueueProgress.
  ProgressTicker(double interval_s, std::int64_t total_amount, Sink sink);
  // Cheap unless a report is due; then reads the queue's counters (WorkQueue::counts) and
  // calls the sink.
  void poll(WorkQueue& queue);
  // Seconds since the ticker started: the clock of its reports' `seconds`.
  double seconds() const;

 private:
  using Clock = std::chrono::steady_clock;
  std::chrono::duration<double> interval_;
  std::int64_t total_;
  Sink sink_;
  Clock::time_point start_, next_;
};

}  // namespace locus::comm
