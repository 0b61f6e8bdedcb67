// The process grid of a training job: world = data_parallel × pipeline_stages, with one
// communicator per axis. The trainer reduces gradients and partitions data over dp() only, so
// pipeline stages slot in later without touching the data-parallel code.
#pragma once

#include <string>

#include "locus/comm/mpi.hpp"

namespace locus::train {

// Rank layout: world rank = dp_rank * pipeline_stages + stage. The stages of one model replica
// are consecutive ranks, hence usually on one node, where the per-micro-batch activation
// traffic between neighbouring stages is heaviest; the data-parallel groups (one gradient
// all-reduce per step, overlapped with backward) stride across nodes.
class Grid {
 public:
  // Collective over world. pipeline_stages must be >= 1 and divide world.size() (ConfigError,
  // identical on every rank, otherwise). The grid owns duplicates of world and its splits.
  Grid(const mpi::Comm& world, int pipeline_stages);

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

 private:
  mpi::Comm world_;
  mpi::Comm dp_;
  mpi::Comm pp_;
};

}  // namespace locus::train
