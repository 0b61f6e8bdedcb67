// On-node anomaly detection in training (train.anomaly, _z, _window): the loss and the
// gradient norm of every step, agreed over all ranks of the grid by one small all-reduce, are
// compared with a window of the previous steps' values (z-scores, as llm.c's outlier
// detector), and checked for non-finite values, before the optimizer applies the update.
// The verdict -- apply, skip the update, or stop -- is a function of agreed values and of the
// detector's state only, so every rank reaches the same one and a run repeats its decisions;
// the state is part of a checkpoint (docs/FORMATS.md), so a resumed run does too.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "locus/train/grid.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/monitor/event.hpp"

namespace locus::train {

// What to do with a step whose loss or gradient norm z-score exceeds the threshold:
// warn (report it, apply the update), skip (report it, drop the update), stop (report it,
// stop training; the caller checkpoints the last good state and exits 3). A non-finite loss
// or gradient always stops, except under skip, which drops its update.
enum class AnomalyAction { warn, skip, stop };
AnomalyAction parse_anomaly_action(std::string_view name);  // ConfigError naming the choices
std::string_view to_string(AnomalyAction a) noexcept;

struct AnomalyOptions {
  AnomalyAction action = AnomalyAction::warn;
  double z = 8.0;        // train.anomaly_z: one-sided threshold on both z-scores
  int window = 100;      // train.anomaly_window: steps of history (z-scores once it is full)
  bool enabled = true;   // false: no checks at all (benchmarks of the detector's cost only)
};
void validate(const AnomalyOptions& o);  // ConfigError naming train.anomaly_*

// The detector's state, oldest values first; what a checkpoint keeps.
struct AnomalyState {
  std::vector<double> loss, grad_norm;  // the window (equal lengths)
  std::int64_t anomalies = 0;           // steps over the threshold so far
  std::int64_t skipped = 0;             // updates dropped so far
  std::int64_t consecutive_skips = 0;   // updates dropped in a row up to now
  friend bool operator==(const AnomalyState&, const AnomalyState&) = default;
};

// The last `capacity` values of a series; mean and σ (population) in a fixed order, so the
// same values give the same z-score bit for bit.
class ValueWindow {
 public:
  explicit ValueWindow(int capacity);
  void push(double v);
  bool full() const noexcept { return size_ == values_.size(); }
  std::size_t size() const noexcept { return size_; }
  // (x - mean) / σ over the window; NaN until it is full, or when σ is 0.
  double z(double x) const;
  std::vector<double> values() const;      // oldest first
  void assign(std::span<const double> v);  // oldest first; keeps the newest `capacity`

 private:
  std::vector<double> values_;
  std::size_t next_ = 0, size_ = 0;
};

// One step's figures, the same on every rank.
struct StepValues {
  double loss = 0;        // mean loss over the step's global batch
  double grad_norm = 0;   // global L2 norm of the reduced gradient (all stages)
  bool loss_finite = true, grads_finite = true;
  std::int64_t rows = 0;  // the global batch
};

// Collective over grid.world(): one all-reduce of a fixed-size int64 record (the loss sum as
// exact limbs, rows, non-finite counts, and each stage's sum of squares as a bit pattern from
// its data-parallel rank 0), so every rank gets the same bits whatever the reduction order.
// `local` is this rank's loss statistics of the step (a pipeline replica's on every stage: only
// stage 0 counts them), grad_squares the sum of squares of the gradient this rank holds after
// the data-parallel reduction. `inject` is a test hook's action on this rank
// (loss-spike, grad-spike, loss-nan; "" normally), applied to the figures only.
StepValues agree_step_values(const Grid& grid, const LossStats& local, double grad_squares,
                             const std::string& inject = "");

enum class StepAction { apply, skip, stop };

struct StepVerdict {
  StepAction action = StepAction::apply;
  bool anomalous = false;  // a z-score over the threshold
  bool nonfinite = false;
  double loss_z = 0, grad_z = 0;  // NaN while the window fills
};

class AnomalyDetector {
 public:
  explicit AnomalyDetector(const AnomalyOptions& o);
  const AnomalyOptions& options() const noexcept { return opts_; }
  // Local and deterministic: the verdict on `v` (agreed values) for the step that ends at
  // `step`, and the event to report (event.event empty when there is none). Values of a step
  // whose update is applied enter the window; those of a dropped or stopped one do not. More
  // than `window` updates dropped in a row stop training (the run cannot recover by itself).
  StepVerdict judge(std::int64_t step, const StepValues& v, MonitorEvent& event);
  AnomalyState state() const;
  void restore(const AnomalyState& s);

 private:
  AnomalyOptions opts_;
  ValueWindow loss_, grad_;
  std::int64_t anomalies_ = 0, skipped_ = 0, consecutive_skips_ = 0;
};

// Collective over grid.world(): whether every rank's parameters are finite (a diverged state
// is not saved).
bool params_finite(const Grid& grid, std::span<const float> params);

}  // namespace locus::train
