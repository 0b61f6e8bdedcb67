// Human-readable progress of locus-train, printed by rank 0: the run's header, one line per
// epoch, and the final summary.
#pragma once

#include <string>

#include "locus/train/metrics.hpp"
#include "locus/train/trainer.hpp"

namespace locus::app {

class Progress final : public train::TrainObserver {
 public:
  // Prints only where `enabled` (rank 0 of the world).
  Progress(bool enabled, std::int64_t epochs) : enabled_(enabled), epochs_(epochs) {}

  void header(const train::Trainer& trainer) const;
  void on_epoch(const train::EpochMetrics& m) override;
  // Anomaly and straggler events: one line each on stderr (the only monitor output printed).
  void on_event(const train::MonitorEvent& e) override;
  void summary(const train::TrainOptions& options, const train::TrainSummary& s,
               const std::string& model_path, double wall_s) const;

 private:
  bool enabled_;
  std::int64_t epochs_;
};

}  // namespace locus::app
