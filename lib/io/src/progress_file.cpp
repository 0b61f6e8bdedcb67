// A work-queue job's Prometheus file: figures of its progress, rewritten whole by rank 0.
#include "locus/io/progress_file.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>

#include "locus/comm/agree.hpp"
#include "locus/comm/error.hpp"
#include "locus/io/text_file.hpp"

namespace locus::io {

namespace {

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string failure(const std::string& path, const std::string& key, int err) {
  return fmt::format("cannot write the Prometheus file '{}': {}; set {} to a writable path (a "
                     "node_exporter textfile directory), or to empty to disable it",
                     path, std::strerror(err), key);
}

}  // namespace

std::string prometheus_job(std::string_view path) {
  const std::size_t slash = path.find_last_of('/');
  std::string_view name = slash == std::string_view::npos ? path : path.substr(slash + 1);
  constexpr std::string_view kExt = ".prom";
  if (name.size() > kExt.size() && name.substr(name.size() - kExt.size()) == kExt) {
    name.remove_suffix(kExt.size());
  }
  return std::string(name);
}

std::string prometheus_label_value(std::string_view s) {
  std::string out;
  for (const char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

ProgressFile::ProgressFile(const mpi::Comm& comm, std::string path, std::string key,
                           std::string app, std::vector<std::string> phases)
    : path_(std::move(path)), key_(std::move(key)), app_(std::move(app)),
      phases_(std::move(phases)), root_(comm.is_root()) {
  if (!phases_.empty()) phase_ = phases_.front();
  if (path_.empty()) return;
  mpi::agree_on(comm, [&] {
    if (!root_) return;
    if (const int err = directory_writable(path_)) throw IoError(failure(path_, key_, err));
  });
  lock_.emplace(OutputLock::acquire(comm, path_, key_, {}, OutputLock::Writer::rank_0));
  mpi::agree_on(comm, [&] {
    if (!root_) return;
    if (const int err =
            replace_file(path_, text(app_, prometheus_job(path_), nullptr, true, unix_now(),
                                     phases_, phase_))) {
      throw IoError(failure(path_, key_, err));
    }
  });
  finished_ = false;
}

ProgressFile::~ProgressFile() {
  if (finished_) return;
  try {
    write(false);
  } catch (...) {  // out of memory formatting the text: the file keeps saying it runs
  }
}

void ProgressFile::update(const comm::QueueProgress& p) {
  if (path_.empty() || !root_) return;
  last_ = p;
  write(true);
}

void ProgressFile::phase(std::string_view name, const comm::QueueProgress& p) {
  LOCUS_ASSERT(std::find(phases_.begin(), phases_.end(), name) != phases_.end(),
               "a phase the Prometheus file was not given");
  if (path_.empty() || !root_) return;
  phase_ = name;
  last_ = p;
  write(true);
}

void ProgressFile::finish(const comm::QueueProgress& p) {
  if (path_.empty() || !root_ || finished_) return;
  last_ = p;
  write(false);
  finished_ = true;
}

void ProgressFile::write(bool running) {
  if (path_.empty() || !root_) return;
  const comm::QueueProgress* figures = last_ ? &*last_ : nullptr;
  const int err = replace_file(path_, text(app_, prometheus_job(path_), figures, running,
                                           unix_now(), phases_, phase_));
  if (err != 0 && !warned_) {  // told once; later rewrites still try (the disk may recover)
    warned_ = true;
    std::fprintf(stderr, "warning: %s; the job goes on and tries again with its next report\n",
                 failure(path_, key_, err).c_str());
    std::fflush(stderr);
  }
}

std::string ProgressFile::text(std::string_view app, std::string_view job,
                               const comm::QueueProgress* figures, bool running,
                               double unix_time, std::span<const std::string> phases,
                               std::string_view current_phase) {
  std::string out;
  const std::string label = prometheus_label_value(job);
  const auto series = [&](std::string_view name, const char* type, std::string_view help,
                          double v) {
    if (!std::isfinite(v)) return;
    out += fmt::format("# HELP locus_{0}_{1} {2}\n# TYPE locus_{0}_{1} {3}\n"
                       "locus_{0}_{1}{{locus_job=\"{5}\"}} {4}\n",
                       app, name, help, type, v, label);
  };
  series("running", "gauge",
         "1 from the job's start, 0 once it has ended (a job killed or aborted leaves 1: watch "
         "last_update_timestamp_seconds).",
         running ? 1 : 0);
  series("last_update_timestamp_seconds", "gauge", "Unix time rank 0 last rewrote this file.",
         unix_time);
  if (!phases.empty()) {
    out += fmt::format("# HELP locus_{0}_phase The phase the job is in, or ended in: 1 for it, "
                       "0 for the others (a state set).\n# TYPE locus_{0}_phase gauge\n",
                       app);
    for (const std::string& ph : phases) {
      out += fmt::format("locus_{}_phase{{locus_job=\"{}\",phase=\"{}\"}} {}\n", app, label,
                         prometheus_label_value(ph), ph == current_phase ? 1 : 0);
    }
  }
  if (figures == nullptr) return out;
  const comm::QueueProgress& p = *figures;
  const comm::WorkQueue::Counts& c = p.counts;
  series("elapsed_seconds", "gauge", "Seconds since the first unit was handed out.", p.seconds);
  series("units", "gauge", "Units of work in the job.", static_cast<double>(c.units));
  series("units_done", "gauge", "Units some rank finished first (their results count).",
         static_cast<double>(c.won));
  if (p.total_amount > 0) {
    series("rows", "gauge", "Rows the job has to do.", static_cast<double>(p.total_amount));
  }
  series("rows_done", "gauge", "Rows of the units done.", static_cast<double>(c.amount));
  series("rows_per_second", "gauge", "Rows done per second since the start.",
         p.seconds > 0 ? static_cast<double>(c.amount) / p.seconds : 0.0);
  series("reruns_total", "counter", "Speculative re-runs of units started on idle ranks.",
         static_cast<double>(c.reruns));
  if (running && comm::seconds_left(p) >= 0) {
    series("seconds_left", "gauge", "Seconds left if the rate so far holds.",
           comm::seconds_left(p));
  }
  return out;
}

}  // namespace locus::io
