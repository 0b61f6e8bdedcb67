// Private to lib/train: the state of one rank's pipeline engine, shared by its set-up and
// transfers (pipeline_stage.cpp) and its step and evaluation loops (pipeline_step.cpp).
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/comm/link.hpp"
#include "locus/comm/mpi.hpp"
#include "locus/comm/reducer.hpp"
#include "locus/train/pipeline/pipeline.hpp"
#include "pipeline/pipeline_detail.hpp"

namespace locus::train {

using detail::ActivationSlot;

namespace detail {

using PipelineClock = std::chrono::steady_clock;

inline double seconds_since(PipelineClock::time_point t) {
  return std::chrono::duration<double>(PipelineClock::now() - t).count();
}

inline std::size_t sz(int a, int b) {
  return static_cast<std::size_t>(a) * static_cast<std::size_t>(b);
}

// Communicators of our own (a dup of pp; the link's dup), so tags need only tell the streams
// apart; messages of one tag match the receives in posting order (MPI's non-overtaking rule,
// which the link keeps).
inline constexpr int kActivationTag = 1;
inline constexpr int kGradientTag = 2;
inline constexpr int kLabelTag = 3;
inline constexpr int kTargetTag = 4;

using StageOpsFactory = std::function<std::unique_ptr<LayerOps>(const StageRange&)>;

}  // namespace detail

struct PipelineStage::Impl {
  // make_ops: the backend's operations on the stage's layers, called once the partition is
  // agreed (inside the agreement, so its errors reach every rank).
  using OpsFactory = detail::StageOpsFactory;
  Impl(const Grid& grid, const ModelSpec& spec, Loss loss, const PipelineOptions& options,
       const OpsFactory& make_ops);
  // The link and the reducer go first, while the buffers their transfers use still exist;
  // unwinding, they abort those transfers at once. Last, a transfer stuck on a dead peer would
  // hang the first cudaFree of the activation slots (it synchronizes the device).
  ~Impl() {
    link.reset();
    reducer.reset();
  }

  // Every call of a step or an evaluation.
  void begin(const PipelineBatch& b, bool training, double grad_divisor);
  void finish_sends();
  LossStats share(const LossStats& local) const;

  ActivationSlot& acquire(int m, bool training);
  void release(int m);
  // Collective over pp: the link train.stage_link asks for (sets link_note).
  std::unique_ptr<comm::StageLink> make_link(const mpi::Comm& pp_comm,
                                             const comm::LinkOptions& options);
  void post_input(int m, bool training);
  void forward_op(int m, int ahead, const PipelineBatch& b, bool training, std::uint64_t step);
  void backward_op(int m, const PipelineBatch& b, bool last_backward, LossStats& stats);
  // The loss of micro-batch m on the last stage; with want_grad its gradient is kept for the
  // micro-batch's backward.
  LossStats loss_of(int m, bool want_grad);

  int rows_of(int m) const {
    return offset[static_cast<std::size_t>(m) + 1] - offset[static_cast<std::size_t>(m)];
  }
  // The host input of micro-batch m on stage 0 (its rows of the batch); elsewhere empty:
  // the input is what the slot received.
  std::span<const float> input_of(int m, const PipelineBatch& b) const {
    if (stage != 0) return {};
    return b.x.subspan(detail::sz(offset[static_cast<std::size_t>(m)], input_width()),
                       detail::sz(rows_of(m), input_width()));
  }
  int input_width() const { return layout.widths()[static_cast<std::size_t>(range.first_layer)]; }
  int output_width() const { return layout.widths()[static_cast<std::size_t>(range.end_layer)]; }

  ModelSpec spec;
  Loss loss;
  PipelineOptions opts;
  ParamLayout layout;
  // The backend's operations on the stage's layers (made while the partition is checked, so
  // declared before it).
  std::unique_ptr<detail::LayerOps> layer_ops;
  StagePartition partition;
  int stage = 0, stages = 1;
  StageRange range;
  mpi::Comm pp;  // the step's header, labels and targets, the shared loss
  // Activations and their gradients between neighbouring stages, in the backend's memory.
  std::string link_note;  // why train.stage_link = auto did not take NCCL ("" if it did)
  std::unique_ptr<comm::StageLink> link;
  std::unique_ptr<comm::GradientReducer> reducer;
  // This stage's schedule; next_forward[i]: the micro-batch of the first forward after op i
  // (-1 if none), whose receive op i posts ahead.
  std::vector<PipelineOp> ops;
  std::vector<int> next_forward;

  // Activation slots: allocated on demand, reused; by_mb maps a micro-batch to its slot.
  std::vector<std::unique_ptr<ActivationSlot>> pool;
  std::vector<ActivationSlot*> free_slots;
  std::vector<ActivationSlot*> by_mb;
  std::vector<std::size_t> slot_bytes;
  std::size_t live_bytes = 0;
  int live = 0;

  // The current step or evaluation.
  int rows = 0, micro = 1;
  std::vector<int> offset;  // micro-batch m is rows [offset[m], offset[m+1])
  std::vector<std::uint64_t> ids;
  std::span<const std::uint64_t> ids_view;
  bool has_labels = false, has_targets = false;
  std::vector<std::int32_t> label_buf;
  std::vector<float> target_buf;
  std::span<const std::int32_t> labels;
  std::span<const float> targets;
  double divisor = 1.0;  // the step's grad_divisor (1 in evaluation)
  struct SendBuffer {
    std::unique_ptr<detail::LayerBuffer> data;  // the backend's memory
    comm::LinkRequest req;
  } dx_send[2];
  int next_dx = 0;
  bool accumulated = false;
  PipelineStepStats cur, last_step;
  std::size_t peak_bytes = 0;
  int peak_live_count = 0;
};

}  // namespace locus::train
