// Private to lib/comm: the MPI gradient reducer (bucket layout, the ready_from/finish step
// protocol and its timings) on top of the chunked all-reduce engine.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "chunk_allreduce.hpp"
#include "locus/comm/reducer.hpp"

namespace locus::comm::detail {

class MpiReducer final : public GradientReducer {
 public:
  // comm is the reducer's own (duplicated) communicator; options were validated and agreed.
  // Collective over comm: resolves options.reduction (train.reduction = auto looks at the
  // topology) and builds the flat or the hierarchical engine.
  MpiReducer(mpi::Comm comm, std::span<float> grads, const ReducerOptions& options);

  void ready_from(std::size_t offset) override;
  void finish() override;
  void allreduce_average(std::span<float> data) override;

  const ReducerStats& stats() const noexcept override { return stats_; }
  std::string_view name() const noexcept override { return "mpi"; }
  int comm_size() const noexcept override { return comm_.size(); }
  std::string reduction() const override { return reduction_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Piece {
    std::size_t offset = 0;
    std::size_t count = 0;
  };

  void build_layout(std::size_t bucket_elems, std::size_t chunk_elems);
  void begin_step();
  // Launches every launchable piece a free slot allows, then progresses until a pass
  // completes nothing. Returns how many pieces completed.
  std::size_t pump();

  mpi::Comm comm_;
  std::span<float> grads_;
  std::string reduction_;
  std::unique_ptr<AllreduceEngine> engine_;
  std::size_t chunk_elems_ = 0;

  // Fixed at construction. pieces_ is in launch order: the last bucket's chunks first.
  std::vector<Piece> pieces_;
  std::vector<std::size_t> bucket_start_;       // first element of bucket k (launch order)
  std::vector<std::size_t> pieces_through_;     // pieces of buckets 0..k: pieces_[0, this)

  // The current step.
  bool in_step_ = false;
  std::size_t ready_offset_ = 0;
  std::size_t ready_buckets_ = 0;
  std::size_t launchable_ = 0;
  std::size_t launched_ = 0;
  std::size_t completed_ = 0;
  Clock::time_point first_launch_{};
  Clock::time_point last_complete_{};
  double progress_s_ = 0;

  ReducerStats stats_;
};

}  // namespace locus::comm::detail
