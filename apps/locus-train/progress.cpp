// Rank 0's progress lines for locus-train.
#include "progress.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "locus/train/monitor/event.hpp"

namespace locus::app {

void Progress::on_event(const train::MonitorEvent& e) {
  // A stop is printed once, as the error that ends the run (main.cpp).
  if (!enabled_ || (e.values.contains("action") && e.values["action"] == "stop")) return;
  std::fputs((e.message + "\n").c_str(), stderr);
  std::fflush(stderr);
}

void Progress::header(const train::Trainer& t) const {
  if (!enabled_) return;
  const auto& o = t.options();
  fmt::print("training {} {} on {} ({} steps/epoch x {} epochs{}, global batch {}, {} shuffle)\n",
             train::format_widths(o.model.widths), train::to_string(o.model.activation),
             o.data.path, t.steps_per_epoch(), o.epochs,
             o.max_steps > 0 ? fmt::format(", at most {} steps", o.max_steps) : "",
             o.data.global_batch, o.data.shuffle == train::Shuffle::global ? "global" : "local");
  fmt::print("  {}; {} BLAS thread{} per rank; {} {}, lr {:g} ({}), loss {}\n",
             t.grid().describe(), o.threads, o.threads == 1 ? "" : "s",
             train::to_string(o.optimizer.kind),
             o.optimizer.kind == train::OptimizerKind::sgd
                 ? fmt::format("momentum {:g}{}", o.optimizer.momentum,
                               o.optimizer.nesterov ? " nesterov" : "")
                 : fmt::format("betas {:g},{:g}", o.optimizer.beta1, o.optimizer.beta2),
             o.schedule.base_lr, train::to_string(o.schedule.kind), train::to_string(o.loss));
  fmt::print("  gradient reduction: {}\n", t.reduction_description());
  fmt::print("  data: {}\n", t.data_description());
  if (o.pipeline_stages > 1 || t.grid().world().size() > 1) {
    fmt::print("  layout: {}\n", t.grid().layout());
  }
  if (const train::StagePartition* p = t.partition()) {
    fmt::print("  {} micro-batch{} per step, {} schedule; {}\n", o.micro_batches,
               o.micro_batches == 1 ? "" : "es", train::to_string(o.pipeline_schedule),
               p->describe());
    // What a stage keeps (this is rank 0, stage 0): its layers only, never the whole model.
    const train::TrainState& st = t.state();
    std::size_t bytes = st.model.params().size_bytes();
    for (const auto& b : std::as_const(*st.optimizer).state()) bytes += b.data.size_bytes();
    const std::size_t whole = st.model.layout().size() * sizeof(float) *
                              (bytes / std::max<std::size_t>(st.model.params().size_bytes(), 1));
    fmt::print("  a stage-0 rank holds {:.1f} MiB of parameters and optimizer state (the whole "
               "model's: {:.1f} MiB)\n",
               static_cast<double>(bytes) / 1048576.0, static_cast<double>(whole) / 1048576.0);
  }
  std::fflush(stdout);
}

void Progress::on_epoch(const train::EpochMetrics& m) {
  if (!enabled_) return;
  std::string eval;
  if (m.evaluated) {
    eval = fmt::format(" | test loss {:.4f} acc {:.4f}", m.eval.loss, m.eval.accuracy);
  }
  fmt::print("epoch {:>3}/{} step {:>6}  train loss {:.4f} acc {:.4f}{} | {:.0f} samples/s, "
             "data wait {:.1f}%, all-reduce hidden {:.0f}% | {:.1f} s\n",
             m.epoch + 1, epochs_, m.step, m.train_loss, m.train_accuracy, eval,
             m.samples_per_s, 100.0 * m.data_wait_fraction, 100.0 * m.hidden_fraction,
             m.seconds);
  std::fflush(stdout);
}

void Progress::summary(const train::TrainOptions& options, const train::TrainSummary& s,
                       const std::string& model_path, double wall_s) const {
  if (!enabled_) return;
  fmt::print("trained {} steps ({} samples) in {:.2f} s: {:.0f} samples/s, data wait {:.2f}%, "
             "all-reduce {:.2f} s ({:.0f}% hidden); evaluation {:.2f} s; wall {:.2f} s\n",
             s.steps, s.samples, s.seconds, s.samples_per_s, 100.0 * s.data_wait_fraction,
             s.allreduce_s, 100.0 * s.hidden_fraction, s.eval_seconds, wall_s);
  if (options.compute.backend == "cuda" && options.pipeline_stages == 1) {  // stages: not timed
    fmt::print("data wait: the loader (host) {:.2f}%, the GPU's stream for its inputs {:.2f}%\n",
               100.0 * std::max(0.0, s.data_wait_fraction - s.data_wait_device_fraction),
               100.0 * s.data_wait_device_fraction);
  }
  if (s.evaluated) {
    fmt::print("test accuracy {:.4f} (loss {:.4f}) on {} rows of {}\n", s.eval.accuracy,
               s.eval.loss, s.eval.rows, options.eval_path);
  }
  if (!model_path.empty()) fmt::print("model written to {}\n", model_path);
  std::fflush(stdout);
}

}  // namespace locus::app
