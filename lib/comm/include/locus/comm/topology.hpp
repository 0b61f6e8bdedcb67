// Which ranks of a communicator share a node: the node-local communicator, one leader per
// node, and the node count. Hierarchical reductions and node-local staging are built on it.
#pragma once

#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"

namespace locus::comm {

// How nodes are told apart, in order:
//  1. LOCUS_TEST_RANKS_PER_NODE=K (test only): ranks [0, K) of MPI_COMM_WORLD form node 0,
//     [K, 2K) node 1, ... -- so that one host can play several nodes in tests and benchmarks.
//     World ranks, not the communicator's: a sub-communicator (e.g. the data-parallel group of
//     one pipeline stage) sees the nodes its ranks really sit on, as it would on a cluster.
//  2. Otherwise the ranks that can share memory (MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)),
//     further split by Slurm node name (SLURMD_NODENAME) where it is set: several Slurm nodes
//     emulated on one host (scripts/slurm-cluster.sh --nodes) are then distinct nodes too.
// Nodes are numbered by their lowest rank in the communicator.
class Topology {
 public:
  // Collective over comm. ConfigError (the same on every rank) for a malformed
  // LOCUS_TEST_RANKS_PER_NODE.
  explicit Topology(const mpi::Comm& comm);

  // The ranks on this rank's node, ordered by their rank in comm.
  const mpi::Comm& node() const noexcept { return node_; }
  // The node leaders (node().rank() == 0), ordered by node index; a null communicator
  // (get() == MPI_COMM_NULL) on every other rank.
  const mpi::Comm& leaders() const noexcept { return leaders_; }
  bool is_leader() const noexcept { return node_.rank() == 0; }

  int node_index() const noexcept { return node_index_; }
  int nodes() const noexcept { return static_cast<int>(node_sizes_.size()); }
  // Ranks per node, by node index.
  const std::vector<int>& node_sizes() const noexcept { return node_sizes_; }
  // Node index of every rank of comm, by rank.
  const std::vector<int>& node_of_rank() const noexcept { return node_of_rank_; }
  // Every node's ranks are consecutive in comm, and all nodes have the same number of ranks.
  bool uniform_blocks() const noexcept { return uniform_blocks_; }

  // How the nodes were found: "shared memory", "shared memory and Slurm node names",
  // "LOCUS_TEST_RANKS_PER_NODE=2 (test only)".
  const std::string& source() const noexcept { return source_; }
  // "4 ranks on 2 nodes (2+2; LOCUS_TEST_RANKS_PER_NODE=2 (test only))"
  std::string describe() const;

 private:
  mpi::Comm node_;
  mpi::Comm leaders_;
  int node_index_ = 0;
  std::vector<int> node_sizes_;
  std::vector<int> node_of_rank_;
  bool uniform_blocks_ = true;
  std::string source_;
};

// LOCUS_TEST_RANKS_PER_NODE as a positive count, 0 when unset; ConfigError when malformed.
int test_ranks_per_node();

}  // namespace locus::comm
