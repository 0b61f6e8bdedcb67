// The [infer] config section of locus-infer and its mapping onto infer::InferOptions.
#pragma once

#include <cstdint>
#include <string>

#include "config.hpp"
#include "locus/infer/infer.hpp"

namespace locus::app {

struct InferSettings {
  std::string model, input, features = "/features", labels = "/labels", output, report;
  std::string prometheus;
  std::string outputs = "auto", slow_ranks, schedule = "dynamic", backend = "cpu",
              precision = "fp32";
  std::int64_t top_k = 0, batch_rows = 256, unit_rows = 0, read_rows = 0, read_threads = 0,
               blas_threads = 1, slow_ms = 0, device = -1;
  double slow_factor = 1.0, watchdog_s = kWatchdogDefaultS, progress_s = kProgressDefaultS;
  bool speculate = true, record_writer = false;
  // command-line switches
  bool overwrite = false, incremental = false;

  void register_options(Config& c);
  infer::InferOptions to_options(const Config& c) const;
};

// The embedded default pipeline config (configs/fashion-mnist.ini at build time).
const std::string& default_pipeline_config();

}  // namespace locus::app
