// Partitioned batch inference behind locus-infer: every rank scores work units of rows handed
// out dynamically (with speculative re-runs of stragglers), reading, computing and writing in
// a pipeline, into a prediction file published atomically or extended incrementally.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/comm/queue_progress.hpp"
#include "locus/infer/scorer.hpp"
#include "locus/infer/work_queue.hpp"

namespace locus::infer {

// The largest batch (rows per forward pass) a run may use, and so a prediction file may record:
// a damaged file's batch_rows must not size the scorer's buffers.
inline constexpr std::int64_t kMaxBatchRows = std::int64_t{1} << 20;

struct InferOptions {
  std::string model;                   // model file or training checkpoint
  std::string input;                   // HDF5 file with a float [N, D] features dataset
  std::string features = "/features";  // for a locus dataset, rows = its committed_rows
  std::string labels = "/labels";      // int labels [N]: metrics when present ("" = none)
  std::string output;                  // prediction file
  std::string report;                  // JSON report ("" → "<output>.report.json")
  std::string outputs = "auto";        // auto (from the model's loss) | probabilities | raw
  int top_k = 0;
  int batch_rows = 256;
  std::uint64_t unit_rows = 0;         // 0 → about 8192 rows, a multiple of the input chunks
  // Rows per read: each rank reads its units this many rows at a time into a small ring just
  // ahead of its compute thread (0 → about 2 MiB of features; rounded up to whole batches).
  // Any value gives the same bytes.
  std::uint64_t read_rows = 0;
  // Threads that read each stripe at once (io::RowReader: pread straight into the ring where
  // the features lie in the file as plain bytes). 0 → 1 on the cpu backend (the forward passes
  // are the bound there and need the cores); on cuda, where reading is the bound, the cores
  // this rank may run on, shared among the node's ranks, less two (its compute and main
  // threads), between 1 and 8. Any value gives the same bytes.
  int read_threads = 0;
  bool speculate = true;               // re-run stragglers' units when the queue is empty
  // dynamic: units from the shared counter; static_blocks (a benchmark baseline): rank r scores
  // the r-th contiguous block of units, no speculation.
  Schedule schedule = Schedule::dynamic;
  int blas_threads = 1;                // identical on every rank (results depend on it)
  // Where the forward passes run: "cpu" (OpenBLAS, the reference) or "cuda" (one GPU per rank:
  // the batches copied to the device, the forward pass, softmax, argmax, top-k and the
  // per-row log-loss computed there, only the outputs copied back). precision: fp32 | tf32 |
  // bf16 as train.precision (cpu: fp32 only). device: cuda, -1 = the node-local rank modulo
  // the visible devices. Output bytes depend on these (and on the device kind), not on the
  // world size or the schedule.
  std::string backend = "cpu";
  std::string precision = "fp32";
  int device = -1;
  bool record_writer = false;          // add /writer (who wrote each row)
  bool overwrite = false;              // replace an existing output
  bool incremental = false;            // score only rows beyond the output's watermark
  std::string effective_config;        // recorded in the output
  // Progress while scoring: every progress_s seconds (0: never) on the ranks given a sink (the
  // app: rank 0), the queue's counters with the amounts in rows and the total the rows this run
  // scores (comm::describe words them).
  double progress_s = 0;
  comm::ProgressTicker::Sink on_progress;
  // Called on every rank where set (the app: rank 0) once the last unit is scored, as the rows
  // are committed (made durable; a full run's file then published), with the scoring's final
  // figures: every unit done, the rows this run scored, the re-runs, the seconds that took.
  // After its last progress line, what a person watching learns.
  std::function<void(const comm::QueueProgress&)> on_commit;
  // Test and benchmark hooks: the listed ranks of comm compute slow_factor times slower (the
  // compute thread stays busy for (factor - 1) x each batch's compute time, as on a slower CPU)
  // and sleep slow_ms before each unit.
  std::vector<int> slow_ranks;
  double slow_factor = 1.0;
  std::int64_t slow_ms = 0;
};

// What one rank did; units are counted when started.
struct RankStats {
  std::int64_t claimed = 0;          // fresh units taken from the counter
  std::int64_t speculative = 0;      // speculative re-runs started
  std::int64_t written = 0;          // units whose result this rank wrote (won)
  std::int64_t speculative_wins = 0; // speculative re-runs that won
  std::int64_t abandoned = 0;        // runs dropped because another rank finished first
  std::int64_t rows = 0;             // rows written
  // Wall seconds of the main thread's reads (features stripe by stripe, labels per unit), of
  // the compute thread's forward passes, of the main thread's post-processing (softmax, argmax,
  // top-k, metrics) and writing of won units, and of the main thread waiting for the compute
  // thread.
  double seconds_read = 0, seconds_compute = 0, seconds_write = 0, seconds_wait = 0;
  // Wall time of the scoring loop in which the compute thread had nothing to score (waiting
  // for the first read, for a late read, for the last write): what the pipeline failed to hide.
  double seconds_idle = 0;
  // CPU time (not wall clock) of the compute thread and of the whole process during the
  // scoring loop: on a shared machine these show the work done, whatever the load.
  double cpu_seconds_compute = 0, cpu_seconds = 0;
};

struct InferResult {
  std::uint64_t row_begin = 0, row_end = 0;  // rows scored in this run
  std::uint64_t input_rows = 0;
  int features = 0, outputs = 0;
  OutputKind kind = OutputKind::probabilities;
  int top_k = 0;
  std::uint64_t unit_rows = 0, batch_rows = 0;
  std::int64_t units = 0;
  std::int64_t units_written_once = 0;       // must equal units
  std::int64_t speculative_runs = 0;         // over all ranks
  std::vector<RankStats> ranks;              // per rank (on every rank)
  std::optional<Metrics> metrics;            // when the input has labels (classifiers)
  double seconds = 0;                        // scoring loop, first claim to durable output
  double seconds_durable = 0;                // of which: flushes, fsyncs and the publication
  // Of seconds_total, before the input is touched: options, device (cuda: context, cuBLASLt),
  // model.
  double seconds_init = 0;
  double seconds_total = 0;                  // including setup and publication
  bool incremental = false;
  std::string report_path;
  std::string compute;  // "cpu (OpenBLAS, 1 thread)" or "cuda fp32 on device 0 NVIDIA ..." (rank 0)
  std::string read;     // how rank 0 read the features: "pread, 6 threads (chunks of 4096 rows)"
};

// Collective over comm. ConfigError for bad options or an existing output without
// --overwrite / --incremental; DataError for a bad model, input or feature-width mismatch;
// IoError when the output cannot be written. Nothing is published unless every unit was
// written; an incremental run advances the watermark only after its rows are durable.
InferResult run_inference(const mpi::Comm& comm, const InferOptions& opts);

// The settings this job sets away from their defaults but does not use (infer.blas_threads on
// the cuda backend), one sentence each naming the key, for the app to print: named, not refused,
// as train::unused_settings does (settings that ask for a GPU on the cpu backend are refused).
std::vector<std::string> unused_settings(const InferOptions& opts);

// The JSON report of a result (what run_inference writes to opts.report).
std::string report_json(const InferOptions& opts, const InferResult& r);

// Default unit size: a multiple of the input's chunk rows near `target` rows, chosen to keep the
// padding of the last batch of each unit small.
std::uint64_t choose_unit_rows(std::uint64_t chunk_rows, std::uint64_t batch_rows,
                               std::uint64_t target = 8192);

}  // namespace locus::infer
