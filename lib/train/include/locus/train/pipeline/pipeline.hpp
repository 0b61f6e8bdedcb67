// Pipeline-parallel training of the MLP: the layers are cut into contiguous stages, one per
// rank of a Grid's pp() communicator; each global batch is split into micro-batches whose
// activations travel forward and whose activation gradients travel back between neighbouring
// stages (non-blocking sends, pre-posted receives), under a GPipe or 1F1B schedule. Every
// stage's gradient slice is all-reduced over dp() while its last backward still runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/link.hpp"
#include "locus/comm/reducer.hpp"
#include "locus/train/compute.hpp"
#include "locus/train/grid.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/model/model.hpp"

namespace locus::train {

namespace detail {
class LayerOps;  // a backend's operations on a range of layers (private to lib/train)
}

// gpipe: every forward of the step, then every backward (M micro-batches of activations alive).
// one_f_one_b: S-1-s warm-up forwards on stage s, then one forward / one backward alternately,
// then the remaining backwards: at most S micro-batches of activations alive on any stage.
// Both accumulate micro-batch gradients in the same order (0, 1, ..., M-1), so they produce the
// same bits.
enum class PipelineSchedule { gpipe, one_f_one_b };
PipelineSchedule parse_pipeline_schedule(std::string_view name);  // "gpipe" | "1f1b"
std::string_view to_string(PipelineSchedule schedule) noexcept;

struct PipelineOptions {
  int micro_batches = 1;  // per step; each replica's rows are split into this many
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  // Empty: balance automatically (see StagePartition). Otherwise stages-1 strictly increasing
  // layer indices: the first layer of stages 1, 2, ... ("train.stage_boundaries = 3,6").
  std::vector<int> stage_boundaries;
  comm::ReducerOptions reducer;  // the stage's gradient all-reduce over dp (mode is forced)
  comm::LinkOptions link;        // between the stages (train.stage_link)
};
// Local checks (ConfigError naming the train.* key): micro_batches >= 1.
void validate(const PipelineOptions& options);
// "3,6" -> {3, 6}; "" -> {} (ConfigError on anything but comma-separated integers).
std::vector<int> parse_stage_boundaries(std::string_view text);

// One stage: layers [first_layer, end_layer) and their parameters, the slice [begin, end) of
// every buffer with the model's ParamLayout (layers are contiguous in state_dict order).
struct StageRange {
  int first_layer = 0;
  int end_layer = 0;
  std::size_t begin = 0;
  std::size_t end = 0;
  double flops_per_sample = 0;  // forward + backward, as counted by the balancer
  int layers() const noexcept { return end_layer - first_layer; }
  LayerRange held() const noexcept { return {first_layer, end_layer}; }  // a TrainState's
  std::size_t size() const noexcept { return end - begin; }
  std::size_t param_bytes() const noexcept { return size() * sizeof(float); }
};

// The cut of a model into pipeline stages, identical on every rank (a pure function of the
// layout, the stage count and the boundaries).
class StagePartition {
 public:
  // Explicit boundaries when given (stages-1 of them), otherwise balanced: every contiguous cut
  // is scored by its most expensive stage, where a stage's cost is its share of the model's
  // FLOPs plus its share of the parameter bytes (compute bounds the step, bytes bound the
  // memory), and the cheapest cut wins (ties: the earliest). FLOPs per sample and layer are
  // 2*in*out forward + 4*in*out backward (2*in*out for layer 0, which sends no input gradient).
  // ConfigError for stages < 1, stages > layers, or invalid boundaries.
  StagePartition(const ParamLayout& layout, int stages, std::span<const int> boundaries = {});

  int stages() const noexcept { return static_cast<int>(ranges_.size()); }
  const StageRange& stage(int s) const;
  std::span<const StageRange> ranges() const noexcept { return ranges_; }
  bool automatic() const noexcept { return automatic_; }
  // The first layer of stages 1..S-1 (what train.stage_boundaries would say).
  std::vector<int> boundaries() const;
  // Multi-line: "pipeline partition (automatic, 2 stages):\n  stage 0: layers 0-3 (4 layers,
  // 16.8M params, 64.0 MiB, 100.7 MFLOP/sample, 50.2% of the FLOPs)\n ..."
  std::string describe() const;

 private:
  std::vector<StageRange> ranges_;
  bool automatic_ = true;
};

// One operation of a stage's schedule: the forward or backward of one micro-batch.
struct PipelineOp {
  // Scoped, with the names brought in: unscoped enumerators here shadow train::forward and
  // train::backward, which clang's -Wshadow rejects.
  enum class Kind { forward, backward };
  using enum Kind;
  Kind kind = forward;
  int micro_batch = 0;
  bool operator==(const PipelineOp&) const = default;
};
// The ordered operations of `stage` (0-based) of `stages` for one step of `micro_batches`.
std::vector<PipelineOp> pipeline_ops(PipelineSchedule schedule, int stages, int stage,
                                     int micro_batches);
// Micro-batches whose activations are alive at once (forward done, backward not) at most.
int peak_live(std::span<const PipelineOp> ops);

// This replica's rows of one global batch. Only stage 0 reads it (the other stages learn the
// row count, and the sample ids when dropout needs them, from stage 0; the last stage receives
// the labels and targets directly from stage 0): other stages may pass an empty batch.
struct PipelineBatch {
  std::span<const float> x;  // [rows, input width]
  int rows = 0;
  std::span<const std::int32_t> labels;       // cross-entropy (and accuracy for mse), or empty
  std::span<const float> targets;             // mse: [rows, output width]
  std::span<const std::uint64_t> sample_ids;  // global ids (dropout masks), or empty
};

// What one step did on this stage (seconds from the step's start on this rank).
struct PipelineStepStats {
  double pipeline_s = 0;                  // from the start to the end of this stage's last backward
  double busy_s = 0;                      // inside forward/backward/loss kernels
  double wait_s = 0;                      // blocked on a receive (or a send buffer)
  double reduce_s = 0;                    // inside the gradient all-reduce's finish()
  std::size_t peak_activation_bytes = 0;  // stored activations + their receive buffers
  int peak_live_micro_batches = 0;
};

// Buffers of this stage's parameters and gradients: the [range.begin, range.end) slice of the
// model's ParamLayout (element 0 is layer first_layer's weight). The caller owns both; the
// engine reads params and overwrites grads every step.
struct StageBuffers {
  std::span<const float> params;
  std::span<float> grads;
};

class PipelineStage {
 public:
  // Collective over grid.world() (options are agreed; the pp and dp communicators are
  // duplicated). The partition is built here from spec.widths, grid.pipeline_stages() and
  // options.stage_boundaries; ConfigError (identical on every rank) for an invalid spec,
  // options or partition. buffers must be range().size() floats each and outlive the stage.
  // The stage computes on the cpu backend's layer operations over `buffers`.
  PipelineStage(const Grid& grid, const ModelSpec& spec, Loss loss, const PipelineOptions& options,
                StageBuffers buffers);
  // The stage computes on `ops` (a backend's operations on exactly this rank's stage of the
  // partition, an InternalError otherwise), in whose memory its parameters, gradients and
  // activations live; transfers and the gradient all-reduce follow where that is.
  PipelineStage(const Grid& grid, const ModelSpec& spec, Loss loss, const PipelineOptions& options,
                std::unique_ptr<detail::LayerOps> ops);
  ~PipelineStage();
  PipelineStage(const PipelineStage&) = delete;
  PipelineStage& operator=(const PipelineStage&) = delete;

  // Collective over grid.pp() and then grid.dp(): forward, loss (last stage) and backward of
  // the replica's rows in micro-batches under the schedule, gradients accumulated into
  // buffers.grads (overwritten) and summed over dp (the loss divides by grad_divisor, the
  // GLOBAL batch, see loss.hpp; stage 0's value counts, the others may pass anything).
  // Returns the replica's loss sums, identical on every stage.
  // step keys the dropout masks. A replica with 0 rows still joins (zero gradients).
  LossStats train_step(const PipelineBatch& batch, std::uint64_t step, double grad_divisor);

  // Collective over grid.pp(): the L2 norm of the whole model's (reduced) gradient, from every
  // stage's slice. Every rank gets the same value.
  double grad_norm() const;

  // Blocks until the stage's gradient reduction enqueued so far has completed -- before the
  // host reads what waits for it (its gradients, its state) -- watching the reducer's peers
  // meanwhile (NCCL: a dead one ends in an NcclError within train.reducer_timeout_s; host
  // reducers have blocked already).
  void settle_reduction() const;

  // The backend's operations the stage computes on.
  detail::LayerOps& ops() noexcept;

  // Collective over grid.pp(): loss sums and argmax hits of the current parameters on the
  // replica's rows (no dropout), computed on the last stage and shared with every stage.
  LossStats evaluate(const PipelineBatch& batch);

  const StagePartition& partition() const noexcept;
  const StageRange& range() const noexcept;  // this rank's stage
  int stage() const noexcept;
  int stages() const noexcept;
  bool first() const noexcept { return stage() == 0; }
  bool last() const noexcept { return stage() + 1 == stages(); }
  const PipelineOptions& options() const noexcept;
  const PipelineStepStats& last_step() const noexcept;
  // Peak over every step so far.
  std::size_t peak_activation_bytes() const noexcept;
  int peak_live_micro_batches() const noexcept;
  const comm::GradientReducer& reducer() const noexcept;
  // The stage link ("mpi", "mpi-host-staged", "nccl (NCCL ...)") and why train.stage_link =
  // auto did not take NCCL where that applies; "" with one stage (nothing travels).
  std::string link_description() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The trainer's compute backend (compute.hpp) for pipeline_stages > 1 (and for micro-batches
// on one stage): this rank trains its stage's layers of a TrainState that holds only those
// (state.model.held() == the partition's stage(grid.stage()).held()), with a gradient buffer of
// the same size, so a rank's parameters, gradients and optimizer state are its stage's share.
// The stage computes on the layer operations of the backend ComputeOptions names (cpu, or
// cuda: the stage's parameters, gradients, optimizer state and activations on the device,
// activations and their gradients host-staged between stages). Checkpoints and model files
// are written by the stages, each its layers. Semantics that differ from the whole-model
// backends:
//   forward_backward: collective over grid.pp() and grid.dp(); it also completes the gradient
//     all-reduce over dp (on_grads_ready is not called). Stage 0 passes the replica's batch,
//     the other stages an empty one.
//   optimizer_step (when clipping), evaluate: collective over grid.pp().
class PipelineCompute final : public Compute {
 public:
  // Collective over grid.world() (see PipelineStage). ConfigError (agreed) when the state does
  // not hold exactly this rank's stage, or the backend cannot run here (compute.hpp's
  // validate).
  PipelineCompute(const Grid& grid, TrainState& state, Loss loss, const PipelineOptions& options,
                  const ComputeOptions& compute = {});
  ~PipelineCompute() override;

  std::string_view name() const noexcept override { return name_; }
  // As the backend's: a checkpoint's provenance does not depend on the grid.
  std::string describe() const override;
  comm::GradientBuffer grads() noexcept override;
  void forward_backward(const Batch& batch, std::uint64_t step, double grad_divisor,
                        const GradsReadyFn& on_grads_ready) override;
  // Collective over grid.pp() when clipping (the norm of the whole model's gradient).
  void optimizer_step(double lr, double clip_max_norm) override;
  double last_grad_norm() override { return last_norm_; }
  // This stage's share (the anomaly detector adds the stages' shares), computed where the
  // gradients live: on the device for a device backend.
  double grad_squares() override;
  void drain_stats(std::vector<LossStats>& out) override;
  LossStats evaluate(const Batch& batch) override;
  void sync_from_host() override;
  void sync_to_host() override;

  PipelineStage& stage() noexcept { return *stage_; }
  const PipelineStage& stage() const noexcept { return *stage_; }

 private:
  std::string name_;  // "cpu-pipeline", "cuda-pipeline"
  StageRange range_;  // agreed on every rank before the first collective that needs it
  std::unique_ptr<PipelineStage> stage_;
  std::vector<LossStats> pending_;
  double last_norm_ = -1;
};

}  // namespace locus::train
