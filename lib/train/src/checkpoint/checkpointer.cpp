// The Checkpointer: triggers agreed at step boundaries (steps, rank 0's clock, epoch ends, a
// preemption signal on any rank, the end), synchronous or background saves (at most one in
// flight, on its own communicator), and resume (auto with fallback, a path, or a new run).
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <thread>
#include <utility>

#include "checkpoint/checkpointer_impl.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/config.hpp"
#include "locus/train/checkpoint/preempt.hpp"
#include "locus/train/optim/schedule.hpp"

namespace locus::train {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

}  // namespace

std::string new_run_id(const mpi::Comm& comm) {
  std::string id;
  if (comm.is_root()) {
    std::random_device rd;
    const std::uint64_t hi = rd(), lo = rd();
    const auto now = static_cast<std::uint64_t>(
        std::chrono::system_clock::now().time_since_epoch().count());
    id = detail::hex64(detail::fnv1a(fmt::format("{}:{}:{}", hi, lo, now)));
  }
  return comm.bcast(id);
}

void validate(const CheckpointOptions& o) {
  auto require = [](bool ok, const std::string& msg) {
    if (!ok) throw ConfigError(msg);
  };
  require(o.every_steps >= 0, fmt::format("checkpoint.every_steps = {} is invalid: use 0 (off) "
                                          "or a positive step count", o.every_steps));
  require(o.every_seconds >= 0, fmt::format("checkpoint.every_seconds = {} is invalid: use 0 "
                                            "(off) or a positive time", o.every_seconds));
  require(o.keep_last >= 0, fmt::format("checkpoint.keep_last = {} is invalid: use 0 (keep all) "
                                        "or a positive count", o.keep_last));
  require(o.save_timeout_s >= 0, fmt::format("checkpoint.save_timeout_s = {} is invalid: use 0 "
                                             "(no budget) or a positive time", o.save_timeout_s));
}

CheckpointMeta Checkpointer::Impl::meta_now() {
  const TrainState& st = trainer.synced_state();
  const TrainOptions& o = trainer.options();
  CheckpointMeta m;
  m.run_id = run_id;
  m.step = st.step;
  m.epoch = st.epoch;
  m.step_in_epoch = st.step_in_epoch;
  m.steps_per_epoch = trainer.steps_per_epoch();
  const std::int64_t batch = o.data.global_batch;
  const std::int64_t per_epoch =
      o.data.drop_last ? m.steps_per_epoch * batch : dataset.rows;
  m.samples_in_epoch = std::min(m.step_in_epoch * batch, per_epoch);
  m.samples_seen = m.epoch * per_epoch + m.samples_in_epoch;
  m.optimizer_steps = st.optimizer->steps();
  m.optimizer = to_string(o.optimizer.kind);
  m.schedule = to_string(o.schedule.kind);
  m.base_lr = o.schedule.base_lr;
  m.warmup_steps = o.schedule.warmup_steps;
  m.total_steps = o.schedule.total_steps;
  m.lr = learning_rate(o.schedule, st.step);
  m.global_batch = batch;
  m.shuffle = to_string(o.data.shuffle);
  m.loader_seed = static_cast<std::int64_t>(o.data.seed);
  m.drop_last = o.data.drop_last;
  m.dataset = dataset;
  m.config = config;
  m.config_hash = config_hash;
  m.world_size = trainer.grid().world().size();
  m.data_parallel = trainer.grid().data_parallel();
  m.pipeline_stages = trainer.grid().pipeline_stages();
  m.tool_version = LOCUS_VERSION;
  m.git_revision = LOCUS_GIT_REVISION;
  m.compute = compute_description;
  double now = static_cast<double>(std::chrono::duration_cast<std::chrono::milliseconds>(
                   std::chrono::system_clock::now().time_since_epoch()).count()) / 1000.0;
  comm.bcast(std::span<double>(&now, 1));  // attributes are written alike by every rank
  m.created = now;
  m.has_metrics = true;
  m.metrics = trainer.metrics_progress();
  m.has_anomaly = true;
  m.anomaly = trainer.anomaly_state();
  m.model = st.model.spec();
  m.loss = o.loss;
  m.num_classes = trainer.num_classes();
  return m;
}

CheckpointData Checkpointer::Impl::live_data(const CheckpointMeta& m) {
  // The const accessor: the mutable one marks the host state as newer than the device's, and
  // synced_state() would then never copy the device's again (stale checkpoints on a GPU).
  const TrainState& st = std::as_const(trainer).state();
  CheckpointData d;
  d.model = &st.model;
  for (const auto& s : std::as_const(*st.optimizer).state()) d.optimizer_state.push_back(s);
  d.meta = m;
  return d;
}

void Checkpointer::Impl::record(SaveResult r) {
  if (r.committed) {
    last_step = r.step;
    say(fmt::format("checkpoint step {} ({}): {} ({:.1f} MB in {:.2f} s{})", r.step, r.reason,
                    r.path, static_cast<double>(r.bytes) / 1e6, r.seconds,
                    r.snapshot_seconds > 0
                        ? fmt::format(", in the background after a {:.3f} s copy",
                                      r.snapshot_seconds)
                        : ""));
    for (const auto& f : r.removed) say(fmt::format("  removed old checkpoint file {}", f));
  } else {
    say(fmt::format("checkpoint step {} ({}) abandoned after {:.2f} s, over "
                    "checkpoint.save_timeout_s = {:g}: the previous checkpoint stays the latest",
                    r.step, r.reason, r.seconds, opts.save_timeout_s));
  }
  saves.push_back(std::move(r));
}

SaveResult Checkpointer::Impl::save_sync(const std::string& reason) {
  harvest();
  const CheckpointMeta m = meta_now();
  SaveResult r = save_checkpoint(comm, opts.dir, live_data(m), {opts.save_timeout_s, {}, opts.end_job_on_refused_write},
                                 {opts.keep_last, retire});
  if (r.committed) retire.clear();
  r.reason = reason;
  last_time = Clock::now();
  record(r);
  return r;
}

void Checkpointer::Impl::start_async(const std::string& reason) {
  harvest();
  const auto t0 = Clock::now();
  snapshot = std::make_unique<Snapshot>(trainer.synced_state(), meta_now());
  const double copy_s = seconds_since(t0);
  done = false;
  async_error = nullptr;
  last_step = std::as_const(trainer).state().step;
  last_time = Clock::now();
  worker = std::thread([this, reason, copy_s] {
    try {
      async_result = save_checkpoint(writer_comm, opts.dir, snapshot->data(),
                                     {opts.save_timeout_s, {}, opts.end_job_on_refused_write}, {opts.keep_last, retire});
      async_result.reason = reason;
      async_result.snapshot_seconds = copy_s;
    } catch (...) {
      async_error = std::current_exception();
    }
    done = true;
  });
}

void Checkpointer::Impl::harvest() {
  if (!in_flight()) return;
  worker.join();
  snapshot.reset();
  if (async_error) {
    last_step = -1;
    std::rethrow_exception(std::exchange(async_error, nullptr));
  }
  if (!async_result.committed) last_step = -1;
  if (async_result.committed) retire.clear();
  record(std::move(async_result));
}

std::array<int, 3> Checkpointer::Impl::agree_flags() {
  std::array<int, 3> f{PreemptSignals::pending(), 0, in_flight() && !done ? 1 : 0};
  if (comm.is_root() && opts.every_seconds > 0) {
    f[1] = seconds_since(last_time) >= opts.every_seconds ? 1 : 0;
  }
  comm.allreduce_inplace(std::span<int>(f), MPI_MAX);
  return f;
}

Checkpointer::Checkpointer(Trainer& trainer, CheckpointOptions options, std::string config,
                           Log log)
    : impl_(std::make_unique<Impl>(trainer, std::move(options), std::move(config),
                                   std::move(log))) {
  Impl& m = *impl_;
  mpi::agree_on(m.comm, [&] { validate(m.opts); });
  m.run_id = new_run_id(m.comm);
  // Before anything else touches the directory: one training job per checkpoint directory,
  // for the Checkpointer's lifetime (the lock also creates the directory).
  if (m.enabled()) {
    double wait_s = 0;
    mpi::agree_on(m.comm, [&] { wait_s = io::requeue_wait_s(); });
    lock_ = CheckpointDirLock::acquire(m.comm, m.opts.dir, m.run_id, {wait_s, m.opts.watchdog_s},
                                       [&m](const std::string& line) { m.say(line); });
    if (!lock_.warning().empty()) m.say(lock_.warning());
  }
  m.config_hash = detail::hex64(detail::fnv1a(m.config));
  m.compute_description = m.comm.bcast(trainer.compute_description());
  m.dataset = dataset_identity(m.comm, trainer.options().data.path);
}

Checkpointer::~Checkpointer() {
  if (impl_->in_flight()) impl_->worker.join();
}

bool Checkpointer::at_step_boundary(Trainer& trainer, const StepBoundary& b) {
  Impl& m = *impl_;
  LOCUS_ASSERT(&trainer == &m.trainer, "a Checkpointer serves the trainer it was built for");
  if (!m.enabled()) return false;
  lock_.set_run(m.run_id);  // the run a resume adopted
  test_hook("ckpt-step-boundary");
  const bool agree = !m.opts.signals.empty() || m.opts.every_seconds > 0 || m.in_flight();
  const std::array<int, 3> f = agree ? m.agree_flags() : std::array<int, 3>{0, 0, 0};
  if (m.in_flight() && f[2] == 0) m.harvest();  // finished on every rank: collect it
  const bool fresh = m.last_step == b.step;
  if (f[0] != 0) {
    m.stopped_signal = f[0];
    m.say(fmt::format("{} received: checkpointing step {} and stopping (exit 75 = requeue)",
                      signal_name(f[0]), b.step));
    m.harvest();
    if (m.last_step != b.step) m.save_sync("signal");
    return true;
  }
  const char* reason = nullptr;
  if (b.last && m.opts.at_end) reason = "end";
  else if (m.opts.every_steps > 0 && b.step % m.opts.every_steps == 0) reason = "steps";
  else if (f[1] != 0) reason = "seconds";
  else if (b.epoch_end && m.opts.at_epoch_end) reason = "epoch";
  if (reason == nullptr || fresh) return false;
  if (m.opts.async && !b.last) {
    m.start_async(reason);
    return false;
  }
  m.save_sync(reason);
  // A signal that arrived during the save: the checkpoint just written is current.
  if (!m.opts.signals.empty()) {
    const std::array<int, 3> g = m.agree_flags();
    if (g[0] != 0) {
      m.stopped_signal = g[0];
      m.say(fmt::format("{} received during the checkpoint of step {}: stopping (exit 75 = "
                        "requeue)", signal_name(g[0]), b.step));
      return true;
    }
  }
  return false;
}

std::optional<SaveResult> Checkpointer::save_now(const std::string& reason) {
  Impl& m = *impl_;
  LOCUS_ASSERT(m.enabled(), "save_now needs a checkpoint directory");
  m.harvest();
  if (m.last_step == std::as_const(m.trainer).state().step) return std::nullopt;
  return m.save_sync(reason);
}

void Checkpointer::wait() { impl_->harvest(); }

int Checkpointer::stopped_by_signal() const noexcept { return impl_->stopped_signal; }
const std::vector<SaveResult>& Checkpointer::saves() const noexcept { return impl_->saves; }
const std::string& Checkpointer::run_id() const noexcept { return impl_->run_id; }

}  // namespace locus::train
