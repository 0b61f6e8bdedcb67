// The Prometheus file of a job over a work queue -- locus-infer's `infer.prometheus`,
// locus-ingest's `ingest.prometheus` -- for node_exporter's textfile collector, so a site's
// dashboards follow a scoring or an ingest as they follow a training (train.prometheus). Rank 0
// rewrites it whole (io::replace_file) at the start, with every progress report
// (comm::ProgressTicker) and a last time when the job ends, then saying it no longer runs. The
// job holds the file's output lock, so a second job naming it is refused.
#pragma once

#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/comm/queue_progress.hpp"
#include "locus/io/publish.hpp"

namespace locus::io {

// The value of the `locus_job` label that every series of locus's Prometheus files carries
// (train.prometheus, infer.prometheus, ingest.prometheus): the file's name without its
// directory and without a trailing ".prom". node_exporter's textfile collector refuses one
// series in two files, and names in its directory are unique, so jobs that name their files
// apart can share a node's directory.
std::string prometheus_job(std::string_view path);
// s as a label value of the text exposition format: backslash, double quote and newline
// escaped.
std::string prometheus_label_value(std::string_view s);

class ProgressFile {
 public:
  ProgressFile() = default;  // no file
  // Collective over comm. path empty: no file. Otherwise checks that rank 0 may create files in
  // path's directory (an agreed IoError naming `key`, e.g. "infer.prometheus", otherwise), takes
  // the output lock of path (a ConfigError when another job holds it) and writes the first
  // version: running, no figures yet. `app` names the series: locus_<app>_... . `phases`, if
  // any, are the job's phases in order: the file then says which one the job is in, from the
  // first (a state set: locus_<app>_phase{phase="..."}, 1 for the current one, 0 for the others).
  ProgressFile(const mpi::Comm& comm, std::string path, std::string key, std::string app,
               std::vector<std::string> phases = {});
  ProgressFile(const ProgressFile&) = delete;
  ProgressFile& operator=(const ProgressFile&) = delete;
  // Rank 0: the last version (not running) with the last figures, if finish() did not write it.
  ~ProgressFile();

  // Rank 0 (a no-op elsewhere and without a file): rewrites the file with p. A failed write is
  // a warning on standard error, once; the job goes on and later rewrites try again.
  void update(const comm::QueueProgress& p);
  // Rank 0: the job enters `name`, one of the phases given at construction, with the figures
  // of the work done before it (the last progress report may be older); rewrites the file.
  void phase(std::string_view name, const comm::QueueProgress& p);
  // Rank 0: the last version with the final figures, not running.
  void finish(const comm::QueueProgress& p);

  // The file's text (Prometheus exposition format 0.0.4): whether the job runs, when, the
  // phase it is in (when phases are given) and the figures of p (none when p is null: before
  // the first report); every series labelled locus_job="<job>".
  static std::string text(std::string_view app, std::string_view job,
                          const comm::QueueProgress* p, bool running, double unix_time,
                          std::span<const std::string> phases = {},
                          std::string_view current_phase = {});

 private:
  void write(bool running);

  std::string path_, key_, app_;
  std::vector<std::string> phases_;
  std::string phase_;  // the current one of phases_ ("" without phases)
  bool root_ = false, warned_ = false, finished_ = true;
  std::optional<comm::QueueProgress> last_;
  std::optional<OutputLock> lock_;
};

}  // namespace locus::io
