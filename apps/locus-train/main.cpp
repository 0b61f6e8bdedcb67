// locus-train: data-parallel MLP training on a locus dataset, with per-epoch distributed
// evaluation, JSON-lines metrics, checkpoints (resume, exit 75 on a preemption signal) and a
// model file PyTorch can load.
#include <fmt/format.h>

#include <array>
#include <chrono>
#include <tuple>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/app.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/io/publish.hpp"
#include "locus/train/grid.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"
#include "locus/train/model/model_file.hpp"
#include "locus/train/checkpoint/preempt.hpp"
#include "locus/train/data/stage.hpp"
#include "locus/train/telemetry/telemetry.hpp"
#include "locus/train/trainer.hpp"
#include "locus/config.hpp"
#include "locus/io/json.hpp"
#include "progress.hpp"
#include "train_options.hpp"

namespace {

using namespace locus;

// Prints on world rank 0 (the Checkpointer calls it there only).
// Collective over comm: every rank's line, in rank order, on rank 0 (empty elsewhere).
std::vector<std::string> gather_lines(const mpi::Comm& comm, const std::string& line) {
  const int length = static_cast<int>(line.size());
  std::vector<int> lengths(static_cast<std::size_t>(comm.size()));
  LOCUS_MPI_CHECK(MPI_Gather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, 0, comm.get()));
  std::vector<int> offsets(lengths.size(), 0);
  for (std::size_t r = 1; r < lengths.size(); ++r) offsets[r] = offsets[r - 1] + lengths[r - 1];
  std::string all(comm.is_root() ? static_cast<std::size_t>(offsets.back() + lengths.back()) : 0,
                  '\0');
  LOCUS_MPI_CHECK(MPI_Gatherv(line.data(), length, MPI_CHAR, all.data(), lengths.data(),
                              offsets.data(), MPI_CHAR, 0, comm.get()));
  std::vector<std::string> out;
  if (!comm.is_root()) return out;
  for (std::size_t r = 0; r < lengths.size(); ++r) {
    out.push_back(all.substr(static_cast<std::size_t>(offsets[r]),
                             static_cast<std::size_t>(lengths[r])));
  }
  return out;
}

// The metrics file's "run" line (docs/FORMATS.md): where and how this run (a start, or a resume
// of a requeued job) trains, for the run report.
std::string run_line(const train::Trainer& t, const train::ResumeResult& resumed,
                     const train::telemetry::Telemetry& telemetry, const std::string& config,
                     const std::string& run_id, double lock_wait_s) {
  io::Json j;
  j["type"] = "run";
  j["step"] = resumed.resumed ? resumed.meta.step : 0;
  j["time"] = train::unix_seconds();
  j["lock_wait_s"] = std::round(lock_wait_s * 100.0) / 100.0;
  if (resumed.resumed) j["resumed_from"] = resumed.path;
  if (!run_id.empty()) j["run_id"] = run_id;
  j["world_size"] = t.grid().world().size();
  j["grid"] = t.grid().describe();
  j["host"] = mpi::hostname();
  if (!telemetry.hosts().empty()) j["hosts"] = telemetry.hosts();
  if (const char* e = std::getenv("SLURM_JOB_ID")) j["slurm_job"] = e;
  if (const char* e = std::getenv("SLURM_RESTART_COUNT")) j["slurm_restart_count"] = e;
  j["compute"] = t.compute_description();
  j["reducer"] = t.reducer_description();
  if (!t.link_description().empty()) j["stage_link"] = t.link_description();
  j["reduction"] = t.reduction_description();
  j["tool_version"] = LOCUS_VERSION;
  j["git_revision"] = LOCUS_GIT_REVISION;
  j["config"] = config;
  return io::dump_json(j);
}

void say(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

// Collective over the world, after the anomaly detector stopped training (a non-finite step,
// or train.anomaly = stop): the last good state -- the one before the step that stopped it --
// is checkpointed when its parameters are all finite (otherwise the newest checkpoint stays
// the last good one), no model file is written, and every rank exits 3.
int stop_on_anomaly(const train::Grid& grid, train::Trainer& trainer,
                    train::Checkpointer& checkpointer, const train::CheckpointOptions& ckpt,
                    const std::string& why) {
  const std::int64_t step = std::as_const(trainer).state().step;
  const bool finite = train::params_finite(grid, trainer.synced_state().model.params());
  std::string kept = "checkpoint.dir is empty: no checkpoint was kept";
  if (!ckpt.dir.empty()) {
    if (finite) checkpointer.save_now("anomaly");
    const train::LatestPointer latest = train::read_latest(ckpt.dir);
    const std::string newest =
        latest.present && !latest.file.empty() ? ckpt.dir + "/" + latest.file : "none";
    kept = finite ? fmt::format("the last good state (step {}) is checkpointed: {}", step, newest)
                  : fmt::format("the parameters after step {} are not finite and were not "
                                "saved; the newest checkpoint is {}", step, newest);
  }
  if (grid.world().is_root()) {
    std::fputs(fmt::format("error: {}\n  training stopped after step {}; {}; no model file "
                           "was written (exit {})\n  HINT: a run that diverged needs a lower "
                           "optim.lr or optim.clip_max_norm; train.anomaly = skip drops the "
                           "updates of such steps instead; then rerun with --resume=auto\n",
                           why, step, kept, exit_code::data)
                   .c_str(),
               stderr);
    std::fflush(stderr);
  }
  return exit_code::data;
}

int train_main(mpi::Comm& world, int argc, char** argv) {
  const auto t0 = std::chrono::steady_clock::now();
  app::Config config("locus-train",
                     "Trains an MLP on a locus dataset with data-parallel MPI ranks, evaluates "
                     "it on the test set every epoch, checkpoints it and writes a model file.");
  app::TrainSettings settings;
  settings.register_options(config);
  train::TrainOptions opts;
  train::CheckpointOptions ckpt;
  std::vector<std::string> args = app::resume_alias(argc, argv);
  std::vector<char*> argv2;
  for (auto& a : args) argv2.push_back(a.data());
  if (!app::parse_or_answer(config, world, static_cast<int>(argv2.size()), argv2.data(),
                            app::default_pipeline_config(), [&] {
                              opts = settings.to_options();
                              ckpt = settings.checkpoint_options();
                            })) {
    return exit_code::ok;
  }
  // From here on a rank that makes no progress for train.watchdog_s aborts the job.
  const comm::Watchdog watchdog(settings.watchdog_s, "train.watchdog_s");
  // A checkpoint the file system refused ends the job (exit 5) rather than risk HDF5's
  // collective close on a full disk (see WriteOptions::end_job_on_refused_write).
  ckpt.end_job_on_refused_write = true;
  // First: from here on a preemption signal is a request to checkpoint, not a kill.
  std::optional<train::PreemptSignals> signals;
  if (!ckpt.signals.empty()) signals.emplace(ckpt.signals);
  if (ckpt.dir.empty() && world.is_root()) {
    say("note: checkpoint.dir is empty: no checkpoints; SIGUSR1/SIGUSR2 are ignored");
  }
  if (world.is_root()) {
    for (const auto& n : train::unused_settings(opts)) say("note: " + n);
  }

  // A stage count that does not divide the ranks fails alike on every rank: agreed, exit 2.
  const train::Grid grid = [&] {
    std::optional<train::Grid> g;
    mpi::agree_on(world, [&] { g.emplace(world, opts.pipeline_stages); });
    return std::move(*g);
  }();
  // The directories of the model and metrics files are created (as the metrics file's always
  // was; a Prometheus file's must exist: node_exporter's textfile directory); a second job
  // writing any of the three files is then refused here, before it trains (an earlier instance
  // of this Slurm job is waited for). Held until the run ends.
  // The Prometheus file is rank 0's alone, in its node's node_exporter directory.
  using Writer = io::OutputLock::Writer;
  const std::array<std::tuple<std::string, const char*, Writer>, 3> outputs{
      {{settings.output, "train.output", Writer::every_rank},
       {settings.metrics, "train.metrics", Writer::every_rank},
       {settings.prometheus, "train.prometheus", Writer::rank_0}}};
  mpi::agree_on(grid.world(), [&] {
    std::vector<app::NamedPath> written;
    for (const auto& [path, key, writer] : outputs) written.push_back({path, key});
    app::refuse_shared_paths(written);
    if (!grid.world().is_root()) return;
    for (const auto& [path, key, writer] : {outputs[0], outputs[1]}) {
      const std::filesystem::path dir = std::filesystem::path(path).parent_path();
      std::error_code ec;
      if (!dir.empty()) std::filesystem::create_directories(dir, ec);
      if (ec) {
        throw IoError(fmt::format("cannot create the directory '{}' of {} = '{}': {}; choose "
                                  "another path or fix the permissions", dir.string(), key, path,
                                  ec.message()));
      }
    }
    if (!settings.prometheus.empty()) train::telemetry::check_prometheus_dir(settings.prometheus);
  });
  // How long taking the locks took (the metrics file's run line): mostly the wait for an
  // earlier instance of this Slurm job that still held them, milliseconds otherwise.
  using Clock = std::chrono::steady_clock;
  Clock::duration locking{};
  const auto timed = [&locking](auto&& take) {
    const auto began = Clock::now();
    take();
    locking += Clock::now() - began;
  };
  std::array<std::optional<io::OutputLock>, outputs.size()> locks;  // the model's first
  timed([&] {
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const auto& [path, key, writer] = outputs[i];
      if (!path.empty()) {
        locks[i].emplace(io::OutputLock::acquire(grid.world(), path, key, say, writer));
      }
    }
  });
  std::optional<train::Trainer> trainer(std::in_place, grid, opts);
  // The checkpoint directory's lock is taken here, with the dataset's identity (attributes).
  std::optional<train::Checkpointer> checkpointer;
  timed([&] {
    checkpointer.emplace(*trainer, ckpt, config.effective_ini(),
                         world.is_root() ? train::Checkpointer::Log(say)
                                         : train::Checkpointer::Log());
  });
  const train::ResumeResult resumed = checkpointer->resume(settings.ckpt_resume);
  // Collective: the ranks' host names; a Prometheus file that cannot be written is exit 5 here,
  // before the metrics file is touched.
  train::telemetry::Telemetry telemetry(
      grid.world(), {settings.telemetry, settings.prometheus, opts.compute.backend == "cuda"},
      nullptr);
  // After the resume: a resumed run keeps the metrics lines up to its checkpoint's step.
  train::JsonlMetrics metrics(grid.world(), settings.metrics,
                              resumed.resumed ? resumed.meta.step : -1);
  telemetry.attach(&metrics);
  metrics.write_record(run_line(*trainer, resumed, telemetry, config.effective_ini(),
                                checkpointer->run_id(),
                                std::chrono::duration<double>(locking).count()));
  app::Progress progress(world.is_root(), opts.epochs);
  train::ObserverList observers;
  observers.add(&metrics);
  observers.add(&telemetry);
  observers.add(&progress);
  progress.header(*trainer);
  if (opts.compute.backend != "cpu") {
    // Collective over world: which device every rank computes on, printed by rank 0.
    const std::vector<std::string> devices = gather_lines(world, trainer->compute_description());
    for (std::size_t r = 0; r < devices.size(); ++r) {
      say(fmt::format("  rank {}: {}", r, devices[r]));
    }
    say(fmt::format("  gradient all-reduce: {}", trainer->reducer_description()));
    if (!trainer->link_description().empty()) {
      say(fmt::format("  stage link: {}", trainer->link_description()));
    }
    if (opts.compute.graphs && (opts.pipeline_stages > 1 || opts.micro_batches > 1)) {
      // Not silently ignored: a stage's step waits on the stage link between its kernels.
      say("  CUDA graphs (train.graphs): whole-model steps only; pipeline stages and "
          "micro-batches launch their kernels eagerly");
    }
  }
  if (!telemetry.gpu_note().empty() && world.is_root()) say("  note: " + telemetry.gpu_note());
  if (world.is_root() && !trainer->stage_description().empty()) {
    say("  " + trainer->stage_description());
  }
  if (resumed.resumed && world.is_root()) {
    const train::CheckpointMeta& m = resumed.meta;
    say(fmt::format("resumed from {}: step {} of {} (epoch {}, {} samples into it)",
                    resumed.path, m.step, trainer->planned_steps(), m.epoch + 1,
                    m.samples_in_epoch));
    for (const auto& n : resumed.notes) say("  note: " + n);
  }
  const train::TrainSummary summary = trainer->train(&observers, -1, &*checkpointer);
  checkpointer->wait();
  if (!summary.anomaly_stop.empty()) {
    return stop_on_anomaly(grid, *trainer, *checkpointer, ckpt, summary.anomaly_stop);
  }
  const int signal = checkpointer->stopped_by_signal();
  // This rank's layers (a pipeline stage holds only its own): the stages write the model file
  // together, each its layers.
  const train::Mlp model = trainer->state().model;
  const std::int64_t steps = trainer->state().step;
  checkpointer.reset();
  // Collective: closes the datasets and stops the loaders' threads, so the model file is the
  // only HDF5 user left (HDF5 is not thread-safe, see loader.hpp).
  trainer.reset();
  if (signal != 0) {
    // The rank leaves with 75, not 143, whatever SIGTERM comes late (the batch script's).
    if (signals) signals->ignore_after();
    if (world.is_root()) {
      say(fmt::format("stopped by {} after step {}: exit {} (requeue me; rerun with "
                      "--resume=auto to continue)",
                      train::signal_name(signal), steps, exit_code::requeue));
      // Every rank exits 75 after MPI_Finalize; Open MPI 4.1's mpirun reports any non-zero
      // exit with a banner that reads like a crash. Say so right before it.
      say(fmt::format("note: exit {} is expected here; under mpirun, Open MPI's message that "
                      "follows (\"Primary job terminated normally, but 1 process returned a "
                      "non-zero exit code ... aborted\") reports this exit code, not a failure",
                      exit_code::requeue));
    }
    return exit_code::requeue;
  }

  // The run is complete: the staged copy (data.stage_dir) goes, unless data.stage_keep. A
  // preempted run (above) and one stopped by an anomaly keep it for the rerun.
  if (grid.stage() == 0 && train::remove_staged_copy(grid.dp(), opts.data) && world.is_root()) {
    say(fmt::format("  removed the staged copy of the training data from {}",
                    opts.data.stage_dir));
  }

  if (!settings.output.empty()) {
    train::ModelInfo info;
    info.spec = opts.model;
    info.loss = opts.loss;
    info.num_classes = opts.model.widths.back();
    info.trained_steps = steps;
    info.dataset = opts.data.path;
    info.config = config.effective_ini();
    comm::progress("writing the model file {} (collective)", settings.output);
    train::write_model_file(grid.world(), settings.output, model, info, &*locks[0]);
  }
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  progress.summary(opts, summary, settings.output, wall);
  return exit_code::ok;
}

}  // namespace

int main(int argc, char** argv) {
  // Every rank runs two threads (the trainer and the loader's producer), so a core is always
  // shared: a rank waiting for its peers in the gradient all-reduce must give the core to its
  // producer (and, on a shared node, to the peer it waits for) instead of spinning. Open MPI
  // then calls sched_yield() from its progress loop when idle -- a no-op when nothing else
  // wants the core. Set before MPI_Init (which reads it); an explicit setting wins.
  ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  // Beyond a file size limit (ulimit -f) a write must fail with EFBIG, reported as an IoError
  // naming the file, instead of killing the rank.
  std::signal(SIGXFSZ, SIG_IGN);
  // SIGUSR1/2 are preemption warnings (Slurm's --signal), fatal by default. Ignored outside
  // the training loop (and throughout when checkpoint.dir is empty: nothing to save), so a
  // warning that lands at start-up or after the model is written does not kill the job; the
  // scheduler still ends it with SIGTERM/SIGKILL (and, with PreemptMode=REQUEUE, requeues it).
  // While training, PreemptSignals turns them into a checkpoint and exit 75.
  std::signal(SIGUSR1, SIG_IGN);
  std::signal(SIGUSR2, SIG_IGN);
  // MPI_THREAD_MULTIPLE: the loader's producer thread reads (MPI-IO) while the main thread
  // all-reduces gradients.
  return locus::run_app(
      argc, argv, [&](locus::mpi::Comm& world) { return train_main(world, argc, argv); },
      MPI_THREAD_MULTIPLE);
}
