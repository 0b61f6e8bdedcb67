// The MPI gradient reducer: cuts the bound buffer into buckets (from its end) and chunks, and
// feeds them to the chunk engine as the backward pass declares them ready.
#include "mpi_reducer.hpp"

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "hier_allreduce.hpp"
#include "locus/comm/topology.hpp"

namespace locus::comm::detail {

namespace {

ChunkEngineConfig engine_config(const ReducerOptions& o) {
  ChunkEngineConfig c;
  c.chunk_elems = o.chunk_bytes / sizeof(float);
  c.small_elems = o.small_bytes / sizeof(float);
  c.max_in_flight = o.max_in_flight;
  c.divide = o.mode == ReduceMode::average;
  return c;
}

HierEngineConfig hier_config(const ReducerOptions& o) {
  HierEngineConfig c;
  c.chunk_elems = o.chunk_bytes / sizeof(float);
  c.max_in_flight = o.max_in_flight;
  c.divide = o.mode == ReduceMode::average;
  return c;
}

// Collective over comm. Resolves train.reduction against the topology and builds its engine;
// `note` says which reduction and why.
std::unique_ptr<AllreduceEngine> make_engine(const mpi::Comm& comm, const ReducerOptions& o,
                                             std::string& note) {
  if (o.reduction == Reduction::flat) {
    note = "flat (train.reduction = flat)";
    return std::make_unique<ChunkEngine>(comm.get(), engine_config(o));
  }
  Topology topo(comm);
  const bool shared = std::any_of(topo.node_sizes().begin(), topo.node_sizes().end(),
                                  [](int n) { return n > 1; });
  const bool automatic = o.reduction == Reduction::automatic;
  if (automatic && !(topo.nodes() > 1 && shared)) {
    note = fmt::format("flat (train.reduction = auto: {}, {})", topo.describe(),
                       topo.nodes() == 1 ? "one node" : "one rank per node");
    return std::make_unique<ChunkEngine>(comm.get(), engine_config(o));
  }
  // The chain keeps rank order exactly when node indices never decrease along the ranks.
  const auto& of = topo.node_of_rank();
  const bool in_order = std::is_sorted(of.begin(), of.end());
  note = fmt::format("hierarchical (train.reduction = {}: {}; {})",
                     automatic ? "auto" : "hierarchical", topo.describe(),
                     in_order ? "summed in rank order: bitwise equal to flat"
                              : "nodes are not consecutive ranks: summed node by node, not "
                                "bitwise equal to flat");
  return std::make_unique<HierEngine>(std::move(topo), hier_config(o));
}

double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

MpiReducer::MpiReducer(mpi::Comm comm, std::span<float> grads, const ReducerOptions& options)
    : comm_(std::move(comm)),
      grads_(grads),
      engine_(make_engine(comm_, options, reduction_)),
      chunk_elems_(options.chunk_bytes / sizeof(float)) {
  build_layout(std::max<std::size_t>(1, options.bucket_bytes / sizeof(float)), chunk_elems_);
}

void MpiReducer::build_layout(std::size_t bucket_elems, std::size_t chunk_elems) {
  std::size_t hi = grads_.size();
  while (hi > 0) {
    const std::size_t lo = hi > bucket_elems ? hi - bucket_elems : 0;
    // Balanced chunks: a 4 MiB + 4 B bucket becomes 5 near-equal chunks, not 4 + a crumb.
    const std::size_t len = hi - lo;
    const std::size_t nchunks = (len + chunk_elems - 1) / chunk_elems;
    for (std::size_t i = 0; i < nchunks; ++i) {
      const std::size_t a = lo + len * i / nchunks;
      const std::size_t b = lo + len * (i + 1) / nchunks;
      pieces_.push_back(Piece{a, b - a});
    }
    bucket_start_.push_back(lo);
    pieces_through_.push_back(pieces_.size());
    hi = lo;
  }
}

void MpiReducer::begin_step() {
  in_step_ = true;
  ready_offset_ = grads_.size();
  ready_buckets_ = 0;
  launchable_ = 0;
  launched_ = 0;
  completed_ = 0;
  progress_s_ = 0;
}

std::size_t MpiReducer::pump() {
  std::size_t completed = 0;
  for (;;) {
    while (launched_ < launchable_ && engine_->has_free_slot()) {
      if (launched_ == 0) first_launch_ = Clock::now();
      const Piece& p = pieces_[launched_];
      engine_->launch(grads_.data() + p.offset, p.count, launched_);
      ++launched_;
    }
    if (engine_->active() == 0) return completed;
    const auto done = static_cast<std::size_t>(engine_->progress());
    if (done == 0) return completed;
    completed += done;
    completed_ += done;
    last_complete_ = Clock::now();
  }
}

void MpiReducer::ready_from(std::size_t offset) {
  const auto t0 = Clock::now();
  if (!in_step_) begin_step();
  LOCUS_ASSERT(offset <= grads_.size(),
               fmt::format("ready_from({}) is past the end of the {}-element gradient buffer",
                           offset, grads_.size()));
  LOCUS_ASSERT(offset <= ready_offset_,
               fmt::format("ready_from({}) after ready_from({}) in the same step: the backward "
                           "pass must declare gradients ready from the end towards the start",
                           offset, ready_offset_));
  ready_offset_ = offset;
  while (ready_buckets_ < bucket_start_.size() && bucket_start_[ready_buckets_] >= offset)
    ++ready_buckets_;
  launchable_ = ready_buckets_ == 0 ? 0 : pieces_through_[ready_buckets_ - 1];
  pump();
  progress_s_ += seconds(Clock::now() - t0);
}

void MpiReducer::finish() {
  const auto t0 = Clock::now();
  if (!in_step_) begin_step();
  ready_offset_ = 0;
  ready_buckets_ = bucket_start_.size();
  launchable_ = pieces_.size();
  // Polls like MPI_Wait does: Open MPI moves shared-memory data only inside MPI calls (and
  // yields inside them by itself when the node is oversubscribed).
  while (completed_ < pieces_.size()) pump();
  const auto t1 = Clock::now();

  ReduceTimes step;
  step.comm_s = pieces_.empty() ? 0.0 : seconds(last_complete_ - first_launch_);
  step.blocked_s = seconds(t1 - t0);
  step.progress_s = progress_s_;
  stats_.last = step;
  stats_.total.comm_s += step.comm_s;
  stats_.total.blocked_s += step.blocked_s;
  stats_.total.progress_s += step.progress_s;
  ++stats_.steps;
  in_step_ = false;
}

void MpiReducer::allreduce_average(std::span<float> data) {
  LOCUS_ASSERT(!in_step_, "allreduce_average() between ready_from() and finish(): finish the "
                          "streaming step first (both use the reducer's communicator)");
  const auto t0 = Clock::now();
  const std::size_t n = data.size();
  const std::size_t nchunks = (n + chunk_elems_ - 1) / chunk_elems_;
  std::size_t next = 0;
  std::size_t done = 0;
  while (done < nchunks) {
    while (next < nchunks && engine_->has_free_slot()) {
      const std::size_t a = n * next / nchunks;
      const std::size_t b = n * (next + 1) / nchunks;
      engine_->launch(data.data() + a, b - a, next);
      ++next;
    }
    done += static_cast<std::size_t>(engine_->progress());
  }
  ++stats_.oneshot_calls;
  stats_.oneshot_s += seconds(Clock::now() - t0);
}

}  // namespace locus::comm::detail
