// locus-infer: partitioned batch inference. Ranks take work units dynamically (re-running
// stragglers' units), score them with a model file or checkpoint and write a prediction file.
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

#include "config.hpp"
#include "infer_options.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/app.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/infer/infer.hpp"
#include "locus/io/progress_file.hpp"

namespace {

void print_summary(const locus::infer::InferOptions& o, const locus::infer::InferResult& r) {
  const auto rows = r.row_end - r.row_begin;
  fmt::print("{} {} rows{} of {} with {} into {} ({} features -> {} {}{}), {} ranks\n",
             r.incremental ? "incrementally scored" : "scored", rows,
             r.incremental ? fmt::format(" [{}, {})", r.row_begin, r.row_end) : "", o.input,
             o.model, o.output, r.features, r.outputs, locus::infer::to_string(r.kind),
             r.top_k > 0 ? fmt::format(", top-{}", r.top_k) : "", r.ranks.size());
  fmt::print("  compute: {}\n", r.compute);
  fmt::print("  read: {}\n", r.read);
  fmt::print("  {:.3f} s scoring ({:.0f} rows/s; {:.3f} s of it making the output durable), "
             "{:.3f} s in all; {} units of {} rows, {} speculative re-runs\n", r.seconds,
             r.seconds > 0 ? rows / r.seconds : 0.0, r.seconds_durable, r.seconds_total, r.units,
             r.unit_rows, r.speculative_runs);
  for (std::size_t i = 0; i < r.ranks.size(); ++i) {
    const auto& s = r.ranks[i];
    fmt::print("  rank {}: wrote {} units ({} rows), {} speculative re-runs ({} won), {} "
               "abandoned; read {:.2f} s, compute {:.2f} s, write {:.2f} s\n",
               i, s.written, s.rows, s.speculative, s.speculative_wins, s.abandoned,
               s.seconds_read, s.seconds_compute, s.seconds_write);
  }
  if (r.metrics) {
    const auto& m = *r.metrics;
    const double n = m.rows > 0 ? static_cast<double>(m.rows) : 1.0;
    fmt::print("  accuracy {:.4f}, log-loss {:.4f} over {} labelled rows{}\n", m.correct / n,
               m.log_loss_sum / n, m.rows,
               m.out_of_range > 0 ? fmt::format(" ({} labels out of range, skipped)",
                                                m.out_of_range)
                                  : "");
  }
  fmt::print("  report: {}\n", r.report_path);
}

}  // namespace

int main(int argc, char** argv) {
  // Each rank runs a compute thread next to its main (I/O) thread, and a rank that ran out of
  // units waits in a barrier for the slower ones: let Open MPI yield the core while it waits
  // instead of spinning on it (the slower ranks on a shared node need it). Set before MPI_Init,
  // which reads it; an explicit setting wins.
  ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  return locus::run_app(argc, argv, [&](locus::mpi::Comm& world) {
    locus::infer::InferOptions opts;
    locus::app::Config config("locus-infer",
                              "Scores a dataset with a model file or checkpoint on every rank, "
                              "with dynamic work units and speculative re-runs of stragglers, "
                              "into a prediction file (docs/FORMATS.md). Exit codes: 0 done, 2 "
                              "bad configuration or existing output, 3 bad model or input, 5 "
                              "output not writable, 70 internal error (job aborted).");
    locus::app::InferSettings settings;
    settings.register_options(config);
    if (!locus::app::parse_or_answer(config, world, argc, argv,
                                     locus::app::default_pipeline_config(),
                                     [&] { opts = settings.to_options(config); })) {
      return locus::exit_code::ok;
    }
    if (world.is_root()) {
      for (const auto& n : locus::infer::unused_settings(opts)) fmt::print("note: {}\n", n);
      std::fflush(stdout);
    }
    const locus::comm::Watchdog watchdog(settings.watchdog_s, "infer.watchdog_s");
    // The Prometheus file is written first: it must not be a file the job reads or writes.
    locus::mpi::agree_on(world, [&] {
      locus::app::refuse_shared_paths(
          {{settings.prometheus, "infer.prometheus"}},
          {{opts.model, "infer.model"}, {opts.input, "infer.input"},
           {opts.output, "infer.output"},
           {opts.report.empty() ? opts.output + ".report.json" : opts.report, "infer.report"}});
    });
    locus::io::ProgressFile prometheus(world, settings.prometheus, "infer.prometheus", "infer",
                                       {"score", "commit"});
    opts.on_progress = locus::app::progress_sink(world, "scoring", "rows", prometheus);
    if (world.is_root()) {
      // After the last progress line: the rows committed, a full run's file published.
      opts.on_commit = [&](const locus::comm::QueueProgress& scored) {
        prometheus.phase("commit", scored);
        if (opts.progress_s > 0) {
          fmt::print("committing: {} rows scored in {:.2f} s; making {} durable{}\n",
                     scored.counts.amount, scored.seconds, opts.output,
                     opts.incremental ? "" : " and publishing it");
          std::fflush(stdout);
        }
      };
    }
    const auto result = locus::infer::run_inference(world, opts);
    const auto rows = static_cast<std::int64_t>(result.row_end - result.row_begin);
    prometheus.finish({{result.units, result.units, rows, result.speculative_runs}, rows,
                       result.seconds});
    if (world.is_root()) print_summary(opts, result);
    return locus::exit_code::ok;
  });
}
