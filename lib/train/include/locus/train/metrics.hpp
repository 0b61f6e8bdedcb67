// What the trainer reports: step-interval and epoch metrics, the observer interface that
// receives them, and a JSON-lines writer (one object per line, keys as the struct fields,
// "type" = "step" or "epoch"). Losses and accuracies are global (all-reduced over the
// data-parallel ranks); timings are rank 0's.
#pragma once

#include <array>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"

namespace locus::train {

// An exact sum of doubles, the same whatever the order and grouping of the additions: a
// fixed-point number in 32-bit limbs (limb i weighs 2^(32 i - 64)), so the training loss summed
// over some steps on each rank, over the ranks, or over a checkpoint's part of an epoch and the
// resumed rest is the same number bit for bit. Values below 2^-64 in magnitude are truncated to
// that grid (deterministically); non-finite values and those of 2^150 or more are summed apart,
// as plain doubles (`other`), so NaN and infinity still show in the result.
class ExactSum {
 public:
  static constexpr int kLimbs = 8;
  static constexpr int kFractionBits = 64;

  void add(double x);
  void add(const ExactSum& o);
  // Collective over comm: the sum of every rank's value, on every rank.
  ExactSum allreduce(const mpi::Comm& comm) const;
  // The value rounded to a double (a function of the exact value only).
  double value() const;

  // The representation, for storage (docs/FORMATS.md, "Checkpoint files"): limbs 0..6 in
  // [0, 2^32), limb 7 signed; `other` as above (0 normally).
  const std::array<std::int64_t, kLimbs>& limbs() const noexcept { return limb_; }
  double other() const noexcept { return other_; }
  // From a stored representation; DataError unless it is normalized as above.
  static ExactSum from_parts(const std::array<std::int64_t, kLimbs>& limbs, double other);

  friend bool operator==(const ExactSum&, const ExactSum&) = default;

 private:
  void normalize();
  std::array<std::int64_t, kLimbs> limb_{};
  double other_ = 0;
};

// Loss, hits and rows summed over some steps (on one rank, or over the data-parallel ranks).
struct MetricSums {
  ExactSum loss;
  std::int64_t correct = 0, rows = 0;
  friend bool operator==(const MetricSums&, const MetricSums&) = default;
};

// Time spent in a stretch of training (rank 0's clock and counters).
struct MetricTimes {
  double seconds = 0, allreduce_s = 0, allreduce_blocked_s = 0, data_wait_s = 0;
};

// The epoch and the log interval in progress at a step boundary: what a checkpoint carries so
// that a resumed run reports the metrics an uninterrupted one would (Trainer::metrics_progress).
struct MetricsProgress {
  MetricSums epoch, interval;        // over every data-parallel rank
  std::int64_t interval_steps = 0;   // steps in the open interval
  MetricTimes epoch_time, interval_time;
};

// The log interval ending at `step` (every TrainOptions::log_every steps, and at epoch ends).
struct StepMetrics {
  std::int64_t step = 0;           // optimizer steps taken so far
  std::int64_t epoch = 0;
  std::int64_t step_in_epoch = 0;  // batches of `epoch` trained on so far
  std::int64_t steps = 0;          // steps in this interval
  std::int64_t samples = 0;        // global samples in this interval
  double loss = 0;                 // mean training loss over the interval's samples
  double accuracy = 0;             // training accuracy over them (argmax vs label)
  double lr = 0;                   // learning rate of the last step
  double grad_norm = -1;           // of the last step; -1 when clipping is off (not computed)
  double seconds = 0;              // wall time of the interval
  double samples_per_s = 0;
  double allreduce_s = 0;          // gradient all-reduce: launch of the first chunk to the last
  double allreduce_blocked_s = 0;  // of which the loop waited for (not hidden behind backward)
  double hidden_fraction = 0;      // 1 - blocked / allreduce
  double data_wait_s = 0;          // time waiting for the loader
  double data_wait_fraction = 0;   // data_wait_s / seconds
  double time = 0;                 // when the interval ended (Unix seconds, this rank's clock)
};

struct EvalMetrics {
  std::int64_t rows = 0;
  double loss = 0;      // mean per-sample loss
  double accuracy = 0;  // argmax hits / rows
  double seconds = 0;
};

struct EpochMetrics {
  std::int64_t epoch = 0;
  std::int64_t step = 0;  // optimizer steps taken at the end of the epoch
  std::int64_t samples = 0;
  double train_loss = 0, train_accuracy = 0;
  double seconds = 0;     // training time of the epoch (evaluation excluded)
  double samples_per_s = 0;
  double data_wait_fraction = 0;
  double hidden_fraction = 0;
  bool evaluated = false;
  EvalMetrics eval;       // when evaluated
  double time = 0;        // when the epoch's line was made, after any evaluation (Unix seconds)
};

// Now as Unix seconds (the system clock): the `time` member of metrics lines.
double unix_seconds();
struct MonitorEvent;  // monitor/event.hpp
struct RanksRecord;

// Receives metrics on every rank of the trainer's world (identical values, except timings);
// implementations decide who prints.
class TrainObserver {
 public:
  virtual ~TrainObserver() = default;
  virtual void on_step(const StepMetrics&) {}
  virtual void on_epoch(const EpochMetrics&) {}
  // The monitors (monitor/): anomaly events on every rank (identical); the per-interval step
  // times of every rank and straggler events on world rank 0 only.
  virtual void on_event(const MonitorEvent&) {}
  virtual void on_ranks(const RanksRecord&) {}
};

// Fans out to several observers, in order.
class ObserverList final : public TrainObserver {
 public:
  void add(TrainObserver* o) { list_.push_back(o); }
  void on_step(const StepMetrics& m) override;
  void on_epoch(const EpochMetrics& m) override;
  void on_event(const MonitorEvent& e) override;
  void on_ranks(const RanksRecord& r) override;

 private:
  std::vector<TrainObserver*> list_;
};

// One JSON object per line, written and flushed by rank 0 of comm:
//   {"type":"step","step":..,"epoch":..,"loss":..,"samples_per_s":..,"allreduce_s":..,...}
//   {"type":"epoch","epoch":..,"train_loss":..,"eval_loss":..,"eval_accuracy":..,...}
class JsonlMetrics final : public TrainObserver {
 public:
  // Collective over comm: rank 0 creates `path`; an unwritable path is an IoError on every
  // rank. An empty path writes nothing. A run resumed after `resumed_step` (>= 0) keeps the
  // file's lines up to that step, so the file reads as one uninterrupted run.
  JsonlMetrics(const mpi::Comm& comm, const std::string& path, std::int64_t resumed_step = -1);
  ~JsonlMetrics() override;
  JsonlMetrics(const JsonlMetrics&) = delete;
  JsonlMetrics& operator=(const JsonlMetrics&) = delete;

  void on_step(const StepMetrics& m) override;
  void on_epoch(const EpochMetrics& m) override;
  // Another line (one JSON object starting {"type":"<type>","step":N,...}: telemetry, run and
  // event lines), written on rank 0; a no-op elsewhere and without a file.
  void write_record(const std::string& json_line) { write_line(json_line); }
  void on_event(const MonitorEvent& e) override;  // "type":"event" lines
  void on_ranks(const RanksRecord& r) override;   // "type":"ranks" lines

 private:
  void write_line(const std::string& line);
  std::FILE* file_ = nullptr;
  std::string path_;
};

std::string to_json(const StepMetrics& m);
std::string to_json(const EpochMetrics& m);

}  // namespace locus::train
