// The pipeline engine's public face: a training step (the stage's schedule, then the
// gradient all-reduce's completion), a forward-only evaluation, the cross-stage gradient norm
// and the statistics the bench reads.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "locus/train/optim/clip.hpp"
#include "cpu/cpu_layer_ops.hpp"
#include "pipeline/pipeline_impl.hpp"

namespace locus::train {

using Clock = detail::PipelineClock;
using detail::seconds_since;

PipelineStage::PipelineStage(const Grid& grid, const ModelSpec& spec, Loss loss,
                             const PipelineOptions& options, StageBuffers buffers)
    : impl_(std::make_unique<Impl>(grid, spec, loss, options, [&](const StageRange& r) {
        return detail::make_cpu_layer_ops(spec, r.held(), buffers.params, buffers.grads);
      })) {}

PipelineStage::PipelineStage(const Grid& grid, const ModelSpec& spec, Loss loss,
                             const PipelineOptions& options,
                             std::unique_ptr<detail::LayerOps> ops)
    : impl_(std::make_unique<Impl>(grid, spec, loss, options,
                                   [&](const StageRange&) { return std::move(ops); })) {}

PipelineStage::~PipelineStage() = default;

LossStats PipelineStage::train_step(const PipelineBatch& batch, std::uint64_t step,
                                    double grad_divisor) {
  Impl& m = *impl_;
  m.cur = {};
  m.begin(batch, /*training=*/true, grad_divisor);
  m.accumulated = false;
  const auto t0 = Clock::now();
  std::size_t last_backward = 0;
  for (std::size_t i = 0; i < m.ops.size(); ++i) {
    if (m.ops[i].kind == PipelineOp::backward) last_backward = i;
  }
  LossStats local;
  m.post_input(m.ops.front().micro_batch, true);
  for (std::size_t i = 0; i < m.ops.size(); ++i) {
    const PipelineOp& op = m.ops[i];
    if (op.kind == PipelineOp::forward) {
      m.forward_op(op.micro_batch, m.next_forward[i], batch, true, step);
    } else {
      m.backward_op(op.micro_batch, batch, i == last_backward, local);
    }
  }
  m.cur.pipeline_s = seconds_since(t0);
  const auto t = Clock::now();
  m.reducer->finish();
  m.cur.reduce_s = seconds_since(t);
  m.finish_sends();
  LOCUS_ASSERT(m.live == 0,
               fmt::format("{} micro-batches still hold activations after the step", m.live));
  m.peak_bytes = std::max(m.peak_bytes, m.cur.peak_activation_bytes);
  m.peak_live_count = std::max(m.peak_live_count, m.cur.peak_live_micro_batches);
  m.last_step = m.cur;
  return m.share(local);
}

LossStats PipelineStage::evaluate(const PipelineBatch& batch) {
  Impl& m = *impl_;
  m.cur = {};
  m.begin(batch, /*training=*/false, 1.0);
  LossStats local;
  // A stage keeps at most its newest micro-batch (whose output may still be on its way) and
  // the one whose receive is posted ahead.
  int sending = -1;
  for (int mb = 0; mb < m.micro; ++mb) {
    m.forward_op(mb, mb + 1 < m.micro ? mb + 1 : -1, batch, false, 0);
    if (last()) {
      const LossStats st = m.loss_of(mb, false);
      local.loss_sum += st.loss_sum;
      local.correct += st.correct;
      local.rows += st.rows;
      m.release(mb);
    } else {
      if (sending >= 0) m.release(sending);
      sending = mb;
    }
  }
  if (sending >= 0) m.release(sending);
  m.finish_sends();
  LOCUS_ASSERT(m.live == 0, "micro-batches still hold activations after an evaluation");
  return m.share(local);
}

void PipelineStage::settle_reduction() const {
  impl_->reducer->settle(impl_->layer_ops->grads().stream);
}

double PipelineStage::grad_norm() const {
  settle_reduction();  // the sum waits (on the host) for the stage's all-reduce
  double squares = impl_->layer_ops->grad_sum_of_squares();
  if (impl_->stages > 1) squares = impl_->pp.allreduce(squares, MPI_SUM);
  return std::sqrt(squares);
}

const StagePartition& PipelineStage::partition() const noexcept { return impl_->partition; }
const StageRange& PipelineStage::range() const noexcept { return impl_->range; }
detail::LayerOps& PipelineStage::ops() noexcept { return *impl_->layer_ops; }
int PipelineStage::stage() const noexcept { return impl_->stage; }
int PipelineStage::stages() const noexcept { return impl_->stages; }
const PipelineOptions& PipelineStage::options() const noexcept { return impl_->opts; }
const PipelineStepStats& PipelineStage::last_step() const noexcept { return impl_->last_step; }
std::size_t PipelineStage::peak_activation_bytes() const noexcept { return impl_->peak_bytes; }
int PipelineStage::peak_live_micro_batches() const noexcept { return impl_->peak_live_count; }
const comm::GradientReducer& PipelineStage::reducer() const noexcept { return *impl_->reducer; }
std::string PipelineStage::link_description() const {
  const Impl& m = *impl_;
  if (m.stages == 1) return "";
  std::string text(m.link->name());
  if (text == "nccl") text += " (" + comm::nccl_version() + ")";
  if (!m.link_note.empty()) text += " (train.stage_link = auto: not NCCL, as " + m.link_note + ")";
  return text;
}

}  // namespace locus::train
