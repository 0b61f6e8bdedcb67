// The hierarchical chunked all-reduce engine: reduce to the node leader, a chain of leaders
// in node order that continues the running sum, broadcast back (see hier_allreduce.hpp for
// the summation order and when it equals the flat engine's bit for bit).
#include "hier_allreduce.hpp"

#include <algorithm>
#include <numeric>
#include <utility>

#include "locus/comm/error.hpp"

namespace locus::comm::detail {

namespace {

// tag = (seq % tag_window) * codes + code; codes are distinct per message kind so a chunk's
// messages never match another kind's on the same communicator.
enum Code : int { contribution = 0, running_sum = 1, leader_final = 2, node_final = 3 };
constexpr int codes = 4;
constexpr std::size_t tag_window = 32767 / codes;   // MPI guarantees tags up to 32767

}  // namespace

HierEngine::HierEngine(Topology topology, const HierEngineConfig& config)
    : topo_(std::move(topology)), config_(config) {
  LOCUS_ASSERT(config_.max_in_flight >= 1 && config_.chunk_elems >= 1,
               "HierEngine needs a positive chunk size and in-flight depth");
  node_size_ = topo_.node().size();
  node_rank_ = topo_.node().rank();
  node_index_ = topo_.node_index();
  nodes_ = topo_.nodes();
  total_ = std::accumulate(topo_.node_sizes().begin(), topo_.node_sizes().end(), 0);
  // A leader holds its node peers' chunks and the previous leader's running sum.
  const std::size_t per_slot =
      topo_.is_leader() ? static_cast<std::size_t>(node_size_) * config_.chunk_elems : 0;
  scratch_.assign(static_cast<std::size_t>(config_.max_in_flight) * per_slot, 0.0f);
  slots_.resize(static_cast<std::size_t>(config_.max_in_flight));
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    slots_[i].scratch = scratch_.data() + i * per_slot;
    slots_[i].requests.assign(static_cast<std::size_t>(node_size_ + nodes_), MPI_REQUEST_NULL);
  }
  sources_.resize(static_cast<std::size_t>(node_size_ + 1));
}

HierEngine::~HierEngine() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized != 0) return;
  for (Slot& s : slots_) {
    for (int i = 0; i < s.posted; ++i) {
      auto& r = s.requests[static_cast<std::size_t>(i)];
      if (r == MPI_REQUEST_NULL) continue;
      if (i < s.receives) MPI_Cancel(&r);   // receives into memory about to be freed
      MPI_Request_free(&r);
    }
  }
}

MPI_Request* HierEngine::next_request(Slot& s) {
  LOCUS_ASSERT(static_cast<std::size_t>(s.posted) < s.requests.size(),
               "HierEngine posted more messages than it preallocated requests for");
  return &s.requests[static_cast<std::size_t>(s.posted++)];
}

void HierEngine::launch(float* data, std::size_t count, std::size_t seq) {
  LOCUS_ASSERT(has_free_slot(), "HierEngine::launch without a free slot");
  LOCUS_ASSERT(count >= 1 && count <= config_.chunk_elems, "chunk longer than chunk_elems");
  auto it = std::find_if(slots_.begin(), slots_.end(),
                         [](const Slot& s) { return s.phase == Phase::idle; });
  Slot& s = *it;
  s.data = data;
  s.count = count;
  s.tag = static_cast<int>(seq % tag_window) * codes;
  ++active_;
  post_gather(s);
}

// Receives before sends, so data rarely waits in the unexpected queue.
void HierEngine::post_gather(Slot& s) {
  s.phase = Phase::gather;
  s.posted = 0;
  const int n = static_cast<int>(s.count);
  if (!topo_.is_leader()) {
    s.receives = 0;
    LOCUS_MPI_CHECK(MPI_Isend(s.data, n, MPI_FLOAT, 0, s.tag + contribution,
                              topo_.node().get(), next_request(s)));
    return;
  }
  for (int j = 1; j < node_size_; ++j) {
    float* into = s.scratch + static_cast<std::size_t>(j - 1) * config_.chunk_elems;
    LOCUS_MPI_CHECK(MPI_Irecv(into, n, MPI_FLOAT, j, s.tag + contribution, topo_.node().get(),
                              next_request(s)));
  }
  if (node_index_ > 0) {
    float* into = s.scratch + static_cast<std::size_t>(node_size_ - 1) * config_.chunk_elems;
    LOCUS_MPI_CHECK(MPI_Irecv(into, n, MPI_FLOAT, node_index_ - 1, s.tag + running_sum,
                              topo_.leaders().get(), next_request(s)));
  }
  s.receives = s.posted;
}

// Leader: data = ((R_{k-1} + own) + peer_1) + ... in rank order (divided on the last node).
void HierEngine::reduce_node(Slot& s) {
  int n = 0;
  if (node_index_ > 0) {
    sources_[static_cast<std::size_t>(n++)] =
        s.scratch + static_cast<std::size_t>(node_size_ - 1) * config_.chunk_elems;
  }
  sources_[static_cast<std::size_t>(n++)] = s.data;
  for (int j = 1; j < node_size_; ++j) {
    sources_[static_cast<std::size_t>(n++)] =
        s.scratch + static_cast<std::size_t>(j - 1) * config_.chunk_elems;
  }
  const bool last = node_index_ == nodes_ - 1;
  const float divisor = last && config_.divide ? static_cast<float>(total_) : 1.0f;
  reduce_in_rank_order(s.data, sources_.data(), n, s.count, divisor);
}

// The final result leaves the last leader for the other leaders, and every leader's copy for
// its node peers.
void HierEngine::post_broadcast(Slot& s) {
  s.phase = Phase::broadcast;
  s.posted = 0;
  s.receives = 0;
  const int n = static_cast<int>(s.count);
  if (node_index_ == nodes_ - 1) {
    for (int k = 0; k < nodes_ - 1; ++k) {
      LOCUS_MPI_CHECK(MPI_Isend(s.data, n, MPI_FLOAT, k, s.tag + leader_final,
                                topo_.leaders().get(), next_request(s)));
    }
  }
  for (int j = 1; j < node_size_; ++j) {
    LOCUS_MPI_CHECK(MPI_Isend(s.data, n, MPI_FLOAT, j, s.tag + node_final, topo_.node().get(),
                              next_request(s)));
  }
}

// Only after this rank's own send of data completed: data is then free to receive into.
void HierEngine::post_final(Slot& s) {
  s.phase = Phase::final;
  s.posted = 0;
  const int n = static_cast<int>(s.count);
  if (topo_.is_leader()) {
    LOCUS_MPI_CHECK(MPI_Irecv(s.data, n, MPI_FLOAT, nodes_ - 1, s.tag + leader_final,
                              topo_.leaders().get(), next_request(s)));
  } else {
    LOCUS_MPI_CHECK(MPI_Irecv(s.data, n, MPI_FLOAT, 0, s.tag + node_final, topo_.node().get(),
                              next_request(s)));
  }
  s.receives = s.posted;
}

bool HierEngine::advance(Slot& s) {
  int done = 0;
  LOCUS_MPI_CHECK(MPI_Testall(s.posted, s.requests.data(), &done, MPI_STATUSES_IGNORE));
  if (done == 0) return false;
  const bool leader = topo_.is_leader();
  switch (s.phase) {
    case Phase::gather:
      if (!leader) {
        post_final(s);
        return false;
      }
      reduce_node(s);
      if (node_index_ == nodes_ - 1) {
        post_broadcast(s);
      } else {
        s.phase = Phase::forward;
        s.posted = 0;
        s.receives = 0;
        LOCUS_MPI_CHECK(MPI_Isend(s.data, static_cast<int>(s.count), MPI_FLOAT,
                                  node_index_ + 1, s.tag + running_sum, topo_.leaders().get(),
                                  next_request(s)));
      }
      return false;
    case Phase::forward:
      post_final(s);
      return false;
    case Phase::final:
      if (!leader) return true;
      post_broadcast(s);
      return false;
    case Phase::broadcast: return true;
    case Phase::idle: break;
  }
  LOCUS_ASSERT(false, "HierEngine::advance on an idle slot");
  return false;
}

int HierEngine::progress() {
  int completed = 0;
  for (Slot& s : slots_) {
    if (s.phase == Phase::idle) continue;
    // A phase whose messages are already done moves on at once (e.g. a leader alone on its
    // node has nothing to gather).
    bool complete = false;
    for (int round = 0; round < 4 && !complete; ++round) {
      const Phase before = s.phase;
      complete = advance(s);
      if (!complete && s.phase == before) break;
    }
    if (!complete) continue;
    s.phase = Phase::idle;
    --active_;
    ++completed;
  }
  return completed;
}

}  // namespace locus::comm::detail
