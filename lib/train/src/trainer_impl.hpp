// Private to lib/train: the trainer's parts (loaders, state, backend, reducer) and the
// bookkeeping shared by construction (trainer.cpp) and the loop (train_loop.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "locus/comm/reducer.hpp"
#include "locus/train/compute.hpp"
#include "locus/train/data/loader.hpp"
#include "locus/train/pipeline/pipeline.hpp"
#include "locus/train/trainer.hpp"

namespace locus::train::detail {

using Clock = std::chrono::steady_clock;

// Loss, hits and rows summed exactly (metrics.hpp): locally over some steps, then over the
// data-parallel ranks.
using Sums = MetricSums;
inline void add(Sums& s, const LossStats& st) {
  s.loss.add(st.loss_sum);
  s.correct += st.correct;
  s.rows += st.rows;
}

// The counters that interval and epoch metrics are differences of.
struct Mark {
  Clock::time_point time;
  std::int64_t step = 0;
  // wait_s: data wait, the loader's and the device's (counted when steps are drained);
  // loader_wait_s: the loader's alone, known at once (the straggler detector's per-step split).
  double comm_s = 0, blocked_s = 0, wait_s = 0, loader_wait_s = 0;
};

// The time from a to b.
MetricTimes times_between(const Mark& a, const Mark& b);
// `m` moved back by `t` and `steps`: a mark from which `t` has already passed (carried over
// from an earlier train() call or a checkpoint).
Mark moved_back(Mark m, const MetricTimes& t, std::int64_t steps = 0);

// The gradient reducer for a backend's buffer over dp (train.reducer): host memory: the MPI
// reducer (nccl is a ConfigError); device memory: NCCL (nccl, or auto where NCCL can be used)
// or the CUDA backend's host-staged MPI reducer (mpi, or auto elsewhere, *why says why NCCL
// was not taken). Collective over dp.
std::unique_ptr<comm::GradientReducer> make_reducer(const comm::GradientBuffer& grads,
                                                    const mpi::Comm& dp,
                                                    const comm::ReducerOptions& options,
                                                    std::string* why = nullptr);

}  // namespace locus::train::detail

namespace locus::train {

struct Trainer::Impl {
  Impl(const Grid& grid, TrainOptions options);

  // Collective over dp: sums of every rank.
  detail::Sums reduce(detail::Sums local) const;
  detail::Mark mark() const;
  // One training step on this rank's rows of a global batch (its loss sums stay with the
  // backend until collect(), or go to the metrics at once when the anomaly detector judged
  // the step). False when the detector stopped training: nothing was applied or counted.
  bool step(const LoadedBatch& b);
  // Loads the TrainState into the backend when it may have changed since the backend last
  // had it (state() was handed out mutable): the host copy is authoritative between calls.
  void load_state();
  // The batch the backend sees (one-hot targets for mse).
  Batch batch_of(const LoadedBatch& b);
  // Collective over dp: interval metrics from `since` to now, given its local sums.
  StepMetrics interval(const detail::Mark& since, const detail::Sums& local);
  // Collective over dp: epoch metrics (no evaluation) from `since` to now.
  EpochMetrics epoch_metrics(const detail::Mark& since, const detail::Sums& local);
  // Collective over dp (see Trainer::evaluate).
  EvalMetrics evaluate();
  // The next training batch: the loader's on a rank it feeds, otherwise an empty stand-in
  // numbered like stage 0's (the pipeline engine hands the other stages what they need).
  const LoadedBatch* next_batch();
  // The gradient all-reduce's counters (the trainer's reducer, or the pipeline stage's).
  const comm::ReducerStats& reduce_stats() const;
  // Collective over the world (agreed): the training samples into the backend's memory.
  void cache_on_device();

  // What one train() call accumulates.
  struct Running {
    detail::Sums total;
    TrainSummary summary;
    StepHook* hook = nullptr;
    Trainer* self = nullptr;  // what the hook is given
    bool stopped = false;  // the hook asked to stop
  };
  // Calls the hook (if any) at the boundary after the current step; true when it stops.
  bool boundary(Running& run, bool epoch_end);
  // Waits (on the host) for the work queued on the compute stream so far, through the
  // reducer: a dead peer in the step's all-reduce ends the job after train.reducer_timeout_s.
  void settle();
  // Adds the loss sums of the steps since the last call (fetched from the backend) to the
  // interval, the epoch and the call's total.
  void collect();
  // Reports the interval since progress.interval_start, if it has steps.
  void close_interval(TrainObserver& obs);
  // Trains state.epoch from state.step_in_epoch to its end or to step `limit`.
  void train_epoch_steps(std::int64_t limit, Running& run, TrainObserver& obs);
  void drop_prefetched_epoch(bool keep_for_next);
  // After the last step of an epoch (or of the run): epoch metrics, the evaluation when due,
  // the counters moved to the next epoch.
  void end_epoch(Running& run, TrainObserver& obs);
  // train()'s start and end: the open epoch and interval continue from what was carried over
  // (start), and what they hold is carried over to the next call or checkpoint (end).
  void begin_progress();
  void end_progress();

  const Grid& grid;
  TrainOptions opts;
  // Read before the loaders exist: HDF5 is not thread-safe and their producers use it.
  std::int64_t classes = 0, eval_classes = 0;
  // Pipelined: only stage 0 holds loaders (feeds); the others learn the batch counts.
  bool pipelined = false;
  bool feeds = true;
  std::unique_ptr<Loader> loader;
  // A device backend copies each next batch in during the step before it (Loader::peek()),
  // the next epoch's first during the epoch's last step (Loader::peek_next_epoch()).
  bool prefetch = false;
  // The epoch whose first batch the backend holds copied ahead (-1: none): kept over the
  // epoch's end only for start_epoch(that epoch, 0), which keeps the loader's memory of it.
  std::int64_t prefetched_epoch = -1;
  std::unique_ptr<Loader> eval_loader;
  bool has_eval = false;
  std::int64_t eval_steps = 0;  // batches of an evaluation pass
  LoadedBatch idle;             // next_batch() on a rank without a loader
  std::int64_t steps_per_epoch = 0;
  std::int64_t planned_steps = 0;
  TrainState state;
  std::unique_ptr<Compute> compute;
  PipelineCompute* pipeline = nullptr;  // compute, when pipelined
  std::unique_ptr<comm::GradientReducer> reducer;  // not pipelined (the stage has its own)
  std::string reducer_note;  // why train.reducer = auto did not take NCCL (device gradients)
  GradsReadyFn on_grads_ready;
  std::vector<float> targets;  // mse: one-hot labels of the current batch
  double last_lr = 0;
  std::vector<LossStats> drained;  // collect()'s buffer
  detail::Sums total;              // of the running train() call
  // The epoch and the log interval in progress, kept across train() calls and restored from a
  // checkpoint (restore_metrics): local sums (on data-parallel rank 0 also what a checkpoint
  // carried in); the time and steps carried over from before this train() call; while train()
  // runs, the marks they started at (moved back by what was carried).
  struct Progress {
    detail::Sums epoch, interval;
    MetricTimes epoch_carried, interval_carried;
    std::int64_t interval_steps_carried = 0;
    detail::Mark epoch_start, interval_start;
    bool running = false;
  } progress;
  bool host_dirty = true;  // state() was handed out mutable since the backend loaded it

  // The monitors (monitor/monitor_hooks.cpp): the anomaly detector, judging every step between
  // the gradient reduction and the update, and the step times behind the straggler detector.
  struct Monitors {
    std::optional<AnomalyDetector> anomaly;       // opts.anomaly.enabled
    StepTimes times;                              // this rank's, of the open interval
    std::optional<StragglerDetector> stragglers;  // world rank 0, once started
    bool started = false;
    TrainObserver* observer = nullptr;            // of the running train() call
    double agree_s = 0;  // time in the anomaly all-reduce (a wait in a reduction)
    std::string stop;    // why the last judged step stopped training ("" when it did not)
    // anomaly = warn on a backend that defers the step values (a GPU): each step's update is
    // enqueued before its verdict and skipped on the device if the gradient is not finite, so
    // the host never waits for the whole step (train_loop.cpp, step()).
    bool deferred = false;
    double squares = 0;  // the last judged step's gradient sum of squares
  } monitors;
  // Collective over the world (once): the ranks' places for the straggler reports.
  void start_monitors(TrainObserver& obs);
  // Collective over the world, after the gradient reduction and before the update (after the
  // update is enqueued when monitors.deferred): the anomaly verdict on this step (its loss
  // sums go to the metrics unless it is dropped), from the values request_step_values() sent.
  StepAction judge_step();
  // step()'s end when monitors.deferred: enqueue the (gated) update, then judge.
  bool deferred_step();
  // Local: the parts of the step that began at `before` (mark() before its batch was taken).
  void time_step(const detail::Mark& before, double agree_before);
  // Collective over the world at the end of a log interval: the step-time summaries gathered
  // on world rank 0, its "ranks" line and straggler verdicts.
  void report_ranks();
};

}  // namespace locus::train
