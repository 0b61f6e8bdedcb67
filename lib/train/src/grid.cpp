// The data-parallel × pipeline process grid (see grid.hpp for the rank layout and placement).
#include "locus/train/grid.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <numeric>

#include "locus/comm/error.hpp"
#include "locus/comm/topology.hpp"

namespace locus::train {

namespace {

// Every rank sees the same world size and the same option, so every rank throws alike.
void check_stages(const mpi::Comm& world, int stages) {
  if (stages < 1) {
    throw ConfigError(fmt::format("train.pipeline_stages = {} is invalid: use 1 (pure data "
                                  "parallelism) or more",
                                  stages));
  }
  if (world.size() % stages != 0) {
    throw ConfigError(fmt::format("train.pipeline_stages = {} does not divide the {} ranks of "
                                  "this job: run with a multiple of {} ranks, or set "
                                  "pipeline_stages to a divisor of {}",
                                  stages, world.size(), stages, world.size()));
  }
}

// Collective over world: world renumbered by grid position, the layout text and the ranks
// on this rank's node.
mpi::Comm placed_world(const mpi::Comm& world, int stages, std::string& layout,
                       bool& node_local, int& node_ranks) {
  check_stages(world, stages);
  const comm::Topology topo(world);
  node_ranks = topo.node().size();
  const GridPlacement p = place_grid(topo.node_of_rank(), stages);
  node_local = p.node_local;
  if (stages == 1) {
    layout = fmt::format("one stage per replica ({})", topo.describe());
  } else if (p.node_local) {
    layout = fmt::format("pipeline stages inside nodes, replicas across nodes ({})",
                         topo.describe());
  } else {
    layout = fmt::format("{} ({})", p.note, topo.describe());
  }
  constexpr int shown = 16;
  for (int node = 0; node < std::min(topo.nodes(), shown); ++node) {
    std::string line = fmt::format("\n  node {}:", node);
    const char* sep = " ";
    for (int r = 0; r < world.size(); ++r) {
      if (topo.node_of_rank()[static_cast<std::size_t>(r)] != node) continue;
      const int pos = p.position[static_cast<std::size_t>(r)];
      line += fmt::format("{}rank {} = replica {} stage {}", sep, r, pos / stages, pos % stages);
      sep = ", ";
    }
    layout += line;
  }
  if (topo.nodes() > shown) layout += fmt::format("\n  ... and {} more nodes", topo.nodes() - shown);
  return world.split(0, p.position[static_cast<std::size_t>(world.rank())]);
}

}  // namespace

GridPlacement place_grid(const std::vector<int>& node_of_rank, int stages) {
  LOCUS_ASSERT(stages >= 1 && !node_of_rank.empty() &&
                   node_of_rank.size() % static_cast<std::size_t>(stages) == 0,
               "place_grid needs stages >= 1 dividing the rank count");
  const int nodes = *std::max_element(node_of_rank.begin(), node_of_rank.end()) + 1;
  std::vector<int> sizes(static_cast<std::size_t>(nodes), 0);
  for (const int n : node_of_rank) ++sizes[static_cast<std::size_t>(n)];
  GridPlacement p;
  p.position.resize(node_of_rank.size());
  const auto misfit = std::find_if(sizes.begin(), sizes.end(),
                                   [&](int s) { return s % stages != 0; });
  if (misfit == sizes.end()) {
    // By (node, world rank): every node holds whole replicas.
    std::vector<int> order(node_of_rank.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return node_of_rank[static_cast<std::size_t>(a)] < node_of_rank[static_cast<std::size_t>(b)];
    });
    for (std::size_t i = 0; i < order.size(); ++i)
      p.position[static_cast<std::size_t>(order[i])] = static_cast<int>(i);
    return p;
  }
  std::iota(p.position.begin(), p.position.end(), 0);
  // World order: say whether some replica still crosses a node boundary.
  for (std::size_t first = 0; first < node_of_rank.size() && p.node_local;
       first += static_cast<std::size_t>(stages)) {
    for (std::size_t r = first + 1; r < first + static_cast<std::size_t>(stages); ++r)
      p.node_local = p.node_local && node_of_rank[r] == node_of_rank[first];
  }
  if (!p.node_local) {
    const auto node = static_cast<int>(misfit - sizes.begin());
    p.note = fmt::format("pipeline stages span nodes: pipeline_stages = {} does not divide the "
                         "{} rank{} of node {}, so ranks keep their world order and some "
                         "replicas' stage links cross nodes",
                         stages, *misfit, *misfit == 1 ? "" : "s", node);
  }
  return p;
}

Grid::Grid(const mpi::Comm& world, int pipeline_stages)
    : world_(placed_world(world, pipeline_stages, layout_, node_local_, node_ranks_)),
      dp_(world_.split(/*color=*/world_.rank() % pipeline_stages, world_.rank())),
      pp_(world_.split(/*color=*/world_.rank() / pipeline_stages, world_.rank())) {
  LOCUS_ASSERT(dp_.size() * pp_.size() == world_.size(),
               fmt::format("grid {} x {} does not cover {} ranks", dp_.size(), pp_.size(),
                           world_.size()));
  LOCUS_ASSERT(world_.rank() == dp_.rank() * pp_.size() + pp_.rank(),
               "the grid's rank layout is not dp_rank * stages + stage");
}

std::string Grid::describe() const {
  return fmt::format("{} rank{} = {} data-parallel x {} pipeline stage{}", world_.size(),
                     world_.size() == 1 ? "" : "s", data_parallel(), pipeline_stages(),
                     pipeline_stages() == 1 ? "" : "s");
}

}  // namespace locus::train
