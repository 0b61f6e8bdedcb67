// The trainer's construction (options and dataset checks agreed on every rank, then the
// state, backend and reducer), evaluation and accessors. The loop is in train_loop.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <thread>

#include "locus/comm/agree.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/file.hpp"
#include "locus/train/data/stage.hpp"
#include "locus/train/model/blas.hpp"
#include "trainer_impl.hpp"

namespace locus::train {

namespace {

void require(bool ok, const std::string& message) {
  if (!ok) throw ConfigError(message);
}

// Collective over grid.world(): the options are the same on every rank, but a throw must be
// marked agreed so the app exits cleanly on every rank.
TrainOptions checked(const Grid& grid, TrainOptions o) {
  mpi::agree_on(grid.world(), [&] {
    validate(o);
    require(o.pipeline_stages == grid.pipeline_stages(),
            fmt::format("train.pipeline_stages = {} but the process grid has {} stages: build "
                        "the Grid with the same value",
                        o.pipeline_stages, grid.pipeline_stages()));
    set_blas_threads(o.threads);
  });
  return o;
}

// loader.gather_threads: as set, or for 0 (auto) up to 4 copying threads per rank where a
// device computes (page-locked batches) and the node's cores are not all taken by its ranks;
// 1 on the cpu backend, whose BLAS threads keep the cores busy.
int gather_threads(int requested, bool device, int node_ranks) {
  if (requested > 0) return requested;
  if (!device) return 1;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores / std::max(node_ranks, 1), 1, 4);
}

LoaderOptions eval_loader_options(const TrainOptions& o) {
  LoaderOptions e = o.data;
  e.path = o.eval_path;
  e.global_batch = o.eval_batch;
  e.shuffle = Shuffle::none;
  e.drop_last = false;
  e.prefetch_depth = std::min(o.data.prefetch_depth, 2);
  e.stage_dir.clear();  // data.stage_dir stages the training set only
  return e;
}

// Collective over comm: the num_classes attribute of a dataset, or 0 if it has none (a
// plain HDF5 file with /features and /labels). Called before any Loader exists (loader.hpp:
// HDF5 calls on other threads would need hdf5_mutex()).
std::int64_t read_num_classes(const mpi::Comm& comm, const std::string& path) {
  h5::File file = h5::File::open(comm, path, h5::File::Mode::read);
  std::int64_t classes = 0;
  if (h5::has_attr(file.id(), "num_classes")) {
    classes = h5::read_attr<std::int64_t>(file.id(), "num_classes");
  }
  file.close();
  return classes;
}

// The model must fit the data: its input width is the feature count and, for labelled data,
// its output width the class count. `what` is "training" or "evaluation".
void check_fit(const TrainOptions& o, const Loader& loader, std::int64_t classes,
               const std::string& path, const char* what) {
  const auto& w = o.model.widths;
  if (loader.cols() != w.front()) {
    throw ConfigError(fmt::format(
        "model.widths = {} takes {} input features, but the {} set {} has {} features per "
        "sample: set the first width to {}",
        format_widths(w), w.front(), what, path, loader.cols(), loader.cols()));
  }
  if (!loader.has_labels()) {
    throw DataError(fmt::format("the {} set {} has no labels: locus-train needs labelled data "
                                "(cross_entropy on the labels, or mse on one-hot labels)",
                                what, path));
  }
  if (classes > 0 && classes != w.back()) {
    throw ConfigError(fmt::format(
        "model.widths = {} ends in {} outputs, but the {} set {} has {} classes (its "
        "num_classes attribute): set the last width to {}",
        format_widths(w), w.back(), what, path, classes, classes));
  }
}

}  // namespace

namespace {

// The layers this rank trains (options already checked): its stage's with pipeline stages,
// so its parameters and optimizer state are the stage's share; all of them otherwise.
LayerRange held_layers(const Grid& g, const TrainOptions& o) {
  const ParamLayout layout(o.model.widths);
  if (g.pipeline_stages() == 1) return layout.all_layers();
  return StagePartition(layout, g.pipeline_stages(), o.stage_boundaries).stage(g.stage()).held();
}

PipelineOptions pipeline_options(const TrainOptions& o) {
  PipelineOptions p;
  p.micro_batches = o.micro_batches;
  p.schedule = o.pipeline_schedule;
  p.stage_boundaries = o.stage_boundaries;
  p.reducer = o.reducer;
  p.link = o.stage_link;
  return p;
}

}  // namespace

void validate(const TrainOptions& o) {
  require(!o.device_gather || o.device_cache_bytes == 0,
          fmt::format("loader.gather = device reads the samples from host memory, "
                      "loader.device_cache_mb = {} copies them to the GPU: choose one (the "
                      "cache where the samples fit in GPU memory)",
                      o.device_cache_bytes >> 20));
  validate(o.compute);
  require(o.stage_link.backend != comm::LinkBackend::nccl || o.compute.backend == "cuda",
          fmt::format("train.stage_link = nccl moves GPU buffers between pipeline stages, but "
                      "train.backend = {} keeps them in host memory: set train.stage_link = "
                      "auto or mpi, or train.backend = cuda",
                      o.compute.backend));
  // A test's factory-built backend refuses what it lacks itself (Compute::cache_dataset and
  // map_dataset throw the ConfigError by default).
  const bool device = o.compute.backend == "cuda" || o.compute.factory != nullptr;
  require(!o.device_gather || device,
          fmt::format("loader.gather = device gathers batches on the GPU, but train.backend = "
                      "{}: set loader.gather = host, or train.backend = cuda",
                      o.compute.backend));
  require(o.device_cache_bytes == 0 || device,
          fmt::format("loader.device_cache_mb = {} keeps the training set in GPU memory, but "
                      "train.backend = {}: set train.backend = cuda, or loader.device_cache_mb "
                      "= 0",
                      o.device_cache_bytes >> 20, o.compute.backend));
  validate(o.model);
  validate(o.optimizer);
  validate(o.anomaly);
  validate(o.straggler);
  require(o.pipeline_stages >= 1,
          fmt::format("train.pipeline_stages = {} is invalid: use 1 (pure data parallelism) or "
                      "more",
                      o.pipeline_stages));
  validate(pipeline_options(o));
  // The cut must exist (stages <= layers, valid boundaries) before any rank builds one.
  StagePartition(ParamLayout(o.model.widths), o.pipeline_stages, o.stage_boundaries);
  require(o.epochs >= 1, fmt::format("train.epochs = {} is invalid: use 1 or more", o.epochs));
  require(o.max_steps >= 0,
          fmt::format("train.max_steps = {} is invalid: use 0 (no limit) or more", o.max_steps));
  require(o.data.global_batch >= 1,
          fmt::format("train.batch = {} is invalid: use 1 or more", o.data.global_batch));
  require(!o.data.path.empty(), "data.train is empty: give the training dataset's path");
  require(o.eval_batch >= 1,
          fmt::format("eval.batch = {} is invalid: use 1 or more", o.eval_batch));
  require(o.eval_every >= 0,
          fmt::format("eval.every = {} is invalid: use 0 (only at the end) or more",
                      o.eval_every));
  require(o.log_every >= 0,
          fmt::format("train.log_every = {} is invalid: use 0 (epoch ends only) or more",
                      o.log_every));
  require(o.clip_max_norm >= 0.0,
          fmt::format("optim.clip_max_norm = {} is invalid: use 0 (no clipping) or a positive "
                      "norm",
                      o.clip_max_norm));
  require(o.threads >= 1,
          fmt::format("train.threads = {} is invalid: use 1 or more BLAS threads per rank",
                      o.threads));
  ScheduleOptions s = o.schedule;
  if (s.kind == ScheduleKind::cosine && s.total_steps == 0) s.total_steps = s.warmup_steps + 1;
  validate(s);
}

std::vector<std::string> unused_settings(const TrainOptions& o) {
  std::vector<std::string> notes;
  if (o.compute.backend == "cuda") {
    // The host's BLAS serves the cpu backend only (and locus-infer's cpu engine): the cuda
    // backend's layers, whole-model or a pipeline stage's, are cuBLASLt and kernels.
    if (o.threads != TrainOptions{}.threads) {
      notes.push_back(fmt::format("train.threads = {} sets the host BLAS's threads, which "
                                  "train.backend = cuda does not use: it computes on the GPU",
                                  o.threads));
    }
    return notes;
  }
  const ComputeOptions defaults;  // the cpu backend: validate() admits no other
  const auto unused = [&](const std::string& setting, std::string_view more = {}) {
    notes.push_back(fmt::format("{} applies to train.backend = cuda only: the cpu backend "
                                "ignores it{}",
                                setting, more));
  };
  if (o.compute.graphs != defaults.graphs) {
    unused(fmt::format("train.graphs = {}", o.compute.graphs));
  }
  if (o.compute.measure_gemms != defaults.measure_gemms) {
    unused(fmt::format("train.gemm_select = {}",
                       o.compute.measure_gemms ? "measure" : "heuristic"));
  }
  // The cpu backend's gradients and activations go through MPI, where a stuck peer is the
  // watchdog's (train.watchdog_s).
  if (o.reducer.timeout_s != comm::ReducerOptions{}.timeout_s) {
    unused(fmt::format("train.reducer_timeout_s = {}", o.reducer.timeout_s),
           " (train.watchdog_s bounds its MPI waits)");
  }
  return notes;
}

Trainer::Impl::Impl(const Grid& g, TrainOptions options)
    : grid(g),
      opts(checked(g, std::move(options))),
      classes(read_num_classes(g.dp(), opts.data.path)),
      eval_classes(opts.eval_path.empty() ? 0 : read_num_classes(g.dp(), opts.eval_path)),
      pipelined(opts.pipeline_stages > 1 || opts.micro_batches > 1),
      feeds(!pipelined || g.stage() == 0),
      has_eval(!opts.eval_path.empty()),
      state(opts.model, opts.optimizer, held_layers(g, opts)) {
  if (opts.anomaly.enabled) monitors.anomaly.emplace(opts.anomaly);
  // Without pipeline stages the backend comes first: the loaders put their batches where it
  // copies them fastest (page-locked memory for a GPU), and with the device cache the
  // training loader hands over row indices instead of features.
  if (!pipelined) {
    mpi::agree_on(g.world(),
                  [&] { compute = make_compute(opts.compute, g.world(), state, opts.loss); });
  }
  // Loaders only where data enters (stage 0 of each replica); a loader's errors are agreed
  // over its dp communicator, so they are re-agreed over the world for the other stages.
  mpi::agree_on(g.world(), [&] {
    if (!feeds) return;
    LoaderOptions train_data = opts.data;
    LoaderOptions eval_data = eval_loader_options(opts);
    if (compute) {
      train_data.host_memory = eval_data.host_memory = compute->host_memory();
      train_data.gather_features = opts.device_cache_bytes == 0 && !opts.device_gather;
    }
    // A device backend's loop thread launches the device's work: its loaders' producers pace
    // themselves instead of being woken by it.
    train_data.paced_producer = eval_data.paced_producer = train_data.host_memory != nullptr;
    train_data.gather_threads = eval_data.gather_threads =
        gather_threads(opts.data.gather_threads, train_data.host_memory != nullptr,
                       g.node_ranks());
    loader = std::make_unique<Loader>(g.dp(), train_data);
    // A device backend's batches (page-locked) go in ahead of their step; mse targets are built
    // on the host per batch (batch_of): those are not.
    prefetch = train_data.host_memory != nullptr && opts.loss != Loss::mse;
    if (has_eval) eval_loader = std::make_unique<Loader>(g.dp(), eval_data);
  });
  std::int64_t counts[3] = {feeds ? loader->steps_per_epoch() : 0,
                            eval_loader ? eval_loader->steps_per_epoch() : 0,
                            feeds ? loader->rows() : 0};
  if (pipelined && g.pipeline_stages() > 1) g.pp().bcast(std::span<std::int64_t>(counts), 0);
  steps_per_epoch = counts[0];
  eval_steps = counts[1];
  mpi::agree_on(g.world(), [&] {
    if (feeds) {
      check_fit(opts, *loader, classes, opts.data.path, "training");
      if (eval_loader) check_fit(opts, *eval_loader, eval_classes, opts.eval_path, "evaluation");
    }
    require(steps_per_epoch >= 1,
            fmt::format("the training set {} has {} rows, less than one batch of train.batch = "
                        "{} with loader.drop_last = true: lower the batch or keep the last "
                        "partial batch",
                        opts.data.path, counts[2], opts.data.global_batch));
    planned_steps = opts.epochs * steps_per_epoch;
    if (opts.max_steps > 0) planned_steps = std::min(planned_steps, opts.max_steps);
    if (opts.schedule.total_steps == 0) opts.schedule.total_steps = planned_steps;
    if (opts.schedule.kind == ScheduleKind::cosine) {
      require(opts.schedule.total_steps > opts.schedule.warmup_steps,
              fmt::format("optim.warmup_steps = {} leaves nothing of the cosine schedule over "
                          "the {} steps of this run ({} epochs x {} steps): lower the warm-up",
                          opts.schedule.warmup_steps, opts.schedule.total_steps, opts.epochs,
                          steps_per_epoch));
    }
    validate(opts.schedule);
  });
  if (pipelined) {
    // The stages compute on the backend's layer operations; the device cache feeds whole-model
    // steps only (stage 0 would need its own): say so rather than ignore it.
    mpi::agree_on(g.world(), [&] {
      require(!opts.device_gather,
              fmt::format("loader.gather = device with train.pipeline_stages = {} and "
                          "train.micro_batches = {}: the device gathers batches for whole-model "
                          "steps only in this version; set loader.gather = host, or "
                          "pipeline_stages = micro_batches = 1",
                          opts.pipeline_stages, opts.micro_batches));
      require(opts.device_cache_bytes == 0,
              fmt::format("loader.device_cache_mb = {} with train.pipeline_stages = {} and "
                          "train.micro_batches = {}: the device cache serves whole-model steps "
                          "only in this version; set loader.device_cache_mb = 0 (batches are "
                          "then copied to the device per micro-batch), or pipeline_stages = "
                          "micro_batches = 1",
                          opts.device_cache_bytes >> 20, opts.pipeline_stages,
                          opts.micro_batches));
    });
    auto p = std::make_unique<PipelineCompute>(g, state, opts.loss, pipeline_options(opts),
                                               opts.compute);
    pipeline = p.get();
    compute = std::move(p);
    return;
  }
  if (opts.device_cache_bytes > 0) mpi::agree_on(g.world(), [&] { cache_on_device(); });
  if (opts.device_gather) {
    mpi::agree_on(g.world(), [&] {
      const ResidentData r = loader->resident();
      compute->map_dataset(r.x, r.rows, r.cols);
    });
  }
  comm::ReducerOptions ro = opts.reducer;
  // Each rank's loss already divides by the GLOBAL batch (loss.hpp), so the plain sum over
  // ranks is the gradient of the global-batch mean: no division pass.
  ro.mode = comm::ReduceMode::presummed_average;
  reducer = detail::make_reducer(compute->grads(), g.dp(), ro, &reducer_note);
  on_grads_ready = [this](int l) { reducer->ready_from(state.model.layout().layer(l).begin()); };
  compute->before_host_waits([this](void*) { settle(); });
  // warn never drops an update: on a deferring backend it may be enqueued before the verdict.
  monitors.deferred = monitors.anomaly && opts.anomaly.action == AnomalyAction::warn &&
                      compute->defers_step_values();
  compute->gate_updates(monitors.deferred);
}

// loader.device_cache_mb: the training loader's resident block (this rank's partition, or the
// whole set under global shuffle) goes to the device once, if it fits the budget.
void Trainer::Impl::cache_on_device() {
  const ResidentData r = loader->resident();
  const int value_bytes = compute->sample_value_bytes();
  const std::uint64_t bytes = r.x.size() * static_cast<std::uint64_t>(value_bytes);
  require(bytes <= opts.device_cache_bytes,
          fmt::format("loader.device_cache_mb = {} is less than the {:.1f} MiB of training "
                      "samples this rank holds ({} rows x {} features of {} bytes, from {}, "
                      "shuffle {}): raise loader.device_cache_mb, or set it to 0 to stream "
                      "batches",
                      opts.device_cache_bytes >> 20, static_cast<double>(bytes) / (1 << 20),
                      r.rows, r.cols, value_bytes, opts.data.path,
                      to_string(opts.data.shuffle)));
  compute->cache_dataset(r.x, r.rows, r.cols);
}

const comm::ReducerStats& Trainer::Impl::reduce_stats() const {
  return pipeline != nullptr ? pipeline->stage().reducer().stats() : reducer->stats();
}

void Trainer::Impl::load_state() {
  if (!host_dirty) return;
  compute->sync_from_host();
  host_dirty = false;
}

const LoadedBatch* Trainer::Impl::next_batch() {
  if (loader) return loader->next();
  idle = LoadedBatch{};
  idle.epoch = state.epoch;
  idle.step = state.step_in_epoch;
  return &idle;
}

detail::Sums Trainer::Impl::reduce(detail::Sums local) const {
  std::int64_t counts[2] = {local.correct, local.rows};
  grid.dp().allreduce_inplace(std::span<std::int64_t>(counts), MPI_SUM);
  return {local.loss.allreduce(grid.dp()), counts[0], counts[1]};
}

Batch Trainer::Impl::batch_of(const LoadedBatch& b) {
  Batch batch{b.x, b.rows, b.y, {}, b.sample_ids, b.x.empty() ? b.resident_rows
                                                               : std::span<const std::int64_t>()};
  if (opts.loss == Loss::mse) {
    const int width = state.model.layout().output_width();
    targets.assign(static_cast<std::size_t>(b.rows) * static_cast<std::size_t>(width), 0.0f);
    for (int r = 0; r < b.rows; ++r) {
      const std::int32_t label = b.y[static_cast<std::size_t>(r)];
      if (label < 0 || label >= width) {
        throw DataError(fmt::format("label {} of sample {} is outside [0, {}): the dataset's "
                                    "labels must match the model's output width",
                                    label, b.sample_ids[static_cast<std::size_t>(r)], width));
      }
      targets[static_cast<std::size_t>(r) * static_cast<std::size_t>(width) +
              static_cast<std::size_t>(label)] = 1.0f;
    }
    batch.targets = targets;
  }
  return batch;
}

EvalMetrics Trainer::Impl::evaluate() {
  if (!has_eval) {
    throw ConfigError("evaluation needs an evaluation set: set data.test");
  }
  const auto t0 = detail::Clock::now();
  detail::Sums local;
  settle();  // a device backend's evaluation waits for its stream, after the last all-reduce
  if (eval_loader) {
    eval_loader->start_epoch(0);
    for (std::int64_t n = 1;; ++n) {
      comm::progress("evaluation batch {}", n);
      const LoadedBatch* b = eval_loader->next();
      if (b == nullptr) break;
      detail::add(local, compute->evaluate(batch_of(*b)));
    }
  } else {  // a pipeline stage after the first: stage 0 sends what it needs
    for (std::int64_t i = 0; i < eval_steps; ++i) {
      comm::progress("evaluation batch {}", i + 1);
      detail::add(local, compute->evaluate(Batch{}));
    }
  }
  const detail::Sums all = reduce(local);
  EvalMetrics e;
  const auto rows = static_cast<double>(all.rows);
  e.rows = all.rows;
  e.loss = all.rows > 0 ? all.loss.value() / rows : 0.0;
  e.accuracy = all.rows > 0 ? static_cast<double>(all.correct) / rows : 0.0;
  e.seconds = std::chrono::duration<double>(detail::Clock::now() - t0).count();
  return e;
}

Trainer::Trainer(const Grid& grid, TrainOptions options)
    : impl_(std::make_unique<Impl>(grid, std::move(options))) {}
Trainer::~Trainer() = default;

TrainState& Trainer::state() noexcept {
  impl_->host_dirty = true;  // the caller may write it: the backend reloads it before use
  return impl_->state;
}
const TrainState& Trainer::state() const noexcept { return impl_->state; }
const TrainState& Trainer::synced_state() {
  // A state written since the backend last loaded it is newer than the backend's copy. The
  // copy waits for the last step's all-reduce: the reducer watches its peers meanwhile.
  if (!impl_->host_dirty) {
    impl_->settle();
    impl_->compute->sync_to_host();
  }
  return impl_->state;
}
const TrainOptions& Trainer::options() const noexcept { return impl_->opts; }
std::string Trainer::compute_description() const { return impl_->compute->describe(); }

std::string Trainer::stage_description() const {
  const Impl& m = *impl_;
  return m.loader ? m.loader->stage_report().describe() : std::string();
}

std::string Trainer::reducer_description() const {
  const Impl& m = *impl_;
  if (m.pipeline != nullptr) return std::string(m.pipeline->stage().reducer().name());
  std::string text(m.reducer->name());
  if (text == "nccl") text += " (" + comm::nccl_version() + ")";
  if (!m.reducer_note.empty()) text += " (train.reducer = auto: not NCCL, as " + m.reducer_note + ")";
  return text;
}
std::string Trainer::link_description() const {
  const Impl& m = *impl_;
  return m.pipeline != nullptr ? m.pipeline->stage().link_description() : std::string();
}
std::string Trainer::reduction_description() const {
  const Impl& m = *impl_;
  if (m.pipeline != nullptr) return m.pipeline->stage().reducer().reduction();
  return m.reducer->reduction();
}
std::string Trainer::data_description() const {
  const Impl& m = *impl_;
  if (m.loader == nullptr) return "read by the replica's first pipeline stage";
  const ResidentData r = m.loader->resident();
  const auto size = [](std::uint64_t bytes) {
    return bytes < (1 << 20) ? fmt::format("{:.1f} KiB", static_cast<double>(bytes) / 1024)
                             : fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
  };
  std::string text;
  switch (m.loader->residency()) {
    case Residency::partition:
      text = fmt::format("this rank's partition in memory ({} rows, {})", r.rows,
                         size(r.x.size_bytes()));
      break;
    case Residency::dataset:
      text = fmt::format("the whole set in memory on every rank ({} rows, {})", r.rows,
                         size(r.x.size_bytes()));
      break;
    case Residency::streamed:
      text = fmt::format("this rank's partition read from the file in windows (larger than "
                         "loader.memory_budget_mb = {})", m.opts.data.memory_budget >> 20);
      break;
    case Residency::per_batch:
      text = fmt::format("each batch read from the file (the set is larger than "
                         "loader.memory_budget_mb = {})", m.opts.data.memory_budget >> 20);
      break;
  }
  if (m.opts.compute.backend == "cpu" || m.compute == nullptr) return text;
  // What the backend holds, from its buffers: a path it fell back from shows here.
  const Compute::HeldSamples held = m.compute->held_samples();
  if (!held.where.empty()) {
    return text + "; " + held.where +
           (held.bytes > 0 ? fmt::format(" ({})", size(held.bytes)) : std::string()) +
           (held.why.empty() ? std::string() : ": " + held.why);
  }
  if ((m.opts.device_cache_bytes > 0 || m.opts.device_gather) && r.rows == 0) {
    return text + "; no rows on this rank for the GPU to gather";
  }
  return text + "; copied to the GPU as page-locked batches";
}
const Grid& Trainer::grid() const noexcept { return impl_->grid; }
std::int64_t Trainer::steps_per_epoch() const noexcept { return impl_->steps_per_epoch; }
std::int64_t Trainer::planned_steps() const noexcept { return impl_->planned_steps; }
std::int64_t Trainer::num_classes() const noexcept { return impl_->classes; }
const StagePartition* Trainer::partition() const noexcept {
  return impl_->pipeline != nullptr ? &impl_->pipeline->stage().partition() : nullptr;
}

}  // namespace locus::train
