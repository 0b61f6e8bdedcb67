// Option registration and validation for locus-infer.
#include "infer_options.hpp"

#include <fmt/format.h>

namespace locus::app {

void InferSettings::register_options(Config& c) {
  c.add("infer.model", model, "model file or training checkpoint (docs/FORMATS.md)");
  c.add("infer.input", input, "HDF5 input: a locus dataset or any file with float [N, D] features");
  c.add("infer.features", features, "features dataset inside the input");
  c.add("infer.labels", labels, "labels dataset; when present: accuracy, log-loss, confusion");
  c.add("infer.output", output, "prediction file to write");
  c.add("infer.report", report, "JSON report (empty: <output>.report.json)");
  c.add_choice("infer.outputs", outputs, {"auto", "probabilities", "raw"},
               "softmax probabilities or raw outputs (auto: from the model's loss)");
  c.add("infer.top_k", top_k, "also write the k most likely classes per row (0: none)",
        at_least(0));
  c.add("infer.batch_rows", batch_rows, "rows per forward pass", in_range(std::int64_t{1}, infer::kMaxBatchRows));
  c.add("infer.unit_rows", unit_rows,
        "rows per work unit (0: about 8192, a multiple of the input's chunk rows)", at_least(0));
  c.add("infer.read_rows", read_rows,
        "rows per read into the ring ahead of the compute thread (0: about 2 MiB; rounded up "
        "to whole batches; same results whatever the value)", at_least(0));
  c.add("infer.read_threads", read_threads,
        "threads reading each stripe at once, by pread where the features are stored plain "
        "(0: 1 on cpu; on cuda the rank's share of the node's cores less two, at most 8; "
        "same results whatever the value)", in_range(std::int64_t{0}, std::int64_t{64}));
  c.add_choice("infer.schedule", schedule, {"dynamic", "static"},
               "dynamic: units from a shared counter, faster ranks take more; static: rank r "
               "scores the r-th block of units, no speculation (a benchmark baseline)");
  c.add("infer.speculate", speculate,
        "when no unit is left, re-run units still in flight on slower ranks");
  c.add("infer.blas_threads", blas_threads,
        "BLAS threads per rank (same on every rank; the cpu backend's: the cuda backend scores "
        "on the GPU)",
        in_range(std::int64_t{1}, std::int64_t{1024}));
  add_watchdog_option(c, "infer.watchdog_s", watchdog_s);
  add_progress_option(c, "infer.progress_s", progress_s);
  add_prometheus_option(c, "infer.prometheus", prometheus);
  c.add_choice("infer.backend", backend, {"cpu", "cuda"},
               "where the forward passes run (cpu: OpenBLAS; cuda: one GPU per rank, the "
               "training backend's kernels, softmax/argmax/top-k on the device, in builds with "
               "CUDA)");
  c.add_choice("infer.precision", precision, {"fp32", "tf32", "bf16"},
               "matrix-product arithmetic on the GPU, as train.precision (fp32: as the CPU; "
               "tf32; bf16); the cpu backend takes fp32 only");
  c.add("infer.device", device,
        "cuda: the GPU of this rank (-1: the node-local rank modulo the visible devices; "
        "another value is refused on the cpu backend)",
        in_range(std::int64_t{-1}, std::int64_t{1023}));
  c.add("infer.record_writer", record_writer, "add /writer: the rank that wrote each row");
  c.add("infer.slow_ranks", slow_ranks,
        "test/benchmark hook: comma-separated ranks made slower (see slow_factor, slow_ms)");
  c.add("infer.slow_factor", slow_factor, "test hook: slow ranks compute this many times slower (busy, as a slower CPU)",
        [](double v) { return v >= 1.0 ? std::string() : std::string("must be >= 1"); });
  c.add("infer.slow_ms", slow_ms, "test hook: slow ranks sleep this long before each unit",
        at_least(0));
  c.flag("overwrite", overwrite, "replace an existing output");
  c.flag("incremental", incremental,
         "score only input rows beyond the output's committed_rows (e.g. after an append); "
         "a missing output is scored in full");
}

infer::InferOptions InferSettings::to_options(const Config& c) const {
  infer::InferOptions o;
  o.model = model;
  o.input = input;
  o.features = features;
  o.labels = labels;
  o.output = output;
  o.report = report;
  o.outputs = outputs;
  o.top_k = static_cast<int>(top_k);
  o.batch_rows = static_cast<int>(batch_rows);
  o.unit_rows = static_cast<std::uint64_t>(unit_rows);
  o.read_rows = static_cast<std::uint64_t>(read_rows);
  o.read_threads = static_cast<int>(read_threads);
  o.speculate = speculate;
  o.schedule = schedule == "static" ? infer::Schedule::static_blocks : infer::Schedule::dynamic;
  o.blas_threads = static_cast<int>(blas_threads);
  o.record_writer = record_writer;
  o.backend = backend;
  o.precision = precision;
  o.device = static_cast<int>(device);
  for (std::int64_t r : parse_int_list("infer.slow_ranks", slow_ranks)) {
    if (r < 0) throw ConfigError(fmt::format("infer.slow_ranks holds {}; ranks are >= 0", r));
    o.slow_ranks.push_back(static_cast<int>(r));
  }
  o.slow_factor = slow_factor;
  o.slow_ms = slow_ms;
  o.progress_s = progress_s;
  o.overwrite = overwrite;
  o.incremental = incremental;
  o.effective_config = c.effective_ini();
  return o;
}

}  // namespace locus::app
