// locus-ingest: parallel ingest of IDX/CSV inputs into a locus HDF5 dataset, behind
// data-quality gates. Units of the input are handed out dynamically (idle ranks re-run a slower
// rank's unit); every rank writes the units it won.

#include <cstdio>

#include <fmt/format.h>

#include "config.hpp"
#include "ingest_options.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/app.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/io/ingest.hpp"
#include "locus/io/progress_file.hpp"

namespace {

// "  units: 45 of 1.0 MiB, dynamic with speculation; won/re-runs per rank: 23/0 22/1"
void print_schedule(const locus::io::IngestSchedule& s) {
  std::string ranks;
  for (const auto& r : s.per_rank) ranks += fmt::format(" {}/{}", r.won, r.reruns);
  fmt::print("  units: {} of {:.1f} MiB, {}{}; won/re-runs per rank:{}\n", s.units,
             static_cast<double>(s.unit_bytes) / (1 << 20),
             s.schedule == locus::comm::Schedule::dynamic ? "dynamic" : "static",
             s.speculate ? " with speculation" : "", ranks);
}

void print_summary(const locus::io::IngestOptions& opts, const locus::io::IngestResult& r,
                   int ranks) {
  const auto& m = r.meta;
  const auto& rep = r.report;
  if (r.already_appended) {
    const std::string input = opts.source == locus::io::IngestOptions::Source::csv
                                  ? opts.csv.path
                                  : opts.idx.images + (opts.idx.labels.empty() ? ""
                                                                               : " and " + opts.idx.labels);
    fmt::print("nothing appended: {} (same path, size and CRC-32) is already the last input "
               "appended to {} ({} rows): this append was done before, e.g. by a run killed or "
               "preempted after it published, and is not repeated. To add the same rows again, "
               "append a copy of the input under another name\n", input, opts.output, m.rows);
    return;
  }
  if (opts.validate_only) {
    fmt::print("validated {} rows x {} features on {} ranks: all {} gates passed (report: {})\n",
               rep.rows, rep.cols, ranks, rep.rules.size(),
               opts.report.empty() ? opts.output + ".gates.json" : opts.report);
    print_schedule(r.schedule);
    return;
  }
  const double mb = static_cast<double>(r.input_bytes) / 1e6;
  const double secs = r.seconds_parse + r.seconds_gates + r.seconds_write;
  fmt::print("{} {} rows into {} ({} rows x {} features{}, compression {}), {} ranks\n",
             opts.append ? "appended" : "ingested", r.rows_added, opts.output, m.rows, m.cols,
             m.has_labels ? fmt::format(", labels '{}'", m.label_name) : "",
             r.compression.deflate_level < 0 ? "other filters"
                                             : locus::io::to_string(r.compression),
             ranks);
  fmt::print("  input {:.1f} MB in {:.2f} s ({:.1f} MB/s): parse {:.2f} s, gates {:.2f} s, "
             "write {:.2f} s\n", mb, secs, secs > 0 ? mb / secs : 0.0, r.seconds_parse,
             r.seconds_gates, r.seconds_write);
  if (!m.stats.mean.empty()) {
    double lo = m.stats.min[0], hi = m.stats.max[0], mean = 0;
    for (std::size_t i = 0; i < m.stats.mean.size(); ++i) {
      lo = std::min(lo, m.stats.min[i]);
      hi = std::max(hi, m.stats.max[i]);
      mean += m.stats.mean[i];
    }
    fmt::print("  raw features: min {:g}, max {:g}, mean of feature means {:.4g}; "
               "normalization {}\n", lo, hi, mean / static_cast<double>(m.stats.mean.size()),
               locus::io::to_string(m.normalization.mode));
  }
  fmt::print("  gates: {} rules passed{}; non-finite rows {}, dropped {}\n", rep.rules.size(),
             rep.reference.empty() ? "" : fmt::format(" (reference {})", rep.reference),
             rep.nonfinite_rows, rep.dropped_rows);
  if (rep.join_missing_rows) {
    fmt::print("  join: {} by '{}'; rows whose key it lacks: {}{}\n", opts.join.path,
               opts.join.key, *rep.join_missing_rows,
               *rep.join_missing_rows > 0 ? " (dropped)" : "");
  }
  print_schedule(r.schedule);
}

// The line rank 0 prints as a phase after the parse begins (with ingest.progress_s > 0): after
// the last progress line a large ingest still checks its gates and writes for minutes.
void print_phase(const locus::io::IngestOptions& opts, const locus::io::IngestPhase& ph) {
  using Kind = locus::io::IngestPhase::Kind;
  const std::int64_t rows = ph.parse.counts.amount;
  switch (ph.kind) {
    case Kind::gates:
      fmt::print("gates: {} rows parsed in {:.2f} s; checking them against the quality gates\n",
                 rows, ph.seconds_before);
      break;
    case Kind::write:
      fmt::print("writing: {} rows x {} features ({:.1f} MiB) {} {} (collective); the gates "
                 "passed in {:.2f} s\n",
                 rows, ph.cols,
                 static_cast<double>(rows) * static_cast<double>(ph.cols) * sizeof(float) /
                     (1024.0 * 1024.0),
                 opts.append ? "appended to a copy of" : "into", opts.output, ph.seconds_before);
      break;
    case Kind::commit:
      fmt::print("committing: {} written in {:.2f} s; making it durable and publishing it\n",
                 opts.output, ph.seconds_before);
      break;
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  return locus::run_app(argc, argv, [&](locus::mpi::Comm& world) {
    locus::io::IngestOptions opts;
    locus::app::Config config("locus-ingest",
                              "Ingests IDX or CSV data into a locus HDF5 dataset in parallel, "
                              "behind data-quality gates (docs/FORMATS.md).");
    locus::app::IngestSettings settings;
    settings.register_options(config);
    if (!locus::app::parse_or_answer(config, world, argc, argv,
                                     locus::app::default_pipeline_config(),
                                     [&] { opts = settings.to_options(config); })) {
      return locus::exit_code::ok;
    }
    const locus::comm::Watchdog watchdog(settings.watchdog_s, "ingest.watchdog_s");
    // The Prometheus file is written first: it must not be a file the job reads or writes.
    locus::mpi::agree_on(world, [&] {
      locus::app::refuse_shared_paths(
          {{settings.prometheus, "ingest.prometheus"}},
          {{settings.output, "ingest.output"},
           {settings.report.empty() ? settings.output + ".gates.json" : settings.report,
            "ingest.report"},
           {settings.images, "ingest.images"}, {settings.labels, "ingest.labels"},
           {settings.csv, "ingest.csv"}, {settings.join, "ingest.join"},
           {settings.reference, "gates.reference"}});
    });
    locus::io::ProgressFile prometheus(world, settings.prometheus, "ingest.prometheus", "ingest",
                                       locus::io::ingest_phases());
    opts.on_progress = locus::app::progress_sink(world, "parsing", "rows", prometheus);
    if (world.is_root()) {
      opts.on_phase = [&](const locus::io::IngestPhase& ph) {
        prometheus.phase(locus::io::phase_name(ph.kind), ph.parse);
        if (opts.progress_s > 0) print_phase(opts, ph);
      };
    }
    const auto result = locus::io::run_ingest(world, opts);
    std::int64_t rows = 0, reruns = 0;
    for (const auto& r : result.schedule.per_rank) {
      rows += r.rows;
      reruns += r.reruns;
    }
    prometheus.finish({{result.schedule.units, result.schedule.units, rows, reruns}, 0,
                       result.seconds_parse});
    if (world.is_root()) print_summary(opts, result, world.size());
    return locus::exit_code::ok;
  });
}
