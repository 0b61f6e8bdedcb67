// Which ranks hold which layers: the all-gathered held ranges and each rank's share of a
// tensor's rows among the ranks holding it (see layer_owners.hpp).
#include "model/layer_owners.hpp"

#include <fmt/format.h>

#include "locus/comm/error.hpp"

namespace locus::train::detail {

LayerOwners::LayerOwners(const mpi::Comm& comm, LayerRange mine, int layers)
    : rank_(comm.rank()) {
  const std::vector<int> firsts = comm.allgather(mine.first);
  const std::vector<int> ends = comm.allgather(mine.end);
  for (std::size_t r = 0; r < firsts.size(); ++r) ranges_.push_back({firsts[r], ends[r]});
  std::vector<int> held(static_cast<std::size_t>(layers), 0);
  for (const LayerRange& r : ranges_) {
    LOCUS_ASSERT(r.first >= 0 && r.first < r.end && r.end <= layers,
                 fmt::format("a rank holds layers [{}, {}) of a {}-layer model", r.first, r.end,
                             layers));
    for (int l = r.first; l < r.end; ++l) ++held[static_cast<std::size_t>(l)];
    all_whole_ = all_whole_ && r.first == 0 && r.end == layers;
    for (const LayerRange& o : ranges_) {
      LOCUS_ASSERT(o == r || o.end <= r.first || r.end <= o.first,
                   fmt::format("ranks hold overlapping layers [{}, {}) and [{}, {})", r.first,
                               r.end, o.first, o.end));
    }
  }
  for (int l = 0; l < layers; ++l) {
    LOCUS_ASSERT(held[static_cast<std::size_t>(l)] > 0,
                 fmt::format("no rank holds layer {} of {}", l, layers));
  }
}

int LayerOwners::holders(int layer) const {
  int n = 0;
  for (const LayerRange& r : ranges_) n += r.contains(layer) ? 1 : 0;
  return n;
}

h5::RowRange LayerOwners::rows(int layer, std::uint64_t rows) const {
  if (!ranges_[static_cast<std::size_t>(rank_)].contains(layer)) return {};
  int index = 0;
  for (int r = 0; r < rank_; ++r) {
    index += ranges_[static_cast<std::size_t>(r)].contains(layer) ? 1 : 0;
  }
  return h5::partition_rows(rows, index, holders(layer));
}

mpi::Comm LayerOwners::group(const mpi::Comm& comm) const {
  if (all_whole_) return comm.view();
  // Ranges are equal or disjoint, so the first layer names the group.
  return comm.split(ranges_[static_cast<std::size_t>(rank_)].first, comm.rank());
}

}  // namespace locus::train::detail
