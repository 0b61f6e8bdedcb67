// Option registration for locus-train: every key with its help text, type, default and range;
// the mapping onto train::TrainOptions.
#include "train_options.hpp"

#include <fmt/format.h>

#include "locus/comm/error.hpp"
#include "locus/train/checkpoint/preempt.hpp"

namespace locus::app {

namespace {

// Accepts the widths train::parse_widths accepts; returns its complaint otherwise.
std::string check_widths(const std::string& text) {
  try {
    train::ModelSpec spec;
    spec.widths = train::parse_widths(text);
    train::validate(spec);
    return "";
  } catch (const ConfigError& e) {
    return e.what();
  }
}

}  // namespace

void TrainSettings::register_options(Config& c) {
  c.add("data.train", train_path,
        "training dataset (locus-ingest output, or any HDF5 file with float [N, D] /features: "
        "docs/FORMATS.md)");
  c.add("data.test", test_path, "evaluation dataset, scored after every eval.every epochs "
                                "(empty: no evaluation)");
  c.add("data.stage_dir", stage_dir,
        "node-local directory (SSD, /dev/shm) each node copies its ranks' training rows into "
        "before the first step, reused by a requeued run when its checksum matches, removed at "
        "the end (empty: read data.train directly)");
  c.add("data.stage_keep", stage_keep, "keep the staged copy after a successful run");
  c.add("model.widths", widths, "layer widths: input features, hidden..., classes",
        check_widths);
  c.add_choice("model.activation", activation, {"relu", "gelu", "tanh"},
               "hidden-layer activation (gelu: tanh approximation)");
  c.add_choice("model.init", init, {"he", "xavier"}, "weight initialisation (biases start at 0)");
  c.add("model.dropout", dropout, "drop probability of hidden units in training",
        in_range(0.0, 0.99));
  c.add("model.seed", model_seed, "seed of the initial weights and the dropout masks",
        at_least(0));
  c.add_choice("optim.optimizer", optimizer, {"sgd", "adam", "adamw"},
               "optimizer (PyTorch semantics)");
  c.add("optim.lr", lr, "base learning rate", positive());
  c.add("optim.momentum", momentum, "sgd momentum", in_range(0.0, 0.999999));
  c.add("optim.nesterov", nesterov, "sgd Nesterov momentum (needs momentum > 0, dampening 0)");
  c.add("optim.dampening", dampening, "sgd momentum dampening", in_range(0.0, 1.0));
  c.add("optim.weight_decay", weight_decay,
        "weight decay (sgd/adam: L2 added to the gradient; adamw: decoupled)", non_negative());
  c.add("optim.beta1", beta1, "adam/adamw first-moment decay", in_range(0.0, 0.999999));
  c.add("optim.beta2", beta2, "adam/adamw second-moment decay", in_range(0.0, 0.999999));
  c.add("optim.eps", eps, "adam/adamw denominator epsilon", non_negative());
  c.add_choice("optim.schedule", schedule, {"constant", "step", "cosine"},
               "learning-rate schedule after the warm-up");
  c.add("optim.warmup_steps", warmup_steps, "linear warm-up steps (0: none)", at_least(0));
  c.add("optim.step_size", step_size, "step schedule: steps between decays", at_least(1));
  c.add("optim.gamma", gamma, "step schedule: decay factor", positive());
  c.add("optim.min_lr", min_lr, "cosine schedule: final learning rate", non_negative());
  c.add("optim.clip_max_norm", clip_max_norm,
        "clip the gradient's global L2 norm to this (0: no clipping)", non_negative());
  c.add_choice("train.loss", loss, {"cross_entropy", "mse"},
               "loss (mse: squared error against one-hot labels)");
  c.add("train.epochs", epochs, "passes over the training set", at_least(1));
  c.add("train.max_steps", max_steps, "stop after this many steps (0: after the epochs)",
        at_least(0));
  c.add("train.batch", batch, "global batch: samples per step over all data-parallel ranks",
        in_range(std::int64_t{1}, std::int64_t{1} << 24));
  c.add("train.threads", threads,
        "BLAS threads per rank (the cpu backend's; the cuda backend computes on the GPU)",
        in_range(std::int64_t{1}, 256));
  c.add_choice("train.backend", backend, {"cpu", "cuda"},
               "compute backend (cpu: OpenBLAS; cuda: one GPU per rank, cuBLASLt and fused "
               "kernels, in builds with CUDA)");
  c.add_choice("train.precision", precision, {"fp32", "tf32", "bf16"},
               "matrix-product arithmetic on the GPU (fp32: as the CPU; tf32: tensor cores "
               "with 10-bit mantissas; bf16: bf16 operands, fp32 accumulation and master "
               "weights); the cpu backend takes fp32 only");
  c.add("train.device", device,
        "cuda: the GPU of this rank (-1: the node-local rank modulo the visible devices; "
        "another value is refused on the cpu backend)",
        in_range(std::int64_t{-1}, std::int64_t{1023}));
  c.add("train.graphs", graphs,
        "cuda: capture each whole-model step shape once into a CUDA graph and replay it "
        "(false: launch kernel by kernel; pipeline stages and micro-batches always launch "
        "kernel by kernel)");
  c.add_choice("train.gemm_select", gemm_select, {"measure", "heuristic"},
               "cuda: each GEMM shape's cuBLASLt algorithm (measure: the heuristic's first "
               "unless timing its candidates once shows it over 2.5x and 20 us slower than the "
               "fastest; heuristic: its first, never timed)");
  c.add("train.pipeline_stages", pipeline_stages,
        "pipeline stages: the layers are cut into this many stages on consecutive ranks, "
        "inside one node where the stage count divides every node's ranks; ranks = "
        "data-parallel x stages (the stage count must divide the ranks)",
        at_least(1));
  c.add("train.micro_batches", micro_batches,
        "micro-batches per step and replica: activations flow between stages one micro-batch "
        "at a time (with 1 stage: gradient accumulation)",
        in_range(std::int64_t{1}, std::int64_t{1} << 20));
  c.add_choice("train.schedule", pipeline_schedule, {"1f1b", "gpipe"},
               "pipeline schedule: 1f1b (at most `stages` micro-batches of activations per "
               "stage) or gpipe (all forwards, then all backwards)");
  c.add("train.stage_boundaries", stage_boundaries,
        "first layer of stages 1..S-1, e.g. 2,5 (empty: balanced by FLOPs and parameter bytes)",
        [](const std::string& v) {
          try {
            train::parse_stage_boundaries(v);
            return std::string();
          } catch (const ConfigError& e) {
            return std::string(e.what());
          }
        });
  c.add("train.bucket_kb", bucket_kb,
        "gradient all-reduce bucket (KiB), cut from the last layer: smaller ones start during "
        "backward (a gain only where the transport progresses on its own, e.g. RDMA)",
        in_range(std::int64_t{1}, std::int64_t{1} << 20));
  c.add_choice("train.reducer", reducer, {"auto", "mpi", "nccl"},
               "gradient all-reduce over the data-parallel ranks (auto: NCCL for GPU gradients "
               "where every rank has a GPU of its own, else MPI, host-staged for GPU "
               "gradients; nccl: an error where NCCL cannot run; cpu backend: MPI)");
  c.add_choice("train.reducer_precision", reducer_precision, {"fp32", "bf16"},
               "what the NCCL reducer sums in: fp32 (the gradients' own) or bf16 (each rank's "
               "gradients rounded to bf16, summed in bf16, widened back: half the bytes "
               "between the GPUs, 8 significant bits in the sum; the optimizer stays fp32). "
               "bf16 is refused where the MPI reducer sums (cpu backend, host-staged GPU "
               "gradients)");
  c.add_choice("train.reduction", reduction, {"auto", "flat", "hierarchical"},
               "MPI reducer: flat (every rank with every rank) or hierarchical (reduce to one "
               "leader per node, leaders in node order, broadcast back; bitwise equal to flat "
               "where nodes are consecutive ranks); auto: hierarchical when the ranks span "
               "several nodes and a node has more than one, else flat. nccl: auto only "
               "(NCCL's own topology-aware algorithms)");
  c.add_choice("train.stage_link", stage_link, {"auto", "mpi", "nccl"},
               "how pipeline stages pass activations and their gradients (auto: NCCL send/recv "
               "between GPU stages where every rank of the pipeline has a GPU of its own, else "
               "MPI, host-staged for GPU buffers; nccl: an error where NCCL cannot run; cpu "
               "backend: MPI)");
  c.add("train.reducer_timeout_s", reducer_timeout_s,
        "nccl: seconds a rank waits for a gradient all-reduce or a step's pipeline transfers "
        "before it aborts the job naming them (0: forever; time stopped by SIGSTOP does not "
        "count)",
        in_range(0.0, 1e9));
  add_watchdog_option(c, "train.watchdog_s", watchdog_s);
  c.add("train.log_every", log_every, "steps per metrics line (0: epoch ends only)",
        at_least(0));
  c.add_choice("train.anomaly", anomaly, {"warn", "skip", "stop"},
               "a step whose loss or gradient-norm z-score exceeds anomaly_z: warn (report it, "
               "apply the update), skip (report it, drop the update, agreed on every rank) or "
               "stop (checkpoint the last good state, exit 3). A non-finite loss or gradient "
               "always stops (exit 3), except under skip");
  c.add("train.anomaly_z", anomaly_z,
        "z-score over the last anomaly_window steps above which a step's loss or gradient "
        "norm is an anomaly", in_range(0.1, 1e6));
  c.add("train.anomaly_window", anomaly_window,
        "steps of loss and gradient-norm history behind the z-scores (none before it is full)",
        in_range(std::int64_t{2}, std::int64_t{100000}));
  c.add("train.straggler_pct", straggler_pct,
        "a rank whose median compute per step (or mean data wait) exceeds the other ranks' "
        "median of it (ranks of the same pipeline stage) by this many percent of their median "
        "compute, by straggler_k standard deviations of theirs and by 1 ms, for "
        "straggler_intervals log intervals is a straggler (0: no straggler detection, no ranks "
        "lines)",
        in_range(0.0, 1e6));
  c.add("train.straggler_k", straggler_k,
        "straggler: also this many standard deviations of the other ranks' values above their "
        "median", in_range(0.0, 1e6));
  c.add("train.straggler_intervals", straggler_intervals,
        "straggler: consecutive log intervals before a rank is reported slow, or recovered",
        in_range(std::int64_t{1}, std::int64_t{1000000}));
  c.add("train.output", output, "model file to write (empty: none)");
  c.add("train.metrics", metrics, "metrics as JSON lines (empty: none)");
  c.add("train.telemetry", telemetry,
        "every log interval, each rank's RSS, CPU time, page faults, storage I/O and (cuda "
        "backend, through NVML) GPU utilization, memory, power, temperature and clocks, "
        "gathered into a telemetry line of the metrics file and the Prometheus file (one "
        "MPI_Gather per interval; false: none of it)");
  c.add("train.prometheus", prometheus,
        "Prometheus text file rank 0 rewrites (temporary file + rename) every log interval: "
        "step, loss, throughput, data wait and the telemetry, for node_exporter's textfile "
        "collector (empty: none), one .prom name per job (the name without .prom labels every "
        "series locus_job); its directory must exist, and the job holds the file's output "
        "lock: a second job naming it is refused");
  c.add_choice("loader.shuffle", shuffle, {"global", "local"},
               "global: one permutation of the whole set per epoch (any rank count sees the "
               "same batches); local: each rank shuffles its own partition (no data moves)");
  c.add("loader.seed", loader_seed, "seed of the shuffling", at_least(0));
  c.add("loader.prefetch", prefetch, "batches the loader prepares ahead",
        in_range(std::int64_t{1}, 1024));
  c.add("loader.memory_budget_mb", memory_budget_mb, "MiB of samples a rank may keep in memory",
        in_range(std::int64_t{1}, std::int64_t{1} << 30));
  c.add("loader.drop_last", drop_last, "drop each epoch's last partial batch");
  c.add("loader.gather_threads", gather_threads,
        "threads that copy the rows of a batch of at least 1 MiB held in memory (0: up to 4 "
        "per rank on the cuda backend, as the node's cores allow; 1 on cpu)",
        in_range(std::int64_t{0}, 64));
  c.add("loader.device_cache_mb", device_cache_mb,
        "cuda: MiB of GPU memory for this rank's training samples (its partition under local "
        "shuffle, the whole set under global; 4 bytes a feature, 2 at precision bf16); they "
        "are copied to the GPU once and batches are "
        "gathered there; samples that do not fit are a configuration error naming the size "
        "(0: stream every batch from pinned host memory; cpu backend: must be 0)",
        in_range(std::int64_t{0}, std::int64_t{1} << 30));
  c.add_choice("loader.gather", gather, {"host", "device"},
               "cuda: who gathers a training batch's rows from this rank's samples in memory: "
               "host (the loader's threads copy them into page-locked batches, which go to the "
               "GPU) or device (the samples are page-locked in place once and a kernel reads "
               "each batch's rows straight from host memory over the host link, ahead of its "
               "step; at precision bf16 a page-locked bf16 copy of them instead, half their "
               "size, converted once; a page-locked copy where part of the block was locked "
               "already, e.g. by a CUDA-aware MPI transport; not with loader.device_cache_mb)");
  c.add("loader.background", background,
        "read ahead on a producer thread (false: read inside the step, on the training thread)");
  c.add("eval.batch", eval_batch, "global rows per evaluation batch",
        in_range(std::int64_t{1}, std::int64_t{1} << 24));
  c.add("eval.every", eval_every, "evaluate every this many epochs (0: only at the end)",
        at_least(0));
  c.add("checkpoint.dir", ckpt_dir,
        "directory of the run's checkpoints (ckpt-<step>.h5 and a `latest` pointer; empty: no "
        "checkpoints, and SIGUSR1/SIGUSR2 are ignored). One directory per training job: a "
        "second job on a directory in use is refused (the running job holds DIR/.lock)");
  c.add("checkpoint.every_steps", ckpt_every_steps, "checkpoint every this many steps (0: off)",
        at_least(0));
  c.add("checkpoint.every_seconds", ckpt_every_seconds,
        "checkpoint when this long passed since the last one (rank 0's clock; 0: off)",
        non_negative());
  c.add("checkpoint.at_epoch_end", ckpt_at_epoch_end, "checkpoint after every epoch");
  c.add("checkpoint.keep_last", ckpt_keep_last,
        "checkpoints of the run to keep (0: all); the newest is removed only after a newer one "
        "is committed", at_least(0));
  c.add("checkpoint.async", ckpt_async,
        "write periodic checkpoints in a background thread from a host copy while training "
        "continues (at most one in flight)");
  c.add("checkpoint.signals", ckpt_signals,
        "signals that checkpoint at the next step boundary and exit 75 (none: off)",
        [](const std::string& v) {
          try {
            train::parse_signals(v);
            return std::string();
          } catch (const ConfigError& e) {
            return std::string(e.what());
          }
        });
  c.add("checkpoint.save_timeout_s", ckpt_save_timeout_s,
        "give a checkpoint up beyond this many seconds, keeping the previous one (0: no limit)",
        non_negative());
  c.add("checkpoint.resume", ckpt_resume,
        "none: a new run; auto: continue from the newest checkpoint of checkpoint.dir that "
        "verifies (from scratch if there is none); or a checkpoint file. Also --resume=...");
}

train::CheckpointOptions TrainSettings::checkpoint_options() const {
  train::CheckpointOptions c;
  c.dir = ckpt_dir;
  c.every_steps = ckpt_every_steps;
  c.every_seconds = ckpt_every_seconds;
  c.at_epoch_end = ckpt_at_epoch_end;
  c.at_end = true;
  c.keep_last = ckpt_keep_last;
  c.async = ckpt_async;
  c.signals = ckpt_dir.empty() ? std::vector<int>{} : train::parse_signals(ckpt_signals);
  c.save_timeout_s = ckpt_save_timeout_s;
  c.watchdog_s = watchdog_s;
  train::validate(c);
  return c;
}

std::vector<std::string> resume_alias(int argc, char** argv) {
  std::vector<std::string> out;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--resume=", 0) == 0) {
      out.push_back("--checkpoint.resume=" + a.substr(9));
    } else if (a == "--resume" && i + 1 < argc) {
      out.push_back(std::string("--checkpoint.resume=") + argv[++i]);
    } else {
      out.push_back(a);
    }
  }
  return out;
}

train::TrainOptions TrainSettings::to_options() const {
  train::TrainOptions o;
  o.model.widths = train::parse_widths(widths);
  o.model.activation = train::parse_activation(activation);
  o.model.init = train::parse_init(init);
  o.model.dropout = static_cast<float>(dropout);
  o.model.seed = static_cast<std::uint64_t>(model_seed);
  o.loss = train::parse_loss(loss);
  o.optimizer.kind = train::parse_optimizer_kind(optimizer);
  o.optimizer.weight_decay = weight_decay;
  o.optimizer.momentum = momentum;
  o.optimizer.dampening = dampening;
  o.optimizer.nesterov = nesterov && o.optimizer.kind == train::OptimizerKind::sgd;
  if (nesterov && o.optimizer.kind == train::OptimizerKind::sgd &&
      (momentum <= 0.0 || dampening != 0.0)) {
    throw ConfigError(fmt::format("optim.nesterov = true needs optim.momentum > 0 and "
                                  "optim.dampening = 0 (got momentum {}, dampening {}): set "
                                  "them, or optim.nesterov = false",
                                  momentum, dampening));
  }
  o.optimizer.beta1 = beta1;
  o.optimizer.beta2 = beta2;
  o.optimizer.eps = eps;
  o.schedule.kind = train::parse_schedule_kind(schedule);
  o.schedule.base_lr = lr;
  o.schedule.warmup_steps = warmup_steps;
  o.schedule.step_size = step_size;
  o.schedule.gamma = gamma;
  o.schedule.min_lr = min_lr;
  if (o.schedule.kind == train::ScheduleKind::cosine && min_lr > lr) {
    throw ConfigError(fmt::format("optim.min_lr = {} exceeds optim.lr = {}: the cosine "
                                  "schedule decays from lr to min_lr",
                                  min_lr, lr));
  }
  o.clip_max_norm = clip_max_norm;
  o.epochs = epochs;
  o.max_steps = max_steps;
  o.data.path = train_path;
  o.data.global_batch = batch;
  o.data.shuffle = train::parse_shuffle(shuffle);
  o.data.seed = static_cast<std::uint64_t>(loader_seed);
  o.data.prefetch_depth = static_cast<int>(prefetch);
  o.data.gather_threads = static_cast<int>(gather_threads);
  o.data.memory_budget = static_cast<std::uint64_t>(memory_budget_mb) << 20;
  o.data.drop_last = drop_last;
  o.data.background = background;
  o.data.stage_dir = stage_dir;
  o.data.stage_keep = stage_keep;
  o.eval_path = test_path;
  o.eval_batch = eval_batch;
  o.eval_every = eval_every;
  o.log_every = log_every;
  o.pipeline_stages = static_cast<int>(pipeline_stages);
  o.micro_batches = static_cast<int>(micro_batches);
  o.pipeline_schedule = train::parse_pipeline_schedule(pipeline_schedule);
  o.stage_boundaries = train::parse_stage_boundaries(stage_boundaries);
  o.threads = static_cast<int>(threads);
  o.compute.backend = backend;
  o.compute.precision = train::parse_precision(precision);
  o.compute.device = static_cast<int>(device);
  o.compute.graphs = graphs;
  o.compute.measure_gemms = gemm_select == "measure";
  o.device_cache_bytes = static_cast<std::uint64_t>(device_cache_mb) << 20;
  o.device_gather = gather == "device";
  o.reducer.bucket_bytes = static_cast<std::size_t>(bucket_kb) << 10;
  o.reducer.backend = comm::parse_reducer_backend(reducer);
  o.reducer.reduction = comm::parse_reduction(reduction);
  o.reducer.precision = comm::parse_reduce_precision(reducer_precision);
  o.reducer.timeout_s = reducer_timeout_s;
  o.stage_link.backend = comm::parse_link_backend(stage_link);
  o.stage_link.timeout_s = reducer_timeout_s;
  o.anomaly.action = train::parse_anomaly_action(anomaly);
  o.anomaly.z = anomaly_z;
  o.anomaly.window = static_cast<int>(anomaly_window);
  o.straggler.pct = straggler_pct;
  o.straggler.k = straggler_k;
  o.straggler.intervals = static_cast<int>(straggler_intervals);
  if (!ckpt_dir.empty()) o.stragglers_file = ckpt_dir + "/stragglers";
  train::validate(o);
  return o;
}

}  // namespace locus::app
