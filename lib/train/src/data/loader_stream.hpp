// The loader's out-of-core path (private): serves a partition that exceeds memory_budget in
// the window-group order of StreamPlan, holding two groups — the one being served and the
// next, read one window per batch so the file reads spread over the steps instead of
// stalling the producer at each group boundary.
#pragma once

#include <cstdint>
#include <vector>

#include "data/loader_plan.hpp"
#include "data/loader_source.hpp"

namespace locus::train::detail {

struct BatchBuffer;

class Streamer {
 public:
  // group_rows: the rows of one group; two groups are held at once.
  Streamer(Source& source, h5::RowRange partition, std::uint64_t group_rows, bool shuffled);

  void begin_epoch(std::uint64_t seed, std::uint64_t epoch);
  // Fills out.ids/x/y with this rank's partition positions [first, first + count) of the
  // epoch order; independent reads only.
  void fill(std::uint64_t first, std::uint64_t count, BatchBuffer& out);

 private:
  struct Group {
    std::int64_t index = -1;
    std::vector<h5::RowRange> windows;  // ascending file order
    std::size_t windows_read = 0;
    std::vector<float> x;
    std::vector<std::int32_t> y;
    std::vector<std::uint64_t> ids;     // file row of each buffered row, ascending
    std::vector<std::uint64_t> order;   // epoch order: indices into the buffered rows
    std::uint64_t start = 0, end = 0;   // partition positions served by the group
    bool complete() const { return windows_read == windows.size(); }
  };
  void start(Group& g, std::uint64_t q);
  void read_window(Group& g);
  void enter(std::uint64_t p);

  Source& source_;
  StreamPlan plan_;
  std::uint64_t cols_;
  Group cur_, next_;
};

}  // namespace locus::train::detail
