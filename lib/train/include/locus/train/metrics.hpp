// What the trainer reports: step-interval and epoch metrics, the observer interface that
// receives them, and a JSON-lines writer (one object per line, keys as the struct fields,
// "type" = "step" or "epoch"). Losses and accuracies are global (all-reduced over the
// data-parallel ranks); timings are rank 0's.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"

namespace locus::train {

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
};

// Receives metrics on every rank of the trainer's world (identical values, except timings);
// implementations decide who prints.
class TrainObserver {
 public:
  virtual ~TrainObserver() = default;
  virtual void on_step(const StepMetrics&) {}
  virtual void on_epoch(const EpochMetrics&) {}
};

// Fans out to several observers, in order.
class ObserverList final : public TrainObserver {
 public:
  void add(TrainObserver* o) { list_.push_back(o); }
  void on_step(const StepMetrics& m) override;
  void on_epoch(const EpochMetrics& m) override;

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

 private:
  void write_line(const std::string& line);
  std::FILE* file_ = nullptr;
  std::string path_;
};

std::string to_json(const StepMetrics& m);
std::string to_json(const EpochMetrics& m);

}  // namespace locus::train
