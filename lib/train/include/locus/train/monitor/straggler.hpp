// Straggler detection in training (train.straggler_*): every rank times the parts of its own
// steps (compute, waiting for data, waiting in the gradient reduction, waiting for other
// pipeline stages) and keeps a small summary per log interval; one fixed-size gather per
// interval brings the summaries to world rank 0, which writes a "ranks" line and judges: a
// rank whose median compute per step (or mean data wait) exceeds the other ranks' median of
// it by more than straggler_pct % of their median compute and more than straggler_k σ of
// theirs (and by 1 ms at least), for straggler_intervals intervals in a row, is a
// straggler -- reported once, and again when it has recovered for as many intervals. No
// traffic is added to the steps.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/train/monitor/event.hpp"

namespace locus::train {

// Off by default in the library (its verdicts depend on timing, which a library test cannot
// control); locus-train's default is 25 %.
struct StragglerOptions {
  double pct = 0;      // train.straggler_pct: excess over the others' median (0: off)
  double k = 3;        // train.straggler_k: ... and over k σ of the others' values
  int intervals = 3;   // train.straggler_intervals: consecutive intervals to decide
  bool enabled() const noexcept { return pct > 0; }
};
void validate(const StragglerOptions& o);  // ConfigError naming train.straggler_*

// The parts of a step, in the order of the "ranks" line.
enum class StepPart { compute = 0, data_wait, reduce_wait, pipeline_wait };
inline constexpr int kStepParts = 4;
const char* part_name(StepPart p) noexcept;  // "compute", "data_wait", ...

// One rank's summary of an interval: a fixed-size record of doubles (what is gathered).
struct RankSummary {
  double steps = 0;
  std::array<double, kStepParts> mean{};  // seconds per step
  double compute_sd = 0, compute_p50 = 0, compute_p90 = 0;
  double step_max = 0;
};

// Local: the step times of the current interval.
class StepTimes {
 public:
  void add(const std::array<double, kStepParts>& parts, double step_s);
  // The interval's summary; starts the next interval.
  RankSummary take();

 private:
  std::array<double, kStepParts> sums_{};
  std::vector<double> compute_;  // for σ and quantiles (log_every values)
  double max_ = 0;
};

// Where a rank runs: the host name and Slurm's node name (SLURMD_NODENAME, "" outside Slurm).
struct RankPlace {
  std::string host, node;
};
// Collective over comm: every rank's place, on every rank (once, at start-up).
std::vector<RankPlace> gather_places(const mpi::Comm& comm);

// Collective over comm: every rank's summary on comm's rank 0 (empty elsewhere): one
// MPI_Gather of a fixed-size record.
std::vector<RankSummary> gather_summaries(const mpi::Comm& comm, const RankSummary& mine);

// The "ranks" line of an interval from the gathered summaries.
RanksRecord ranks_record(std::int64_t step, const std::vector<RankSummary>& all);

// Rank 0's judgement over the intervals.
class StragglerDetector {
 public:
  // Ranks are compared with the ranks of the same pipeline stage only (world rank r holds stage
  // r % stages): stages differ in their work by design.
  StragglerDetector(const StragglerOptions& o, std::vector<RankPlace> places, int stages = 1);
  // The events of this interval (straggler, straggler_recovered), in rank order.
  std::vector<MonitorEvent> judge(std::int64_t step, const std::vector<RankSummary>& all);
  // The stragglers at this point (rank -> the event that reported it).
  const std::map<int, MonitorEvent>& current() const noexcept { return current_; }
  // The stragglers file's text (docs/FORMATS.md, "The stragglers file").
  std::string file_text(std::int64_t step) const;

 private:
  StragglerOptions opts_;
  std::vector<RankPlace> places_;
  int stages_ = 1;
  std::vector<int> slow_run_, fine_run_;  // consecutive slow / fine intervals per rank
  std::map<int, MonitorEvent> current_;
};

// Local (rank 0): writes the stragglers file at `path` atomically (path.tmp, rename). An error
// is a warning on stderr, not a failure: the file only helps the next allocation.
void write_stragglers_file(const std::string& path, const std::string& text);

}  // namespace locus::train
