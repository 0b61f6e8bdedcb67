// The process grid of a training job: world = data_parallel × pipeline_stages, with one
// communicator per axis. The trainer reduces gradients and partitions data over dp() only, so
// pipeline stages slot in later without touching the data-parallel code.
#pragma once

#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"

namespace locus::train {

// Where the ranks of a job sit in the grid: grid position = dp_rank * pipeline_stages + stage.
// When pipeline_stages divides the rank count of every node, positions follow (node, world
// rank): a replica's stages sit inside one node, where the per-micro-batch activation traffic
// between neighbouring stages is heaviest, and replicas span nodes (one gradient all-reduce
// per step, overlapped with backward). Where nodes are consecutive blocks of world ranks that
// is the world order itself; where they are not (e.g. a cyclic distribution) ranks are
// renumbered. When the stages do not fit a node, positions are the world ranks and the stage
// links of some replicas cross nodes (node_local is false; the note says why).
struct GridPlacement {
  std::vector<int> position;   // by world rank
  bool node_local = true;      // every replica's stages on one node
  std::string note;            // why not, when !node_local
};
// Pure: node_of_rank[r] is world rank r's node (0-based); stages >= 1 divides its size.
GridPlacement place_grid(const std::vector<int>& node_of_rank, int stages);

class Grid {
 public:
  // Collective over world. pipeline_stages must be >= 1 and divide world.size() (ConfigError,
  // identical on every rank, otherwise). The grid owns world renumbered by grid position (see
  // GridPlacement; the same order as world where nodes are consecutive blocks) and its splits.
  // Nodes come from comm::Topology (LOCUS_TEST_RANKS_PER_NODE in tests).
  Grid(const mpi::Comm& world, int pipeline_stages);

  // Ranks by grid position: world().rank() == dp_rank() * pipeline_stages() + stage().
  const mpi::Comm& world() const noexcept { return world_; }
  // The ranks holding the same pipeline stage of different replicas: gradient reduction and
  // data loading happen here.
  const mpi::Comm& dp() const noexcept { return dp_; }
  // The ranks forming one model replica, ordered by stage.
  const mpi::Comm& pp() const noexcept { return pp_; }

  int data_parallel() const noexcept { return dp_.size(); }
  int pipeline_stages() const noexcept { return pp_.size(); }
  int dp_rank() const noexcept { return dp_.rank(); }
  int stage() const noexcept { return pp_.rank(); }

  // "4 ranks = 2 data-parallel x 2 pipeline stages"
  std::string describe() const;
  // Which ranks on which node hold which replica and stage, a line per node (at most 16):
  // "stages inside nodes, replicas across nodes (4 ranks on 2 nodes (2+2; ...))\n
  //  node 0: rank 0 = replica 0 stage 0, rank 1 = replica 0 stage 1\n ..."
  const std::string& layout() const noexcept { return layout_; }
  bool node_local() const noexcept { return node_local_; }
  // The ranks on this rank's node (comm::Topology's node), of the whole world.
  int node_ranks() const noexcept { return node_ranks_; }

 private:
  // Before world_: its initializer fills them.
  std::string layout_;
  bool node_local_ = true;
  int node_ranks_ = 1;
  mpi::Comm world_;
  mpi::Comm dp_;
  mpi::Comm pp_;
};

}  // namespace locus::train
