// Out-of-core streaming of a rank's partition: window groups, double-buffered, one window of
// the next group read per batch.
#include "data/loader_stream.hpp"

#include <cstring>
#include <utility>

#include "data/loader_feed.hpp"

namespace locus::train::detail {

Streamer::Streamer(Source& source, h5::RowRange partition, std::uint64_t group_rows,
                   bool shuffled)
    : source_(source), plan_(partition, group_rows, shuffled), cols_(source.cols()) {}

void Streamer::begin_epoch(std::uint64_t seed, std::uint64_t epoch) {
  plan_.begin_epoch(seed, epoch);
  cur_.index = next_.index = -1;
}

// Sizes the buffers of group q and lists its rows; the windows are read later.
void Streamer::start(Group& g, std::uint64_t q) {
  g.index = static_cast<std::int64_t>(q);
  g.windows = plan_.group_windows(q);
  g.windows_read = 0;
  g.ids.clear();
  for (const auto& w : g.windows) {
    for (std::uint64_t i = 0; i < w.count; ++i) g.ids.push_back(w.begin + i);
  }
  g.x.resize(g.ids.size() * cols_);
  g.y.resize(source_.has_labels() ? g.ids.size() : 0);
  g.order = plan_.group_order(q);
  g.start = plan_.group_start(q);
  g.end = plan_.group_start(q + 1);
}

void Streamer::read_window(Group& g) {
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < g.windows_read; ++i) offset += g.windows[i].count;
  const h5::RowRange& w = g.windows[g.windows_read];
  source_.read_runs({&w, 1}, g.x.data() + offset * cols_,
                    source_.has_labels() ? g.y.data() + offset : nullptr);
  ++g.windows_read;
}

// Makes the group holding partition position p current (taking the prefetched one when it
// is the right one) and schedules its successor.
void Streamer::enter(std::uint64_t p) {
  const std::uint64_t q = plan_.group_of(p);
  if (next_.index == static_cast<std::int64_t>(q)) {
    std::swap(cur_, next_);
  } else {
    start(cur_, q);
  }
  while (!cur_.complete()) read_window(cur_);
  next_.index = -1;
  if (q + 1 < plan_.groups()) start(next_, q + 1);
}

void Streamer::fill(std::uint64_t first, std::uint64_t count, BatchBuffer& out) {
  const bool labels = source_.has_labels();
  for (std::uint64_t i = 0; i < count; ++i) {
    const std::uint64_t p = first + i;
    if (cur_.index < 0 || p < cur_.start || p >= cur_.end) enter(p);
    const std::uint64_t row = cur_.order[p - cur_.start];
    out.ids[i] = cur_.ids[row];
    std::memcpy(out.x.data() + i * cols_, cur_.x.data() + row * cols_, cols_ * sizeof(float));
    if (labels) out.y[i] = cur_.y[row];
  }
  if (next_.index >= 0 && !next_.complete()) read_window(next_);
}

}  // namespace locus::train::detail
