// Private to lib/comm: the hierarchical chunked all-reduce engine (train.reduction =
// hierarchical). Per chunk: the ranks of a node send their chunk to the node leader; the
// leaders form a chain in node order, each continuing the running sum of the node before it;
// the last leader divides, sends the result to the other leaders, and every leader sends it to
// the ranks of its node. Only leaders exchange data across nodes, one chunk each way.
//
// Summation order: leader k computes (((R_{k-1} + x_a) + x_{a+1}) + ...) over its node's ranks
// in rank order, R_{k-1} being the previous node's running sum. Where every node's ranks are
// consecutive in the communicator (LOCUS_TEST_RANKS_PER_NODE, Slurm's block distribution) that
// is exactly the flat engine's ((x_0 + x_1) + x_2) + ...: the results are bitwise equal. Where
// they are not (e.g. a cyclic distribution), the order is node by node, then rank within the
// node: deterministic and the same on every rank, but not bitwise the flat result.
//
// Cost of keeping the order: the leaders' stage is a chain, so one chunk crosses nodes-1 links
// one after the other before the result is broadcast; chunks in flight (max_in_flight) overlap
// those hops. A node's leader also receives every node peer's whole chunk (a reduce to one
// rank, not a reduce-scatter): meant for a handful of ranks per node.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <vector>

#include "chunk_allreduce.hpp"
#include "locus/comm/topology.hpp"

namespace locus::comm::detail {

struct HierEngineConfig {
  std::size_t chunk_elems = 0;   // largest chunk ever launched
  int max_in_flight = 1;
  bool divide = true;            // divide the sum by the number of ranks (all nodes)
};

class HierEngine final : public AllreduceEngine {
 public:
  // topology is that of the reducer's communicator; the engine keeps it (its node and leader
  // communicators carry the messages).
  HierEngine(Topology topology, const HierEngineConfig& config);
  // Frees requests still in flight (only after an error: their peers are about to abort).
  ~HierEngine() override;

  bool has_free_slot() const noexcept override {
    return active_ < static_cast<int>(slots_.size());
  }
  int active() const noexcept override { return active_; }
  void launch(float* data, std::size_t count, std::size_t seq) override;
  int progress() override;

 private:
  // Leader: gather (node peers' chunks and the previous running sum) -> forward (to the next
  // leader; not on the last node) -> final (from the last leader) -> broadcast (to the other
  // leaders from the last, to the node peers). Other ranks: gather (their send) -> final.
  enum class Phase { idle, gather, forward, final, broadcast };
  struct Slot {
    Phase phase = Phase::idle;
    float* data = nullptr;
    std::size_t count = 0;
    int tag = 0;
    float* scratch = nullptr;            // leader: node peers' chunks, then the running sum
    std::vector<MPI_Request> requests;
    int posted = 0;
    int receives = 0;                    // requests[0, receives) are receives
  };

  MPI_Request* next_request(Slot& s);
  void post_gather(Slot& s);
  void post_broadcast(Slot& s);
  void post_final(Slot& s);
  void reduce_node(Slot& s);
  bool advance(Slot& s);   // true when the chunk is complete

  Topology topo_;
  HierEngineConfig config_;
  int node_size_ = 1;
  int node_rank_ = 0;
  int node_index_ = 0;
  int nodes_ = 1;
  int total_ = 1;                        // ranks over all nodes (the average's divisor)
  std::vector<float> scratch_;
  std::vector<Slot> slots_;
  std::vector<const float*> sources_;
  int active_ = 0;
};

}  // namespace locus::comm::detail
