// The progress ticker of a work queue and the line it is printed as.
#include "locus/comm/queue_progress.hpp"

#include <fmt/format.h>

#include <utility>

namespace locus::comm {

std::string human_seconds(double seconds) {
  if (seconds < 9.95) return fmt::format("{:.1f} s", seconds);
  if (seconds < 99.5) return fmt::format("{:.0f} s", seconds);
  if (seconds < 99.5 * 60) return fmt::format("{:.1f} min", seconds / 60);
  return fmt::format("{:.1f} h", seconds / 3600);
}

double done_share(const QueueProgress& p) {
  const WorkQueue::Counts& c = p.counts;
  if (p.total_amount > 0) {
    return static_cast<double>(c.amount) / static_cast<double>(p.total_amount);
  }
  return c.units > 0 ? static_cast<double>(c.won) / static_cast<double>(c.units) : 1.0;
}

double seconds_left(const QueueProgress& p) {
  const double share = done_share(p);
  if (share <= 0) return -1;
  return share >= 1 ? 0 : p.seconds * (1 - share) / share;
}

std::string describe(const QueueProgress& p, std::string_view verb, std::string_view measure) {
  const WorkQueue::Counts& c = p.counts;
  const double share = done_share(p);
  std::string line = fmt::format("{}: {} of {} units, ", verb, c.won, c.units);
  if (p.total_amount > 0) {
    line += fmt::format("{} of {} {} ({:.0f}%)", c.amount, p.total_amount, measure, 100 * share);
  } else {
    line += fmt::format("{} {} ({:.0f}% of the units)", c.amount, measure, 100 * share);
  }
  line += fmt::format(" in {}, {:.0f} {}/s", human_seconds(p.seconds),
                      p.seconds > 0 ? static_cast<double>(c.amount) / p.seconds : 0.0, measure);
  if (c.reruns > 0) line += fmt::format(", {} re-run{}", c.reruns, c.reruns == 1 ? "" : "s");
  if (share > 0 && share < 1) {
    line += fmt::format("; about {} left", human_seconds(seconds_left(p)));
  } else if (share <= 0) {
    line += "; no unit finished yet";
  }
  return line;
}

ProgressTicker::ProgressTicker(double interval_s, std::int64_t total_amount, Sink sink)
    : interval_(interval_s),
      total_(total_amount),
      sink_(interval_s > 0 ? std::move(sink) : Sink{}),
      start_(Clock::now()),
      next_(start_ + std::chrono::duration_cast<Clock::duration>(interval_)) {}

double ProgressTicker::seconds() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

void ProgressTicker::poll(WorkQueue& queue) {
  if (!sink_) return;
  const Clock::time_point now = Clock::now();
  if (now < next_) return;
  // The next report one interval after this one (a long stall prints one line, not a burst).
  next_ = now + std::chrono::duration_cast<Clock::duration>(interval_);
  sink_({queue.counts(), total_, std::chrono::duration<double>(now - start_).count()});
}

}  // namespace locus::comm
