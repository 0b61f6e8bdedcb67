// The data-parallel trainer: a step is read batch → forward/loss/backward (each layer's
// gradient all-reduced while earlier layers still compute) → clip → optimizer step, on the
// data-parallel communicator of a Grid; per-epoch distributed evaluation; metrics to an
// observer. The loop sees two interfaces chosen at start-up: the compute backend and the
// gradient reducer.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "locus/comm/link.hpp"
#include "locus/comm/reducer.hpp"
#include "locus/train/compute.hpp"
#include "locus/train/grid.hpp"
#include "locus/train/data/loader.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/metrics.hpp"
#include "locus/train/model/model.hpp"
#include "locus/train/monitor/anomaly.hpp"
#include "locus/train/monitor/straggler.hpp"
#include "locus/train/optim/optimizer.hpp"
#include "locus/train/pipeline/pipeline.hpp"
#include "locus/train/optim/schedule.hpp"
#include "locus/train/train_state.hpp"

namespace locus::train {

// Plain options (apps/locus-train maps the config file onto them; key names in messages are
// the config keys).
struct TrainOptions {
  ModelSpec model;
  Loss loss = Loss::softmax_cross_entropy;  // mse regresses one-hot encoded labels
  OptimizerOptions optimizer;
  ScheduleOptions schedule;       // total_steps = 0: the planned steps of this run
  double clip_max_norm = 0.0;     // > 0: clip the gradient's global L2 norm to this
  std::int64_t epochs = 1;
  std::int64_t max_steps = 0;     // > 0: stop after this many steps (if before the last epoch)
  LoaderOptions data;             // training set, global batch, shuffle, seed, prefetch, budget
  std::string eval_path;          // evaluation set; "" for none
  std::int64_t eval_batch = 1000; // global rows per evaluation batch
  std::int64_t eval_every = 1;    // evaluate every this many epochs (0: only at the end)
  std::int64_t log_every = 50;    // steps per StepMetrics interval (0: only at epoch ends)
  // Pipeline parallelism (pipeline.hpp): pipeline_stages must equal the grid's. With more than
  // one stage, or more than one micro-batch (gradient accumulation on one stage), a step runs
  // through the pipeline engine: the loader feeds stage 0 only, the last stage computes the
  // loss and evaluation, metrics are shared over the stages.
  int pipeline_stages = 1;
  int micro_batches = 1;          // per step and replica
  PipelineSchedule pipeline_schedule = PipelineSchedule::one_f_one_b;
  std::vector<int> stage_boundaries;  // first layers of stages 1..S-1; empty: balanced
  int threads = 1;                // BLAS threads per rank
  ComputeOptions compute;         // backend, precision, device, graphs
  // cuda: bytes of this rank's training partition that may be cached on the device (0: batches
  // are streamed from pinned host memory every step)
  std::uint64_t device_cache_bytes = 0;
  // cuda, loader.gather = device: the resident training samples are page-locked and mapped,
  // and the device gathers each batch's rows from host memory (no host copies); false: the
  // loader's threads gather them into page-locked batches.
  bool device_gather = false;
  // train.reducer (auto: NCCL for device gradients where possible); mode is set by the trainer
  // (sums of pre-divided grads).
  comm::ReducerOptions reducer{comm::ReducerBackend::automatic};
  // train.stage_link: how pipeline stages exchange activations and their gradients (auto: NCCL
  // between GPU stages where every rank of the pipeline has a GPU of its own).
  comm::LinkOptions stage_link;
  // The monitors (monitor/): the anomaly detector of every step (train.anomaly*) and the
  // per-interval straggler detector (train.straggler_*); stragglers_file: where world rank 0
  // keeps the current stragglers ("" : nowhere; locus-train uses <checkpoint.dir>/stragglers).
  AnomalyOptions anomaly;
  StragglerOptions straggler;
  std::string stragglers_file;
};

// Local checks of the options alone (ConfigError naming the config key); the trainer runs
// them on every rank and agrees on the verdict.
void validate(const TrainOptions& options);

// The settings this job sets away from their defaults but does not use (train.graphs,
// train.gemm_select, train.reducer_timeout_s on the cpu backend; train.threads on cuda), one
// sentence each naming the key, for the app to print: switches that change nothing here are
// named, not refused (a config shared by GPU and CPU runs keeps them), while those that ask for
// a GPU are refused above.
std::vector<std::string> unused_settings(const TrainOptions& options);

struct TrainSummary {
  std::int64_t steps = 0;          // steps taken by this call of train()
  std::int64_t samples = 0;        // global samples trained on by this call
  double seconds = 0;              // training loop time (evaluation excluded)
  double eval_seconds = 0;
  double samples_per_s = 0;
  double data_wait_fraction = 0;   // share of the loop time spent waiting for batches
  // Of which the device's compute stream stalled for a batch's copy or gather (cuda; the rest
  // is the loader's, the host in next()).
  double data_wait_device_fraction = 0;
  double allreduce_s = 0;
  double hidden_fraction = 0;      // share of the all-reduce time hidden behind backward
  double last_train_loss = 0;      // mean loss of the last completed epoch (or interval)
  bool evaluated = false;
  EvalMetrics eval;                // the last evaluation, when evaluated
  bool finished = false;           // the planned steps are all done
  // Why training stopped on an anomaly (a non-finite step, or train.anomaly = stop), "" when
  // it did not: state() is then the last good state, before the step that stopped it.
  std::string anomaly_stop;
};

class Trainer;

// A step boundary: after an optimizer step's metrics were reported and, when the step ended
// an epoch or the run, after the epoch's metrics and evaluation (state() then already points
// at the next epoch).
struct StepBoundary {
  std::int64_t step = 0;   // state().step
  bool epoch_end = false;  // the step completed an epoch
  bool last = false;       // the step was the run's last planned step
};

// Called by Trainer::train at every step boundary, on every rank of the trainer's world in
// the same order, so it may run collectives over that world (checkpoint triggers, an agreed
// stop flag). Returning true stops training there: train() returns with finished = false and
// the state resumable.
class StepHook {
 public:
  virtual ~StepHook() = default;
  virtual bool at_step_boundary(Trainer& trainer, const StepBoundary& boundary) = 0;
};

class Trainer {
 public:
  // Collective over grid.world(). Validates the options, opens the training and evaluation
  // sets, checks the model against them (input width = features, output width = classes),
  // initialises the state from the seed and builds the compute backend and the reducer. Any
  // failure is thrown on every rank alike (ConfigError/DataError/IoError).
  Trainer(const Grid& grid, TrainOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Collective over grid.world(). Trains from state() -- fresh, or restored by assigning to
  // it -- until the planned steps are done, or until state().step reaches stop_at_step when
  // it is >= 0 (a resumable stop in the middle of an epoch). Reports to observer on every
  // rank. On return state() is current (synced from the backend). `hook`, when given, runs
  // at every step boundary and may stop training early. A stop before the end reports neither
  // the open log interval nor the open epoch: the next train() call, or a run resumed from a
  // checkpoint of this point (metrics_progress), reports them whole.
  TrainSummary train(TrainObserver* observer = nullptr, std::int64_t stop_at_step = -1,
                     StepHook* hook = nullptr);

  // Collective over grid.world(): the sums, steps and times of the epoch and the log interval in
  // progress (sums over the data-parallel ranks, times of world rank 0; the same on every
  // rank), at a step boundary inside train() (a StepHook) or between train() calls. What a
  // checkpoint stores so that a resumed run's metrics are those of an uninterrupted run.
  MetricsProgress metrics_progress();
  // Local: the next train() continues the epoch and log interval of `progress` (restored with
  // the state from a checkpoint; {} for a fresh start or a checkpoint that does not have it).
  void restore_metrics(const MetricsProgress& progress);

  // Local: the anomaly detector's state (the same on every rank), for a checkpoint; and its
  // restoration from one ({} for a fresh start or a checkpoint without it).
  AnomalyState anomaly_state() const;
  void restore_anomaly(const AnomalyState& state);

  // Collective over grid.dp(): every rank scores its part of the evaluation set with the
  // current parameters; loss and accuracy are summed over the ranks. Needs eval_path.
  EvalMetrics evaluate();

  // With pipeline stages, this rank's stage's layers only (model.held()). The mutable one may
  // be written (a checkpoint restore): the backend reloads it before the next train() or
  // evaluate(). Between those calls it is the authoritative copy.
  TrainState& state() noexcept;
  const TrainState& state() const noexcept;
  // state() made current from the compute backend (a device-to-host copy; nothing on the
  // CPU): what a StepHook reads before saving.
  const TrainState& synced_state();
  const TrainOptions& options() const noexcept;
  // The compute backend's description (Compute::describe()) on this rank.
  std::string compute_description() const;
  // The gradient reducer on this rank: "mpi", "mpi-host-staged", "nccl (NCCL 2.28.9)", with why
  // train.reducer = auto did not take NCCL where that applies.
  std::string reducer_description() const;
  // The pipeline's stage link on this rank: "mpi", "mpi-host-staged", "nccl (NCCL 2.28.9)",
  // with why train.stage_link = auto did not take NCCL where that applies; "" with one stage.
  std::string link_description() const;
  // Which gradient reduction runs and why (train.reduction; comm::GradientReducer::reduction),
  // e.g. "flat (train.reduction = auto: 2 ranks on 1 node (2; shared memory), one node)".
  std::string reduction_description() const;
  // Where this rank's training samples are and how its batches reach the compute, e.g. "the
  // whole set in memory on every rank (60000 rows, 179.4 MiB); cached on the GPU as bf16 (89.7
  // MiB)". Local.
  std::string data_description() const;

  // Local: what node-local staging of the training set did (data.stage_dir; stage.hpp), one
  // line, the same on every rank that feeds data; "" without staging or on a rank that does not
  // feed (a pipeline stage after the first).
  std::string stage_description() const;
  const Grid& grid() const noexcept;
  std::int64_t steps_per_epoch() const noexcept;
  // min(epochs * steps_per_epoch, max_steps when > 0)
  std::int64_t planned_steps() const noexcept;
  // Classes of the training set (its num_classes attribute; 0 when it has none).
  std::int64_t num_classes() const noexcept;
  // The cut of the model into stages when the pipeline engine trains (nullptr otherwise).
  const StagePartition* partition() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace locus::train
