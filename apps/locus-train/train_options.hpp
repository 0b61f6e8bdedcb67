// The [data], [model], [optim], [train], [loader], [eval] and [checkpoint] config sections of locus-train
// and their mapping onto train::TrainOptions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"
#include "locus/train/trainer.hpp"

namespace locus::app {

struct TrainSettings {
  // [data]
  std::string train_path = "out/fashion-mnist-train.h5";
  std::string stage_dir;
  bool stage_keep = false;
  std::string test_path = "out/fashion-mnist-test.h5";
  // [model]
  std::string widths = "784,256,128,10", activation = "relu", init = "he";
  double dropout = 0.0;
  std::int64_t model_seed = 1;
  // [optim]
  std::string optimizer = "sgd", schedule = "cosine";
  double lr = 0.05, momentum = 0.9, dampening = 0.0, weight_decay = 0.0;
  bool nesterov = true;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, gamma = 0.1, min_lr = 0.0;
  std::int64_t warmup_steps = 0, step_size = 1000;
  double clip_max_norm = 0.0;
  // [train]
  std::string loss = "cross_entropy", backend = "cpu", precision = "fp32";
  std::int64_t device = -1, device_cache_mb = 0;
  bool graphs = true;
  std::string gemm_select = "measure";
  std::int64_t epochs = 12, max_steps = 0, batch = 128, threads = 1, pipeline_stages = 1;
  std::int64_t micro_batches = 1;
  std::string pipeline_schedule = "1f1b", stage_boundaries;
  std::int64_t bucket_kb = 4096, log_every = 100;
  std::string reducer = "auto", reduction = "auto", stage_link = "auto", gather = "host";
  std::string reducer_precision = "fp32";
  double reducer_timeout_s = 600, watchdog_s = kWatchdogDefaultS;
  // [train] monitors
  std::string anomaly = "warn";
  double anomaly_z = 8.0;
  std::int64_t anomaly_window = 100;
  double straggler_pct = 50.0, straggler_k = 3.0;
  std::int64_t straggler_intervals = 3;
  std::string output = "out/fashion-mnist-model.h5";
  std::string metrics = "out/fashion-mnist-metrics.jsonl";
  bool telemetry = true;
  std::string prometheus;
  // [loader]
  std::string shuffle = "global";
  std::int64_t loader_seed = 0, prefetch = 4, memory_budget_mb = 1024, gather_threads = 0;
  bool drop_last = false, background = true;
  // [eval]
  std::int64_t eval_batch = 1000, eval_every = 1;
  // [checkpoint] (checkpointing is off while dir is empty)
  std::string ckpt_dir, ckpt_signals = "USR1,TERM", ckpt_resume = "none";
  std::int64_t ckpt_every_steps = 0, ckpt_keep_last = 2;
  double ckpt_every_seconds = 0, ckpt_save_timeout_s = 0;
  bool ckpt_at_epoch_end = true, ckpt_async = false;

  void register_options(Config& c);
  // Throws ConfigError for values that are valid one by one but not together.
  train::TrainOptions to_options() const;
  train::CheckpointOptions checkpoint_options() const;
};

// `--resume=X` / `--resume X` (what slurm/train.sbatch passes) as --checkpoint.resume=X; every
// other argument unchanged.
std::vector<std::string> resume_alias(int argc, char** argv);

// The embedded default pipeline config (configs/fashion-mnist.ini at build time).
const std::string& default_pipeline_config();

}  // namespace locus::app
