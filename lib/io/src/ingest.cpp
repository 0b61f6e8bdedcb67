// The ingest pipeline: parse units (dynamic, speculative) → gates → histogram, normalization →
// one collective write per rank of the units it won → publish.
#include "locus/io/ingest.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <memory>

#include <fmt/format.h>
#include <mpi.h>

#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/config.hpp"
#include "ingest_units.hpp"
#include "locus/io/checksum.hpp"
#include "locus/io/json.hpp"
#include "locus/io/publish.hpp"
#include "locus/io/unit_source.hpp"

namespace locus::io {

namespace {

std::vector<std::string> input_paths(const IngestOptions& o) {
  if (o.source == IngestOptions::Source::csv) return {o.csv.path};
  std::vector<std::string> p{o.idx.images};
  if (!o.idx.labels.empty()) p.push_back(o.idx.labels);
  return p;
}

void check_options(const mpi::Comm& comm, const IngestOptions& o, bool output_exists) {
  mpi::agree_on(comm, [&] {
    if (o.output.empty() && !o.validate_only)
      throw ConfigError("option 'ingest.output' is empty; name the dataset file to write");
    if (o.append && o.overwrite)
      throw ConfigError("--append and --overwrite exclude each other; choose one");
    if (!o.join.path.empty() && o.source != IngestOptions::Source::csv)
      throw ConfigError("ingest.join needs ingest.source = csv: the join key is a CSV column; "
                        "unset ingest.join for IDX input");
    if (!o.join.path.empty() && o.join.key.empty())
      throw ConfigError(fmt::format("ingest.join = '{}' needs ingest.join_key, the column of "
                                    "both tables that matches a row to its join row",
                                    o.join.path));
    if (o.validate_only || o.append) return;
    check_compression_available(o.compression);
    if (output_exists && !o.overwrite) {
      throw ConfigError(fmt::format("output '{}' already exists; pass --overwrite to replace "
                                    "it or --append to add rows to it", o.output));
    }
  });
  if (o.append && !output_exists) {
    throw ConfigError(fmt::format("--append: output '{}' does not exist yet; run without "
                                  "--append first", o.output)
                          .c_str());
  }
}

// An append is a no-op when its inputs are the dataset's last recorded sources: the rows are
// in it already. A job killed after its append was published (a SIGKILL before it exited, a
// requeued Slurm job) is rerun with the same command, which must not add the rows twice.
bool already_appended(const DatasetMeta& existing, const std::vector<SourceFile>& sources) {
  const auto& have = existing.provenance.sources;
  if (sources.empty() || have.size() < sources.size()) return false;
  return std::equal(sources.begin(), sources.end(),
                    have.end() - static_cast<std::ptrdiff_t>(sources.size()),
                    [](const SourceFile& a, const SourceFile& b) {
                      return a.path == b.path && a.bytes == b.bytes && a.crc32 == b.crc32;
                    });
}

std::unique_ptr<UnitSource> open_units(const mpi::Comm& comm, const IngestOptions& o,
                                       std::shared_ptr<const JoinTable> join) {
  if (o.source == IngestOptions::Source::csv)
    return open_csv_units(comm, o.csv, o.unit_bytes, std::move(join));
  return open_idx_units(comm, o.idx, o.unit_bytes);
}

Json schedule_json(const IngestSchedule& s) {
  Json ranks = Json::array();
  for (std::size_t r = 0; r < s.per_rank.size(); ++r) {
    const IngestRankStats& x = s.per_rank[r];
    ranks.push_back(Json{{"rank", r}, {"claimed", x.claimed}, {"reruns", x.reruns},
                         {"won", x.won}, {"rerun_wins", x.rerun_wins},
                         {"abandoned", x.abandoned}, {"rows", x.rows}, {"seconds", x.seconds}});
  }
  return Json{{"kind", s.schedule == comm::Schedule::dynamic ? "dynamic" : "static"},
              {"speculation", s.speculate}, {"units", s.units}, {"unit_bytes", s.unit_bytes},
              {"per_rank", std::move(ranks)}};
}

void write_report(const mpi::Comm& comm, const std::string& path, const GateReport& report,
                  const IngestSchedule& schedule, bool validate_only) {
  mpi::agree_on(comm, [&] {
    if (!comm.is_root()) return;
    // Under the output's lock, or, for a --validate-only run (which takes none and may write
    // the report of a job writing the dataset), a name of this process's own.
    const std::string tmp = validate_only ? fmt::format("{}.{}.tmp", path,
                                                        static_cast<long>(::getpid()))
                                          : path + ".tmp";
    {
      Json j = report.json();
      j["schedule"] = schedule_json(schedule);
      std::ofstream out(tmp);
      out << dump_json(j, 2) << "\n";
      if (!out) throw IoError(fmt::format("cannot write the gate report '{}'", path));
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0)
      throw IoError(fmt::format("cannot write the gate report '{}'", path));
  });
}

}  // namespace

DatasetMeta read_dataset_meta(const mpi::Comm& comm, const std::string& path) {
  h5::File f = h5::File::open(comm, path, h5::File::Mode::read);
  DatasetMeta m;
  mpi::agree_on(comm, [&] { m = read_meta(f); });
  return m;
}

const std::vector<std::string>& ingest_phases() {
  static const std::vector<std::string> phases{"parse", phase_name(IngestPhase::Kind::gates),
                                               phase_name(IngestPhase::Kind::write),
                                               phase_name(IngestPhase::Kind::commit)};
  return phases;
}

const char* phase_name(IngestPhase::Kind kind) {
  switch (kind) {
    case IngestPhase::Kind::gates: return "gates";
    case IngestPhase::Kind::write: return "write";
    case IngestPhase::Kind::commit: return "commit";
  }
  return "?";
}

IngestResult run_ingest(const mpi::Comm& comm, const IngestOptions& opts) {
  IngestResult res;
  check_options(comm, opts, output_exists(comm, opts.output));
  // Held from before an append reads the dataset it extends until the report is written, so
  // no other job writes the output meanwhile. Whether the output exists is looked at again
  // under it: another job may have published it meanwhile.
  OutputLock lock;
  if (!opts.validate_only) {
    lock = OutputLock::acquire(comm, opts.output, "ingest.output");
    check_options(comm, opts, output_exists(comm, opts.output));
  }

  // The existing dataset fixes schema, normalization and histogram edges for an append.
  DatasetMeta existing;
  if (opts.append) {
    h5::File f = h5::File::open(comm, opts.output, h5::File::Mode::read);
    mpi::agree_on(comm, [&] {
      existing = read_meta(f);
      check_appendable(f);
    });
  }
  ReferenceStats ref;
  DatasetMeta ref_meta;
  const bool have_ref = !opts.reference.empty();
  if (have_ref) {
    ref_meta = read_dataset_meta(comm, opts.reference);
    ref = reference_stats(ref_meta, opts.reference);
  }

  GateConfig gates = opts.gates;
  if (!gates.num_classes && opts.num_classes > 0) gates.num_classes = opts.num_classes;
  if (opts.append && !gates.features) gates.features = existing.cols;

  double t0 = MPI_Wtime();
  std::vector<SourceFile> sources;
  for (const auto& p : input_paths(opts)) {
    comm::progress("checksum of {}", p);
    sources.push_back(checksum_file(comm, p));
  }
  for (const auto& s : sources) res.input_bytes += s.bytes;
  // The join table: read by rank 0, broadcast, parsed on every rank; a source of the dataset.
  std::shared_ptr<const JoinTable> join;
  if (!opts.join.path.empty()) {
    comm::progress("join table {} (read by rank 0, broadcast)", opts.join.path);
    JoinOptions jo = opts.join;
    jo.delimiter = opts.csv.delimiter;
    join = load_join_table(comm, jo);
    sources.push_back(join->source());
  }
  if (opts.append && !opts.validate_only && already_appended(existing, sources)) {
    res.already_appended = true;
    res.meta = std::move(existing);
    return res;
  }
  // Units handed out dynamically; non-finite rows dropped and statistics taken per unit.
  detail::ParsedUnits parsed;
  {
    comm::progress("reading and parsing {}", fmt::join(input_paths(opts), ", "));
    const std::unique_ptr<UnitSource> units = open_units(comm, opts, join);
    // The work queue keeps 32 bytes per unit on rank 0 and the ranks exchange 24: bounded.
    constexpr std::int64_t kMaxUnits = std::int64_t{1} << 22;
    if (units->units() > kMaxUnits) {
      throw_error(ErrorKind::config,
                  fmt::format("ingest.unit_bytes = {} cuts {} into {} units, more than the {} "
                              "allowed: raise ingest.unit_bytes (0 picks 1-16 MiB)",
                              opts.unit_bytes, fmt::join(input_paths(opts), ", "), units->units(),
                              kMaxUnits),
                  /*agreed=*/true);  // every rank cut the same units
    }
    parsed = detail::parse_units(comm, *units, {.schedule = opts.schedule,
                                                .speculate = opts.speculate,
                                                .drop_nonfinite = gates.drop_nonfinite,
                                                .progress_s = opts.progress_s,
                                                .on_progress = opts.on_progress});
  }
  Table& table = parsed.table;
  const FeatureStats& stats = parsed.stats;
  res.schedule = parsed.schedule;
  res.seconds_parse = MPI_Wtime() - t0;
  // The parse's final figures, on the clock of its progress lines.
  comm::QueueProgress parse{{res.schedule.units, res.schedule.units, parsed.rows, 0}, 0,
                            parsed.seconds};
  for (const IngestRankStats& r : res.schedule.per_rank) parse.counts.reruns += r.reruns;
  const auto phase = [&](IngestPhase::Kind kind, double seconds_before) {
    if (!opts.on_phase) return;
    comm::progress("the {} phase begins: its line, the Prometheus file (rank 0)",
                   phase_name(kind));
    opts.on_phase({kind, table.cols, seconds_before, parse});
  };
  phase(IngestPhase::Kind::gates, res.seconds_parse);

  t0 = MPI_Wtime();
  comm::progress("quality gates (all-reduces)");
  res.report = evaluate_gates(comm, table, gates, stats, have_ref ? &ref : nullptr,
                              have_ref ? &ref_meta.histogram : nullptr, parsed.dropped,
                              parsed.runs);
  if (join) {
    join_missing_rule(gates, parsed.join_missing, parsed.join_missing_first, opts.csv.path,
                      join->path(), join->key(), res.report);
  }
  res.seconds_gates = MPI_Wtime() - t0;
  std::string report_path = opts.report;
  if (report_path.empty()) report_path = (opts.output.empty() ? "ingest" : opts.output) + ".gates.json";
  write_report(comm, report_path, res.report, res.schedule, opts.validate_only);
  if (!res.report.passed()) {
    GateError e(fmt::format("quality gates failed for {}; nothing was published (report: {}):\n{}",
                            fmt::join(input_paths(opts), ", "), report_path,
                            res.report.summary()));
    e.mark_agreed();  // the report is identical on every rank
    throw e;
  }
  if (opts.append && table.has_labels != existing.has_labels) {
    throw DataError(fmt::format("--append: '{}' {} labels but the new input {}",
                                opts.output, existing.has_labels ? "has" : "has no",
                                table.has_labels ? "has them" : "has none"));
  }
  res.rows_added = parsed.rows;
  if (opts.validate_only) return res;

  phase(IngestPhase::Kind::write, res.seconds_gates);
  comm::progress("statistics and histogram of the dataset (all-reduces)");
  t0 = MPI_Wtime();
  DatasetMeta meta;
  if (opts.append) {
    meta = existing;
    meta.stats = merge(existing.stats, stats);
    Histogram h = compute_histogram(comm, table, existing.histogram.lo, existing.histogram.hi,
                                    existing.histogram.bins);
    for (std::size_t i = 0; i < h.counts.size(); ++i) meta.histogram.counts[i] += h.counts[i];
    meta.rows = existing.rows + res.rows_added;
  } else {
    meta.cols = table.cols;
    meta.num_classes = opts.num_classes;
    meta.has_labels = table.has_labels;
    meta.feature_names = table.feature_names;
    meta.label_name = table.label_name;
    meta.stats = stats;
    meta.histogram = compute_histogram(comm, table, stats.min, stats.max, gates.psi_bins);
    meta.normalization = make_normalization(opts.normalize, stats);
    meta.rows = res.rows_added;
  }
  meta.provenance.sources.insert(meta.provenance.sources.end(), sources.begin(), sources.end());
  meta.provenance.tool_version = LOCUS_VERSION;
  meta.provenance.git_revision = LOCUS_GIT_REVISION;
  meta.provenance.config = opts.effective_config;
  apply_normalization(table, meta.normalization);

  // Each rank's units, ascending (adjacent ones merged); written in rounds of collective writes.
  std::vector<h5::RowRange> rows = parsed.file_rows;
  for (h5::RowRange& r : rows) r.begin += static_cast<std::uint64_t>(opts.append ? existing.rows : 0);
  comm::progress("creating dataset {}", opts.output);
  Publication pub(comm, opts.output, lock);
  // An append works on a copy, so a crash at any point leaves the original untouched.
  if (opts.append) {
    comm::progress("copy of {} for the append", opts.output);
    copy_file_parallel(comm, opts.output, pub.temp_path());
  }
  {
    h5::File file = opts.append ? h5::File::open(comm, pub.temp_path(), h5::File::Mode::read_write)
                                : h5::File::create(comm, pub.temp_path());
    comm::progress("collective write of dataset {}", opts.output);
    test_hook("ingest-before-write");  // a rank dies or stalls as its peers write collectively
    if (opts.append) {
      append_dataset(file, table, rows, static_cast<std::uint64_t>(meta.rows), meta);
    } else {
      write_dataset(file, table, rows, static_cast<std::uint64_t>(meta.rows), meta,
                    opts.chunk_rows, opts.compression);
    }
    res.compression = compression_of(h5::Dataset::open(file, "/features").id());
    test_hook("ingest-before-close");
    mpi::agree_on(comm, [&] { file.close(); });
  }
  test_hook("ingest-before-commit");
  phase(IngestPhase::Kind::commit, MPI_Wtime() - t0);
  comm::progress("commit of dataset {}", opts.output);
  pub.commit();
  test_hook("ingest-after-commit");
  res.seconds_write = MPI_Wtime() - t0;
  res.meta = std::move(meta);
  res.published = true;
  return res;
}

}  // namespace locus::io
