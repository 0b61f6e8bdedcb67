// The pipeline engine of one rank: runs its stage's schedule for a step, moving activations
// and activation gradients to its neighbours with non-blocking sends into receives posted
// ahead, accounting the activation memory it keeps, and streaming its gradient slice into the
// data-parallel all-reduce during the step's last backward.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/train/optim/clip.hpp"
#include "locus/train/compute.hpp"
#include "pipeline/pipeline_impl.hpp"
#include "trainer_impl.hpp"

namespace locus::train {

using detail::kActivationTag;
using detail::kGradientTag;
using detail::kLabelTag;
using detail::kTargetTag;
using detail::seconds_since;
using detail::sz;
using Clock = detail::PipelineClock;

namespace {

// Collective over grid.world(): the options, spec and partition checked on every rank with
// one verdict, and the backend's operations on this rank's stage made.
StagePartition checked_partition(const Grid& grid, const ModelSpec& spec,
                                 const PipelineOptions& options,
                                 const detail::StageOpsFactory& make_ops,
                                 std::unique_ptr<detail::LayerOps>& ops) {
  std::optional<StagePartition> p;
  mpi::agree_on(grid.world(), [&] {
    validate(spec);
    validate(options);
    p.emplace(ParamLayout(spec.widths), grid.pipeline_stages(), options.stage_boundaries);
    const StageRange& r = p->stage(grid.stage());
    ops = make_ops(r);
    LOCUS_ASSERT(ops->range() == r.held(),
                 fmt::format("stage {} trains layers [{}, {}) but its operations cover [{}, {})",
                             grid.stage(), r.first_layer, r.end_layer, ops->range().first,
                             ops->range().end));
  });
  return std::move(*p);
}

}  // namespace

PipelineStage::Impl::Impl(const Grid& grid, const ModelSpec& s, Loss l,
                          const PipelineOptions& options, const OpsFactory& make_ops)
    : spec(s),
      loss(l),
      opts(options),
      layout(s.widths),
      partition(checked_partition(grid, s, options, make_ops, layer_ops)),
      stage(grid.stage()),
      stages(grid.pipeline_stages()),
      range(partition.stage(grid.stage())),
      pp(grid.pp().dup()) {
  // The link and the reducer agreed over the world, not only each pipeline's or each stage's
  // ranks: pipelines and stages may differ in whether NCCL can join their ranks (GPUs laid out
  // unevenly), and a refusal (train.stage_link or train.reducer = nccl where NCCL cannot run,
  // train.reducer_precision = bf16 where the MPI reducer sums) must stop every rank.
  mpi::agree_on(grid.world(), [&] { link = make_link(grid.pp(), options.link); });
  comm::ReducerOptions ro = opts.reducer;
  // Each micro-batch's loss divides by the GLOBAL batch: the sum over replicas is the mean.
  ro.mode = comm::ReduceMode::presummed_average;
  mpi::agree_on(grid.world(),
                [&] { reducer = detail::make_reducer(layer_ops->grads(), grid.dp(), ro); });
  // The stage's stream waits for the all-reduce and for the link's transfers (as the loss).
  layer_ops->before_host_waits([this](void* stream) {
    if (reducer) reducer->settle(stream);
    if (link) link->settle(stream);
  });
  for (SendBuffer& b : dx_send) b.data = layer_ops->make_buffer();
  ops = pipeline_ops(opts.schedule, stages, stage, opts.micro_batches);
  next_forward.assign(ops.size(), -1);
  int next = -1;
  for (std::size_t i = ops.size(); i-- > 0;) {
    next_forward[i] = next;
    if (ops[i].kind == PipelineOp::forward) next = ops[i].micro_batch;
  }
}

// NCCL between device stages where it can run (train.stage_link = nccl: an agreed ConfigError
// where it cannot); otherwise the backend's own link -- MPI, host-staged for device buffers.
// One stage: the backend's (nothing travels).
std::unique_ptr<comm::StageLink> PipelineStage::Impl::make_link(const mpi::Comm& pp_comm,
                                                                const comm::LinkOptions& o) {
  static constexpr int kTags[] = {kActivationTag, kGradientTag};
  if (o.factory && stages > 1) return o.factory(pp_comm, kTags);
  const bool device = layer_ops->grads().space == comm::MemorySpace::cuda;
  if (o.backend == comm::LinkBackend::nccl && !device) {
    throw ConfigError("train.stage_link = nccl moves GPU buffers between pipeline stages, but "
                      "this backend keeps them in host memory: set train.stage_link = auto or "
                      "mpi, or train.backend = cuda");
  }
  if (stages > 1 && device && o.backend != comm::LinkBackend::mpi) {
    if (o.backend == comm::LinkBackend::nccl) return comm::make_nccl_link(pp_comm, kTags, o);
    link_note = comm::nccl_link_unusable_reason(pp_comm);
    if (link_note.empty()) return comm::make_nccl_link(pp_comm, kTags, o);
  }
  return layer_ops->make_link(pp_comm);
}

// Stage 0 tells the others the row count and the gradient divisor (and the sample ids when
// dropout needs them, 8 bytes a row); the labels and targets go straight to the last stage.
void PipelineStage::Impl::begin(const PipelineBatch& b, bool training, double grad_divisor) {
  const bool dropout = training && spec.dropout > 0.0f;
  // Integers (row counts) travel exactly as doubles.
  double header[4] = {static_cast<double>(b.rows), b.labels.empty() ? 0.0 : 1.0,
                      b.targets.empty() ? 0.0 : 1.0, grad_divisor};
  if (stage == 0) {
    const int in = layout.input_width(), out = layout.output_width();
    LOCUS_ASSERT(
        b.rows >= 0 && b.x.size() == sz(b.rows, in),
        fmt::format("pipeline batch: {} features for {} rows of {}", b.x.size(), b.rows, in));
    LOCUS_ASSERT(b.labels.empty() || b.labels.size() == static_cast<std::size_t>(b.rows),
                 fmt::format("pipeline batch: {} labels for {} rows", b.labels.size(), b.rows));
    LOCUS_ASSERT(
        b.targets.empty() || b.targets.size() == sz(b.rows, out),
        fmt::format("pipeline batch: {} targets for {} rows of {}", b.targets.size(), b.rows, out));
    LOCUS_ASSERT(!dropout || b.sample_ids.size() == static_cast<std::size_t>(b.rows),
                 "pipeline batch: dropout needs one sample id per row");
    LOCUS_ASSERT(
        loss == Loss::mse ? !b.targets.empty() || b.rows == 0 : !b.labels.empty() || b.rows == 0,
        fmt::format("pipeline batch: the {} loss needs {}", to_string(loss),
                    loss == Loss::mse ? "targets" : "labels"));
  }
  if (stages > 1) pp.bcast(std::span<double>(header), 0);
  rows = static_cast<int>(header[0]);
  has_labels = header[1] != 0;
  has_targets = header[2] != 0;
  divisor = header[3];
  micro = opts.micro_batches;
  offset.resize(static_cast<std::size_t>(micro) + 1);
  for (int m = 0; m <= micro; ++m) {
    offset[static_cast<std::size_t>(m)] =
        static_cast<int>(static_cast<std::int64_t>(m) * rows / micro);
  }
  by_mb.assign(static_cast<std::size_t>(micro), nullptr);
  slot_bytes.assign(static_cast<std::size_t>(micro), 0);
  ids_view = {};
  if (dropout) {
    if (stages > 1) {
      ids.resize(static_cast<std::size_t>(rows));
      if (stage == 0) std::copy(b.sample_ids.begin(), b.sample_ids.end(), ids.begin());
      pp.bcast(std::span<std::uint64_t>(ids), 0);
      ids_view = ids;
    } else {
      ids_view = b.sample_ids;
    }
  }
  labels = {};
  targets = {};
  if (stages == 1) {
    labels = b.labels;
    targets = b.targets;
  } else if (stage == 0 || stage == stages - 1) {
    // Sent and received here, while both ranks are in MPI (the header's broadcast brought them
    // to this step): a send left pending moves only while its rank calls MPI, and over an NCCL
    // link stage 0 may call MPI next only after the last stage's gradients, which follow the
    // loss that needs these labels. Past the eager limit (a few KiB between processes without
    // single-copy, any size over TCP before the pair's first connection) that waited for the
    // reducer's timeout.
    const auto t = Clock::now();
    const int last = stages - 1;
    if (stage == 0) {
      if (has_labels) {
        LOCUS_MPI_CHECK(
            MPI_Send(b.labels.data(), rows, MPI_INT32_T, last, kLabelTag, pp.get()));
      }
      if (has_targets) {
        LOCUS_MPI_CHECK(MPI_Send(b.targets.data(), static_cast<int>(b.targets.size()),
                                 MPI_FLOAT, last, kTargetTag, pp.get()));
      }
    } else {
      if (has_labels) {
        label_buf.resize(static_cast<std::size_t>(rows));
        LOCUS_MPI_CHECK(MPI_Recv(label_buf.data(), rows, MPI_INT32_T, 0, kLabelTag, pp.get(),
                                 MPI_STATUS_IGNORE));
        labels = label_buf;
      }
      if (has_targets) {
        target_buf.resize(sz(rows, layout.output_width()));
        LOCUS_MPI_CHECK(MPI_Recv(target_buf.data(), static_cast<int>(target_buf.size()),
                                 MPI_FLOAT, 0, kTargetTag, pp.get(), MPI_STATUS_IGNORE));
        targets = target_buf;
      }
    }
    cur.wait_s += seconds_since(t);
  }
}

ActivationSlot& PipelineStage::Impl::acquire(int m, bool training) {
  ActivationSlot*& s = by_mb[static_cast<std::size_t>(m)];
  if (s != nullptr) return *s;
  if (free_slots.empty()) {
    pool.push_back(std::make_unique<ActivationSlot>());
    pool.back()->act = layer_ops->make_activations();
    free_slots.push_back(pool.back().get());
  }
  s = free_slots.back();
  free_slots.pop_back();
  s->micro_batch = m;
  const std::size_t bytes = layer_ops->prepare(*s->act, rows_of(m), stage > 0,
                                         training && stage + 1 < stages, training);
  slot_bytes[static_cast<std::size_t>(m)] = bytes;
  live_bytes += bytes;
  ++live;
  cur.peak_activation_bytes = std::max(cur.peak_activation_bytes, live_bytes);
  cur.peak_live_micro_batches = std::max(cur.peak_live_micro_batches, live);
  return *s;
}

void PipelineStage::Impl::release(int m) {
  ActivationSlot*& s = by_mb[static_cast<std::size_t>(m)];
  LOCUS_ASSERT(s != nullptr, fmt::format("micro-batch {} has no activations to release", m));
  const auto t = Clock::now();
  link->wait(s->send_output);  // long done by now: the next stage has sent its gradient back
  cur.wait_s += seconds_since(t);
  LOCUS_ASSERT(!s->recv_input.active() && !s->recv_grad.active(),
               "an activation slot was released with a receive pending");
  live_bytes -= slot_bytes[static_cast<std::size_t>(m)];
  --live;
  free_slots.push_back(s);
  s = nullptr;
}

// Posts the receive of micro-batch m's input activations (stages after the first), once.
void PipelineStage::Impl::post_input(int m, bool training) {
  if (stage == 0 || m < 0 || by_mb[static_cast<std::size_t>(m)] != nullptr) return;
  ActivationSlot& s = acquire(m, training);
  link->recv(s.act->input(), stage - 1, kActivationTag, s.recv_input);
}

void PipelineStage::Impl::forward_op(int m, int ahead, const PipelineBatch& b, bool training,
                                     std::uint64_t step) {
  post_input(m, training);
  post_input(ahead, training);  // one ahead: its data lands while m computes
  ActivationSlot& s = acquire(m, training);
  auto t = Clock::now();
  link->wait(s.recv_input);
  cur.wait_s += seconds_since(t);
  t = Clock::now();
  const std::size_t first = static_cast<std::size_t>(offset[static_cast<std::size_t>(m)]);
  const auto n = static_cast<std::size_t>(s.act->rows());
  const DropoutKey key{step, ids_view.empty() ? ids_view : ids_view.subspan(first, n)};
  layer_ops->forward(*s.act, input_of(m, b), training, key);
  cur.busy_s += seconds_since(t);
  if (stage + 1 < stages) {
    // pipeline-send-N (1-based step): a stage stopping before its activations go up, while the
    // next stage waits for them on the link (tests/apps/test_train_nccl_app.py).
    if (training && test_hooks_enabled()) {
      test_hook(fmt::format("pipeline-send-{}", step + 1).c_str());
    }
    link->send(s.act->output(), stage + 1, kActivationTag, s.send_output);
    if (training) link->recv(s.act->grad_in(), stage + 1, kGradientTag, s.recv_grad);
  }
}

LossStats PipelineStage::Impl::loss_of(int m, bool want_grad) {
  ActivationSlot& s = *by_mb[static_cast<std::size_t>(m)];
  const std::size_t classes = static_cast<std::size_t>(layout.output_width());
  const auto first = static_cast<std::size_t>(offset[static_cast<std::size_t>(m)]);
  const auto n = static_cast<std::size_t>(s.act->rows());
  const auto lab = labels.empty() ? labels : labels.subspan(first, n);
  const auto tgt = targets.empty() ? targets : targets.subspan(first * classes, n * classes);
  // The loss waits (on the host) for the logits, which wait for the received activations and
  // for the previous step's all-reduce (the stage's next update, and its stream, wait for it):
  // the reducer and the link watch their peers meanwhile (NCCL; no-ops for host ones). The
  // reducer waits for its own reductions only, the link then for the rest of the stream, so a
  // stuck stage peer is reported as the stage link's, not as the all-reduce's.
  reducer->settle(s.act->output().stream);
  link->settle(s.act->output().stream);
  return layer_ops->loss(*s.act, loss, lab, tgt, divisor, want_grad);
}

void PipelineStage::Impl::backward_op(int m, const PipelineBatch& b, bool last_backward,
                                      LossStats& stats) {
  ActivationSlot& s = *by_mb[static_cast<std::size_t>(m)];
  const int n = s.act->rows();
  const bool from_loss = stage + 1 == stages;
  auto t = Clock::now();
  if (from_loss) {
    const LossStats st = loss_of(m, true);
    stats.loss_sum += st.loss_sum;
    stats.correct += st.correct;
    stats.rows += st.rows;
  } else {
    link->wait(s.recv_grad);
    cur.wait_s += seconds_since(t);
  }
  comm::GradientBuffer dx;
  SendBuffer& out = dx_send[next_dx];
  if (stage > 0) {
    t = Clock::now();
    link->wait(out.req);  // sent two backwards ago
    cur.wait_s += seconds_since(t);
    dx = out.data->view(sz(n, input_width()));
  }
  // The step's last backward announces each layer's final gradient to the all-reduce.
  const GradsReadyFn ready = [&](int l) {
    reducer->ready_from(layout.layer(l).begin() - range.begin);
  };
  t = Clock::now();
  layer_ops->backward(*s.act, input_of(m, b), from_loss, accumulated, dx.data,
                      last_backward ? ready : GradsReadyFn());
  cur.busy_s += seconds_since(t);
  accumulated = true;
  if (stage > 0) {
    link->send(dx, stage - 1, kGradientTag, out.req);
    next_dx ^= 1;
  }
  release(m);
}

void PipelineStage::Impl::finish_sends() {
  const auto t = Clock::now();
  for (SendBuffer& b : dx_send) link->wait(b.req);
  link->drain();  // NCCL: the step's transfers are done (a dead peer is noticed here)
  layer_ops->free_replaced();  // buffers that grew this step: nothing in flight reads them now
  cur.wait_s += seconds_since(t);
}

LossStats PipelineStage::Impl::share(const LossStats& local) const {
  if (stages == 1) return local;
  double v[3] = {local.loss_sum, static_cast<double>(local.correct),
                 static_cast<double>(local.rows)};
  pp.bcast(std::span<double>(v), stages - 1);
  return {v[0], static_cast<std::int64_t>(v[1]), static_cast<std::int64_t>(v[2])};
}

}  // namespace locus::train
