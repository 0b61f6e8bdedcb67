// The training loop: epochs of steps from the loader, metrics per log interval and per
// epoch, evaluation at epoch ends. Everything it reads is a function of (seed, epoch, step)
// plus TrainState, so a run stopped at any step and restored continues bit for bit.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/train/optim/clip.hpp"
#include "locus/train/optim/schedule.hpp"
#include "trainer_impl.hpp"

namespace locus::train {

using detail::Clock;
using detail::Mark;
using detail::Sums;

namespace {

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double ratio(double a, double b) { return b > 0 ? a / b : 0.0; }

// Share of the all-reduce time the loop did not wait for.
double hidden(double comm_s, double blocked_s) {
  return comm_s > 0 ? std::clamp(1.0 - blocked_s / comm_s, 0.0, 1.0) : 0.0;
}

}  // namespace

namespace detail {

MetricTimes times_between(const Mark& a, const Mark& b) {
  return {seconds_between(a.time, b.time), b.comm_s - a.comm_s, b.blocked_s - a.blocked_s,
          b.wait_s - a.wait_s};
}

Mark moved_back(Mark m, const MetricTimes& t, std::int64_t steps) {
  m.time -= std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(t.seconds));
  m.step -= steps;
  m.comm_s -= t.allreduce_s;
  m.blocked_s -= t.allreduce_blocked_s;
  m.wait_s -= t.data_wait_s;
  return m;
}

}  // namespace detail

Mark Trainer::Impl::mark() const {
  const comm::ReduceTimes& t = reduce_stats().total;
  // Data wait: the loader's (the host waiting in next()) and the device's (its compute waiting
  // for a batch's copy or gather, over the steps drained so far).
  const double loader_wait = loader ? loader->wait_seconds() : 0.0;
  return Mark{Clock::now(), state.step, t.comm_s, t.blocked_s,
              loader_wait + compute->input_wait_seconds(), loader_wait};
}

bool Trainer::Impl::step(const LoadedBatch& b) {
  LOCUS_ASSERT(b.epoch == state.epoch && b.step == state.step_in_epoch,
               fmt::format("the loader handed out batch (epoch {}, step {}) where the trainer "
                           "expected (epoch {}, step {})",
                           b.epoch, b.step, state.epoch, state.step_in_epoch));
  test_hook("train-step");  // e.g. train-step:delay50@1, a straggler for the tests
  // train-step-N (1-based): one step, e.g. a rank stopping once its peers' reductions run.
  if (test_hooks_enabled()) test_hook(fmt::format("train-step-{}", state.step + 1).c_str());
  comm::progress("forward and backward of step {}", state.step + 1);
  compute->forward_backward(batch_of(b), static_cast<std::uint64_t>(state.step),
                            static_cast<double>(b.global_rows), on_grads_ready);
  // A device copies the next batch in while this step computes, when the loader has it; in
  // the epoch's last step, the next epoch's first (so no epoch starts with a wait for its copy).
  if (prefetch) {
    if (const LoadedBatch* ahead = loader->peek()) {
      compute->prefetch_inputs(batch_of(*ahead));
    } else if (state.step_in_epoch + 1 == steps_per_epoch && state.step + 1 < planned_steps) {
      if (const LoadedBatch* first = loader->peek_next_epoch()) {
        compute->prefetch_inputs(batch_of(*first));
        prefetched_epoch = state.epoch + 1;
      }
    }
  }
  comm::progress("gradient all-reduce of step {}", state.step + 1);
  test_hook("train-before-allreduce");  // a rank dies or stalls as its peers wait in it
  if (reducer) reducer->finish();  // the pipeline engine completes its own
  if (monitors.anomaly) compute->request_step_values();
  if (monitors.deferred) return deferred_step();
  const StepAction verdict = judge_step();  // monitor/monitor_hooks.cpp
  if (verdict == StepAction::stop) return false;
  last_lr = learning_rate(opts.schedule, state.step);
  if (verdict == StepAction::apply) compute->optimizer_step(last_lr, opts.clip_max_norm);
  ++state.step;
  ++state.step_in_epoch;
  return true;
}

// anomaly = warn on a deferring backend: the update goes first, gated on the device by the
// gradient's finiteness, then the verdict (apply, or stop on a non-finite value: warn never
// skips). A stop leaves the state before the step when the device skipped the update, as the
// other order does; when only the loss was non-finite (the gradient was finite) the update
// ran, and the step counts.
bool Trainer::Impl::deferred_step() {
  const double lr_before = last_lr;
  last_lr = learning_rate(opts.schedule, state.step);
  compute->optimizer_step(last_lr, opts.clip_max_norm);
  const StepAction verdict = judge_step();
  LOCUS_ASSERT(verdict != StepAction::skip, "train.anomaly = warn dropped an update");
  if (verdict == StepAction::stop && !std::isfinite(monitors.squares)) {
    state.optimizer->set_steps(state.optimizer->steps() - 1);  // the device skipped it
    last_lr = lr_before;
    return false;
  }
  ++state.step;
  ++state.step_in_epoch;
  return verdict != StepAction::stop;
}

// Before the host waits for the compute stream, which waits for the step's all-reduce: the
// reducer watches its peers meanwhile (NCCL; host reducers already blocked in finish()).
void Trainer::Impl::settle() {
  if (reducer) reducer->settle(compute->grads().stream);
}

void Trainer::Impl::collect() {
  drained.clear();
  settle();  // the loss sums and, after them, the gradient norm wait for the stream
  compute->drain_stats(drained);
  for (const LossStats& s : drained) {
    detail::add(progress.interval, s);
    detail::add(progress.epoch, s);
    detail::add(total, s);
  }
}

StepMetrics Trainer::Impl::interval(const Mark& since, const Sums& local) {
  const Mark now = mark();
  const Sums all = reduce(local);
  const auto rows = static_cast<double>(all.rows);
  StepMetrics m;
  m.step = state.step;
  m.epoch = state.epoch;
  m.step_in_epoch = state.step_in_epoch;
  m.steps = state.step - since.step;
  m.samples = all.rows;
  m.loss = ratio(all.loss.value(), rows);
  m.accuracy = ratio(static_cast<double>(all.correct), rows);
  m.lr = last_lr;
  m.grad_norm = compute->last_grad_norm();
  m.seconds = seconds_between(since.time, now.time);
  m.samples_per_s = ratio(rows, m.seconds);
  m.allreduce_s = now.comm_s - since.comm_s;
  m.allreduce_blocked_s = now.blocked_s - since.blocked_s;
  m.hidden_fraction = hidden(m.allreduce_s, m.allreduce_blocked_s);
  m.data_wait_s = now.wait_s - since.wait_s;
  m.data_wait_fraction = ratio(m.data_wait_s, m.seconds);
  m.time = unix_seconds();
  return m;
}

// Epoch-end metrics from `since` (the epoch's start) with the epoch's local sums.
EpochMetrics Trainer::Impl::epoch_metrics(const Mark& since, const Sums& local) {
  const Mark now = mark();
  const Sums all = reduce(local);
  const auto rows = static_cast<double>(all.rows);
  EpochMetrics e;
  e.epoch = state.epoch;
  e.step = state.step;
  e.samples = all.rows;
  e.train_loss = ratio(all.loss.value(), rows);
  e.train_accuracy = ratio(static_cast<double>(all.correct), rows);
  e.seconds = seconds_between(since.time, now.time);
  e.samples_per_s = ratio(rows, e.seconds);
  e.data_wait_fraction = ratio(now.wait_s - since.wait_s, e.seconds);
  e.hidden_fraction = hidden(now.comm_s - since.comm_s, now.blocked_s - since.blocked_s);
  return e;
}

void Trainer::Impl::close_interval(TrainObserver& obs) {
  if (state.step == progress.interval_start.step) return;
  obs.on_step(interval(progress.interval_start, progress.interval));
  report_ranks();  // the straggler detector's gather (monitor/monitor_hooks.cpp)
  progress.interval = {};
  progress.interval_start = mark();
}

// Forgets any batch copied ahead -- a next epoch's first, or one of this epoch left by an
// exception out of the loop -- unless it is the first batch the loader is about to hand out
// (start_epoch(epoch, 0) keeps that memory); any other start_epoch() may reuse it at once.
void Trainer::Impl::drop_prefetched_epoch(bool keep_for_next) {
  const bool kept =
      keep_for_next && prefetched_epoch == state.epoch && state.step_in_epoch == 0;  // -1: none
  if (!kept) compute->drop_prefetched();  // nothing to wait for when nothing was copied ahead
  prefetched_epoch = -1;
}

void Trainer::Impl::train_epoch_steps(std::int64_t limit, Running& run, TrainObserver& obs) {
  drop_prefetched_epoch(true);
  if (loader) loader->start_epoch(state.epoch, state.step_in_epoch);
  while (state.step_in_epoch < steps_per_epoch && state.step < limit) {
    const Mark before = opts.straggler.enabled() ? mark() : Mark{};
    const double agree_before = monitors.agree_s;
    comm::progress("loading the batch of step {}", state.step + 1);
    const LoadedBatch* b = next_batch();
    LOCUS_ASSERT(b != nullptr, fmt::format("the loader ended epoch {} after {} of {} steps",
                                           state.epoch, state.step_in_epoch, steps_per_epoch));
    if (!step(*b)) {  // the anomaly detector stopped training (run.summary says why)
      run.stopped = true;
      run.summary.anomaly_stop = monitors.stop;
      break;
    }
    time_step(before, agree_before);
    // A device backend keeps the steps' loss sums until asked: once per interval, not per step.
    if (opts.log_every > 0 && state.step % opts.log_every == 0) {
      collect();
      close_interval(obs);
    }
    // The boundaries that end the epoch or the run come after end_epoch (see train()).
    const bool ends_epoch = state.step_in_epoch == steps_per_epoch || state.step == planned_steps;
    if (!ends_epoch && boundary(run, false)) break;
  }
  // A batch copied ahead stays until the next start_epoch() or the end of train(), which drop
  // it unless the loader keeps it (drop_prefetched_epoch()). On an exception the backend's
  // destructor waits for its copies before the loader frees them.
  collect();
}

bool Trainer::Impl::boundary(Running& run, bool epoch_end) {
  if (run.hook == nullptr) return false;
  const StepBoundary b{state.step, epoch_end, state.step == planned_steps};
  run.stopped = run.hook->at_step_boundary(*run.self, b);
  return run.stopped;
}

void Trainer::Impl::end_epoch(Running& run, TrainObserver& obs) {
  const bool epoch_done = state.step_in_epoch == steps_per_epoch;
  const bool run_done = state.step == planned_steps;
  close_interval(obs);
  EpochMetrics e = epoch_metrics(progress.epoch_start, progress.epoch);
  progress.epoch = {};
  run.summary.last_train_loss = e.train_loss;
  if (has_eval &&
      (run_done || (opts.eval_every > 0 && (state.epoch + 1) % opts.eval_every == 0))) {
    comm::progress("evaluation after epoch {}", state.epoch + 1);
    e.eval = evaluate();
    e.evaluated = true;
    run.summary.eval_seconds += e.eval.seconds;
    run.summary.evaluated = true;
    run.summary.eval = e.eval;
  }
  if (epoch_done) {
    ++state.epoch;
    state.step_in_epoch = 0;
  }
  e.time = unix_seconds();
  obs.on_epoch(e);
  // Evaluation time is not training time; an epoch-end checkpoint carries no epoch time.
  progress.interval_start = progress.epoch_start = mark();
}

void Trainer::Impl::begin_progress() {
  const Mark now = mark();
  progress.epoch_start = detail::moved_back(now, progress.epoch_carried);
  progress.interval_start =
      detail::moved_back(now, progress.interval_carried, progress.interval_steps_carried);
  progress.epoch_carried = progress.interval_carried = {};
  progress.interval_steps_carried = 0;
  progress.running = true;
}

void Trainer::Impl::end_progress() {
  const Mark now = mark();
  progress.epoch_carried = detail::times_between(progress.epoch_start, now);
  progress.interval_carried = detail::times_between(progress.interval_start, now);
  progress.interval_steps_carried = state.step - progress.interval_start.step;
  progress.running = false;
}

TrainSummary Trainer::train(TrainObserver* observer, std::int64_t stop_at_step,
                            StepHook* hook) {
  Impl& m = *impl_;
  TrainState& st = m.state;
  // A restored state is the same on every rank: so is the verdict, agreed for a clean exit.
  mpi::agree_on(m.grid.world(), [&] { st.check(); });
  TrainObserver none;
  TrainObserver& obs = observer != nullptr ? *observer : none;
  const std::int64_t limit =
      stop_at_step >= 0 ? std::min(stop_at_step, m.planned_steps) : m.planned_steps;

  m.load_state();
  m.start_monitors(obs);
  const Mark start = m.mark();
  Impl::Running run;
  run.hook = hook;
  run.self = this;
  m.total = {};
  m.begin_progress();
  bool first = true;
  while (st.step < limit && !run.stopped) {
    if (st.step_in_epoch >= m.steps_per_epoch) {  // restored exactly at an epoch boundary
      ++st.epoch;
      st.step_in_epoch = 0;
    }
    // An epoch begun before this call (a resume, a stop) goes on from what it carried.
    if (!first) m.progress.epoch_start = m.mark();
    first = false;
    m.train_epoch_steps(limit, run, obs);
    const bool epoch_done = st.step_in_epoch == m.steps_per_epoch;
    // Stopped at stop_at_step or by the hook: the open interval and epoch are carried over to
    // the next call or the checkpoint, not reported (an uninterrupted run reports them later).
    if (run.stopped || (!epoch_done && st.step != m.planned_steps)) break;
    m.end_epoch(run, obs);
    m.boundary(run, epoch_done);
  }
  m.drop_prefetched_epoch(false);  // the next call (or a restore) may start anywhere
  m.end_progress();
  m.settle();  // the copy waits for the last step's all-reduce: watch the peers meanwhile
  m.compute->sync_to_host();

  const Mark end = m.mark();
  TrainSummary& summary = run.summary;
  summary.steps = st.step - start.step;
  summary.samples = m.reduce(m.total).rows;
  summary.seconds = seconds_between(start.time, end.time) - summary.eval_seconds;
  summary.samples_per_s = ratio(static_cast<double>(summary.samples), summary.seconds);
  summary.data_wait_fraction = ratio(end.wait_s - start.wait_s, summary.seconds);
  // The loader's share directly; the device's is the rest (never below 0 by rounding).
  summary.data_wait_device_fraction =
      std::max(0.0, summary.data_wait_fraction -
                        ratio(end.loader_wait_s - start.loader_wait_s, summary.seconds));
  summary.allreduce_s = end.comm_s - start.comm_s;
  summary.hidden_fraction = hidden(summary.allreduce_s, end.blocked_s - start.blocked_s);
  summary.finished = st.step >= m.planned_steps;
  return summary;
}

MetricsProgress Trainer::metrics_progress() {
  Impl& m = *impl_;
  if (m.progress.running) m.collect();  // the sums the backend still holds
  MetricsProgress p;
  p.epoch = m.reduce(m.progress.epoch);
  p.interval = m.reduce(m.progress.interval);
  if (m.progress.running) {
    const Mark now = m.mark();
    p.epoch_time = detail::times_between(m.progress.epoch_start, now);
    p.interval_time = detail::times_between(m.progress.interval_start, now);
    p.interval_steps = m.state.step - m.progress.interval_start.step;
  } else {
    p.epoch_time = m.progress.epoch_carried;
    p.interval_time = m.progress.interval_carried;
    p.interval_steps = m.progress.interval_steps_carried;
  }
  // Timings are world rank 0's, so that every rank stores the same values.
  double t[8] = {p.epoch_time.seconds, p.epoch_time.allreduce_s,
                 p.epoch_time.allreduce_blocked_s, p.epoch_time.data_wait_s,
                 p.interval_time.seconds, p.interval_time.allreduce_s,
                 p.interval_time.allreduce_blocked_s, p.interval_time.data_wait_s};
  m.grid.world().bcast(std::span<double>(t), 0);
  p.epoch_time = {t[0], t[1], t[2], t[3]};
  p.interval_time = {t[4], t[5], t[6], t[7]};
  return p;
}

void Trainer::restore_metrics(const MetricsProgress& p) {
  Impl& m = *impl_;
  LOCUS_ASSERT(!m.progress.running, "restore_metrics during train()");
  // The sums are over every data-parallel rank: one rank of each stage carries them, so the
  // next reduction over the data-parallel ranks adds them once.
  const bool carrier = m.grid.dp().rank() == 0;
  m.progress.epoch = carrier ? p.epoch : MetricSums{};
  m.progress.interval = carrier ? p.interval : MetricSums{};
  m.progress.epoch_carried = p.epoch_time;
  m.progress.interval_carried = p.interval_time;
  m.progress.interval_steps_carried = p.interval_steps;
}

EvalMetrics Trainer::evaluate() {
  impl_->load_state();
  return impl_->evaluate();
}

}  // namespace locus::train
