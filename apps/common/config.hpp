// Config files and command lines for every app: INI sections map to dotted keys
// ([train] lr = 0.1 ≡ --train.lr=0.1), the command line overrides the file, --help lists every
// option with its default, --print-config prints the effective config as INI. Unknown keys,
// wrong types and out-of-range values are ConfigErrors naming the key, the value and what is
// allowed, with a suggestion for typos. Only apps/ sees Boost.Program_options.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/comm/queue_progress.hpp"
#include "locus/io/progress_file.hpp"

namespace locus::app {

class Config {
 public:
  enum class Action { run, help, print_config };

  Config(std::string app, std::string summary);
  ~Config();
  Config(const Config&) = delete;
  Config& operator=(const Config&) = delete;

  // Registers option `key` ("section.name") bound to `target`, whose current value is the
  // default. A check returns an empty string when the value is fine, else what is allowed.
  Config& add(const std::string& key, std::string& target, const std::string& help,
              std::function<std::string(const std::string&)> check = {});
  Config& add(const std::string& key, std::int64_t& target, const std::string& help,
              std::function<std::string(std::int64_t)> check = {});
  Config& add(const std::string& key, double& target, const std::string& help,
              std::function<std::string(double)> check = {});
  Config& add(const std::string& key, bool& target, const std::string& help);
  // One of a fixed set of words.
  Config& add_choice(const std::string& key, std::string& target,
                     const std::vector<std::string>& allowed, const std::string& help);
  // Command-line-only switch (e.g. --validate-only); not part of the config file.
  Config& flag(const std::string& name, bool& target, const std::string& help);

  // Parses `--config FILE` (or the embedded default text when no file is given) and then the
  // command line. Throws ConfigError. Returns what the user asked for.
  Action parse(int argc, char** argv, const std::string& default_config_text = "");

  std::string help_text() const;
  // The effective configuration as INI, every key with its value.
  std::string effective_ini() const;
  // The config file used ("" for the embedded default).
  const std::string& config_path() const { return config_path_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string config_path_;
};

// Collective over world: every rank parses the command line and the config (`default_text` when
// no --config is given) and then runs `convert` (the app's settings → options), all inside one
// agreement, so a bad key or value is the same ConfigError on every rank. --help and
// --print-config are answered on rank 0. Returns true when the app should go on and run.
bool parse_or_answer(Config& config, const mpi::Comm& world, int argc, char** argv,
                     const std::string& default_text, const std::function<void()>& convert);

// Range/choice checks for add(): return "" when fine, else a description of what is allowed.
std::function<std::string(std::int64_t)> at_least(std::int64_t lo);
std::function<std::string(std::int64_t)> in_range(std::int64_t lo, std::int64_t hi);
std::function<std::string(double)> positive();
std::function<std::string(double)> non_negative();
std::function<std::string(double)> in_range(double lo, double hi);

// The progress watchdog (lib/comm/watchdog.hpp): `<app section>.watchdog_s` in every app, in
// seconds without progress before the job is aborted (exit 70); 0: off. 30 minutes by default:
// far beyond any healthy gap between two progress marks (a step, an evaluation batch, a
// checkpoint tensor, an inference unit, one collective write), and far below the time limits
// a stuck job would otherwise burn.
inline constexpr double kWatchdogDefaultS = 1800;
void add_watchdog_option(Config& c, const std::string& key, double& target);

// The progress line of locus-infer and locus-ingest (lib/comm/queue_progress.hpp):
// `<app section>.progress_s`, seconds between two lines; 0: none, and no phase lines either.
// 30 s by default: a run of a few seconds prints no progress line (only the lines of the phases
// after its units), a scoring of hours one every half minute for `tail -f`.
inline constexpr double kProgressDefaultS = 30;
void add_progress_option(Config& c, const std::string& key, double& target);
// Rank 0's sink of the progress reports: prints each as a line ("<verb>: ..." on stdout,
// flushed) and rewrites `file` (the app's Prometheus file) with it; empty on other ranks.
comm::ProgressTicker::Sink progress_sink(const mpi::Comm& comm, std::string verb,
                                         std::string measure, io::ProgressFile& file);
// A path an app writes or reads and the key that set it ("" names none).
struct NamedPath {
  std::string path;
  std::string key;
};
// Local: ConfigError naming both keys when two of `written` name one file (as resolved from the
// working directory), or one of `written` names one of `others` (files the app reads or
// writes that must not be overwritten), before anything is written.
void refuse_shared_paths(const std::vector<NamedPath>& written,
                         const std::vector<NamedPath>& others = {});

// `<app section>.prometheus`: the Prometheus file of locus-infer and locus-ingest
// (io::ProgressFile), rewritten with every progress line and as each phase begins.
void add_prometheus_option(Config& c, const std::string& key, std::string& target);

// Every section of the pipeline config file, across all apps.
const std::vector<std::string>& pipeline_sections();

// The closest of `candidates` to `word` by edit distance, or "" if none is close.
std::string closest(const std::string& word, const std::vector<std::string>& candidates);

// Parses "784,256,128,10" into integers; ConfigError naming the key on bad input.
std::vector<std::int64_t> parse_int_list(const std::string& key, const std::string& text);
// Parses "a.csv,b.csv" into trimmed words (empty text → empty list).
std::vector<std::string> parse_word_list(const std::string& text);

}  // namespace locus::app
