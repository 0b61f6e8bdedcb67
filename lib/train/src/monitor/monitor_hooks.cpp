// The trainer's side of the monitors (monitor/): what the loop calls between a step's gradient
// reduction and its update (the anomaly verdict), after each step (its times) and at the end
// of each log interval (the ranks' summaries and the straggler verdicts).
#include <fmt/format.h>

#include <algorithm>

#include "locus/comm/test_hook.hpp"
#include "trainer_impl.hpp"

namespace locus::train {

namespace {

double seconds_since(detail::Clock::time_point t) {
  return std::chrono::duration<double>(detail::Clock::now() - t).count();
}

}  // namespace

void Trainer::Impl::start_monitors(TrainObserver& obs) {
  monitors.observer = &obs;
  if (monitors.started) return;
  monitors.started = true;
  if (!opts.straggler.enabled()) return;
  std::vector<RankPlace> places = gather_places(grid.world());
  if (grid.world().is_root()) {
    monitors.stragglers.emplace(opts.straggler, std::move(places), grid.pipeline_stages());
  }
}

StepAction Trainer::Impl::judge_step() {
  if (!monitors.anomaly) return StepAction::apply;
  // This step's loss sums and gradient sum of squares (a device backend waits for them here,
  // once per step).
  drained.clear();
  settle();
  const double squares = compute->take_step_values(drained);
  monitors.squares = squares;
  LossStats local;
  for (const LossStats& s : drained) {
    local.loss_sum += s.loss_sum;
    local.correct += s.correct;
    local.rows += s.rows;
  }
  const std::int64_t ending = state.step + 1;  // the step number once this step is done
  const std::string inject =
      test_hooks_enabled() ? test_hook_action(fmt::format("anomaly-step-{}", ending)) : "";
  const auto t0 = detail::Clock::now();
  const StepValues v = agree_step_values(grid, local, squares, inject);
  monitors.agree_s += seconds_since(t0);
  MonitorEvent event;
  const StepVerdict verdict = monitors.anomaly->judge(ending, v, event);
  // A dropped or stopped step trained nothing: its loss stays out of the metrics sums.
  if (verdict.action == StepAction::apply) {
    for (const LossStats& s : drained) {
      detail::add(progress.interval, s);
      detail::add(progress.epoch, s);
      detail::add(total, s);
    }
  }
  if (!event.event.empty() && monitors.observer != nullptr) monitors.observer->on_event(event);
  monitors.stop = verdict.action == StepAction::stop ? event.message : "";
  return verdict.action;
}

void Trainer::Impl::time_step(const detail::Mark& before, double agree_before) {
  if (!opts.straggler.enabled()) return;
  const detail::Mark after = mark();
  const double step_s = std::chrono::duration<double>(after.time - before.time).count();
  // The loader's wait: the device's is known only when steps are drained, not per step.
  const double data = std::max(0.0, after.loader_wait_s - before.loader_wait_s);
  const double reduce =
      std::max(0.0, after.blocked_s - before.blocked_s) + (monitors.agree_s - agree_before);
  const double pipe = pipeline != nullptr ? pipeline->stage().last_step().wait_s : 0.0;
  const double compute_s = std::max(0.0, step_s - data - reduce - pipe);
  monitors.times.add({compute_s, data, reduce, pipe}, step_s);
}

void Trainer::Impl::report_ranks() {
  if (!opts.straggler.enabled() || !monitors.started) return;
  const std::vector<RankSummary> all = gather_summaries(grid.world(), monitors.times.take());
  if (!grid.world().is_root() || monitors.observer == nullptr) return;
  monitors.observer->on_ranks(ranks_record(state.step, all));
  const std::vector<MonitorEvent> events = monitors.stragglers->judge(state.step, all);
  for (const MonitorEvent& e : events) monitors.observer->on_event(e);
  if (!events.empty() && !opts.stragglers_file.empty()) {
    write_stragglers_file(opts.stragglers_file, monitors.stragglers->file_text(state.step));
  }
}

AnomalyState Trainer::anomaly_state() const {
  return impl_->monitors.anomaly ? impl_->monitors.anomaly->state() : AnomalyState{};
}

void Trainer::restore_anomaly(const AnomalyState& s) {
  if (impl_->monitors.anomaly) impl_->monitors.anomaly->restore(s);
}

}  // namespace locus::train
