// The ingest pipeline: parse shares → non-finite policy → stats → gates → publish.
#include "locus/io/ingest.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <fstream>

#include <fmt/format.h>
#include <mpi.h>

#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/config.hpp"
#include "locus/io/checksum.hpp"
#include "locus/io/publish.hpp"

namespace locus::io {

namespace {

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

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
    if (o.validate_only || o.append) return;
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

Table read_input(const mpi::Comm& comm, const IngestOptions& o) {
  if (o.source == IngestOptions::Source::csv) return read_csv(comm, o.csv);
  return read_idx(comm, o.idx);
}

void write_report(const mpi::Comm& comm, const std::string& path, const GateReport& report) {
  mpi::agree_on(comm, [&] {
    if (!comm.is_root()) return;
    const std::string tmp = path + ".tmp";
    {
      std::ofstream out(tmp);
      out << report.to_json(2) << "\n";
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

IngestResult run_ingest(const mpi::Comm& comm, const IngestOptions& opts) {
  IngestResult res;
  const bool output_exists = !opts.output.empty() && file_exists(opts.output);
  check_options(comm, opts, output_exists);

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

  double t0 = MPI_Wtime();
  std::vector<SourceFile> sources;
  for (const auto& p : input_paths(opts)) sources.push_back(checksum_file(comm, p));
  for (const auto& s : sources) res.input_bytes += s.bytes;
  if (opts.append && !opts.validate_only && already_appended(existing, sources)) {
    res.already_appended = true;
    res.meta = std::move(existing);
    return res;
  }
  Table table = read_input(comm, opts);
  res.seconds_parse = MPI_Wtime() - t0;

  t0 = MPI_Wtime();
  GateConfig gates = opts.gates;
  if (!gates.num_classes && opts.num_classes > 0) gates.num_classes = opts.num_classes;
  if (opts.append && !gates.features) gates.features = existing.cols;
  const std::int64_t dropped = handle_nonfinite(comm, table, gates.drop_nonfinite);
  const FeatureStats stats = compute_stats(comm, table);
  res.report = evaluate_gates(comm, table, gates, stats, have_ref ? &ref : nullptr,
                              have_ref ? &ref_meta.histogram : nullptr, dropped);
  res.seconds_gates = MPI_Wtime() - t0;
  std::string report_path = opts.report;
  if (report_path.empty()) report_path = (opts.output.empty() ? "ingest" : opts.output) + ".gates.json";
  write_report(comm, report_path, res.report);
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
  res.rows_added = comm.allreduce(table.rows(), MPI_SUM);
  if (opts.validate_only) return res;

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

  const auto first_row =
      static_cast<std::uint64_t>(comm.exscan_sum(table.rows())) +
      static_cast<std::uint64_t>(opts.append ? existing.rows : 0);
  Publication pub(comm, opts.output);
  // An append works on a copy, so a crash at any point leaves the original untouched.
  if (opts.append) copy_file_parallel(comm, opts.output, pub.temp_path());
  {
    h5::File file = opts.append ? h5::File::open(comm, pub.temp_path(), h5::File::Mode::read_write)
                                : h5::File::create(comm, pub.temp_path());
    if (opts.append) {
      append_dataset(file, table, first_row, static_cast<std::uint64_t>(meta.rows), meta);
    } else {
      write_dataset(file, table, first_row, static_cast<std::uint64_t>(meta.rows), meta,
                    opts.chunk_rows);
    }
    test_hook("ingest-before-close");
    mpi::agree_on(comm, [&] { file.close(); });
  }
  test_hook("ingest-before-commit");
  pub.commit();
  test_hook("ingest-after-commit");
  res.seconds_write = MPI_Wtime() - t0;
  res.meta = std::move(meta);
  res.published = true;
  return res;
}

}  // namespace locus::io
