// Config parsing over Boost.Program_options with locus' error messages.
#include "config.hpp"

#include <boost/program_options.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <type_traits>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"
#include "locus/comm/error.hpp"
#include "locus/comm/mpi.hpp"

namespace po = boost::program_options;

namespace locus::app {

struct Config::Impl {
  struct Entry {
    std::string key, help, type;
    std::function<std::string()> show;  // current value as text
    bool file_option = true;
  };
  std::string app, summary;
  po::options_description desc{"options"};
  std::vector<Entry> entries;
};

namespace {

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Stands for an empty value given as "--key=" (Program_options rejects empty arguments).
constexpr std::string_view kEmptyValue = "\x01locus-empty";

template <class T>
po::typed_value<T>* typed(T& target, const std::string& key,
                          const std::function<std::string(const T&)>& check) {
  auto* v = po::value<T>(&target)->default_value(target, "");
  if (check || std::is_floating_point_v<T>) {
    v->notifier([key, check](const T& value) {
      if constexpr (std::is_floating_point_v<T>) {
        // No option means anything by nan or inf; a range check written as `v > 0` would let
        // inf through (found by tests/apps/test_bad_input_app.py).
        if (!std::isfinite(value)) {
          throw ConfigError(fmt::format("option '{}' = '{}' is out of range: must be a finite "
                                        "number", key, fmt::to_string(value)));
        }
      }
      if (!check) return;
      const std::string allowed = check(value);
      if (!allowed.empty()) {
        throw ConfigError(fmt::format("option '{}' = '{}' is out of range: {}", key,
                                      fmt::to_string(value), allowed));
      }
    });
  }
  return v;
}

// Boost.Program_options fills placeholders such as %value% into its messages until none is
// left, so a value that itself contains one (`lr = %value%`) made what() loop forever (found by
// tests/fuzz/fuzz_config). Such an error is described without Boost's text.
bool has_placeholder(std::string_view s) {
  for (const std::string_view t :
       {"%value%", "%original_token%", "%canonical_option%", "%option%", "%prefix%"}) {
    if (s.find(t) != std::string_view::npos) return true;
  }
  return false;
}

std::string describe(const po::error& e, const std::vector<std::string>& args,
                     const std::string& text, const std::string& app) {
  const std::string hint = dynamic_cast<const po::invalid_option_value*>(&e) != nullptr
                               ? fmt::format("'{} --help' shows each option's type", app)
                               : fmt::format("'{} --help' lists every option", app);
  const auto* named = dynamic_cast<const po::error_with_option_name*>(&e);
  if (named != nullptr &&
      (has_placeholder(text) || std::any_of(args.begin(), args.end(), has_placeholder))) {
    return fmt::format("option '{}' could not be parsed, and its value contains a placeholder "
                       "of Boost.Program_options (%value%, %option%, ...) that keeps its error "
                       "message from being printed; {}", named->get_option_name(), hint);
  }
  return fmt::format("{}; {}", e.what(), hint);
}

std::string format_double(double v) {
  std::string s = fmt::format("{}", v);
  return s;
}

}  // namespace

void add_watchdog_option(Config& c, const std::string& key, double& target) {
  c.add(key, target,
        "abort the job (exit 70; exit 5 when stuck closing an output) when a rank makes no "
        "progress for this many seconds, naming the rank and the operation it waits in (0: "
        "off; time stopped by SIGSTOP does not count)",
        in_range(0.0, 1e9));
}

namespace {

bool same_file(const std::string& a, const std::string& b) {
  if (a.empty() || b.empty()) return false;
  std::error_code ec_a, ec_b;
  const auto full_a = std::filesystem::weakly_canonical(std::filesystem::absolute(a), ec_a);
  const auto full_b = std::filesystem::weakly_canonical(std::filesystem::absolute(b), ec_b);
  return ec_a || ec_b ? a == b : full_a == full_b;
}

[[noreturn]] void shared_path(const NamedPath& a, const NamedPath& b) {
  throw ConfigError(fmt::format("{} = '{}' and {} = '{}' name one file: one would overwrite the "
                                "other; give them different paths",
                                a.key, a.path, b.key, b.path));
}

}  // namespace

void refuse_shared_paths(const std::vector<NamedPath>& written,
                         const std::vector<NamedPath>& others) {
  for (std::size_t i = 0; i < written.size(); ++i) {
    for (std::size_t j = i + 1; j < written.size(); ++j) {
      if (same_file(written[i].path, written[j].path)) shared_path(written[i], written[j]);
    }
    for (const NamedPath& other : others) {
      if (same_file(written[i].path, other.path)) shared_path(written[i], other);
    }
  }
}

void add_progress_option(Config& c, const std::string& key, double& target) {
  c.add(key, target,
        "rank 0 prints a progress line this often, in seconds: units and rows done, rate, "
        "time left; then a line as each phase after the units begins (0: no lines)",
        in_range(0.0, 1e9));
}

comm::ProgressTicker::Sink progress_sink(const mpi::Comm& comm, std::string verb,
                                         std::string measure, io::ProgressFile& file) {
  if (!comm.is_root()) return {};
  return [verb = std::move(verb), measure = std::move(measure),
          &file](const comm::QueueProgress& p) {
    fmt::print("{}\n", comm::describe(p, verb, measure));
    std::fflush(stdout);
    file.update(p);
  };
}

void add_prometheus_option(Config& c, const std::string& key, std::string& target) {
  c.add(key, target,
        "Prometheus text file rank 0 rewrites (temporary file + rename) with every progress "
        "line, as each phase begins and when the job ends: the phase, units and rows done, "
        "rate, time left, re-runs, for "
        "node_exporter's textfile collector (empty: none): a .prom name in a directory that "
        "exists on rank 0's node, one per job (the name without .prom labels every series "
        "locus_job); the job holds the file's output lock, so a second job naming it is "
        "refused");
}

const std::vector<std::string>& pipeline_sections() {
  static const std::vector<std::string> sections{"data",  "ingest", "gates",      "model",
                                                 "optim", "train",  "loader",     "eval",
                                                 "checkpoint", "infer", "pipeline"};
  return sections;
}

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  std::size_t best_d = std::string::npos;
  for (const auto& c : candidates) {
    const std::size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  // Close enough to be a typo: at most a third of the word, and at least one edit allowed.
  if (best_d == std::string::npos || best_d > std::max<std::size_t>(2, word.size() / 3)) return "";
  return best;
}

Config::Config(std::string app, std::string summary) : impl_(std::make_unique<Impl>()) {
  impl_->app = std::move(app);
  impl_->summary = std::move(summary);
}

Config::~Config() = default;

Config& Config::add(const std::string& key, std::string& target, const std::string& help,
                    std::function<std::string(const std::string&)> check) {
  auto* value = typed<std::string>(target, key, {});
  value->notifier([key, check, &target](const std::string& v) {
    if (v == kEmptyValue) target.clear();
    if (!check) return;
    const std::string allowed = check(target);
    if (!allowed.empty()) {
      throw ConfigError(fmt::format("option '{}' = '{}' is not allowed: {}", key, target, allowed));
    }
  });
  impl_->desc.add_options()(key.c_str(), value, help.c_str());
  impl_->entries.push_back({key, help, "text", [&target] { return target; }});
  return *this;
}

Config& Config::add(const std::string& key, std::int64_t& target, const std::string& help,
                    std::function<std::string(std::int64_t)> check) {
  std::function<std::string(const std::int64_t&)> c;
  if (check) c = [check](const std::int64_t& v) { return check(v); };
  impl_->desc.add_options()(key.c_str(), typed<std::int64_t>(target, key, c), help.c_str());
  impl_->entries.push_back({key, help, "integer", [&target] { return std::to_string(target); }});
  return *this;
}

Config& Config::add(const std::string& key, double& target, const std::string& help,
                    std::function<std::string(double)> check) {
  std::function<std::string(const double&)> c;
  if (check) c = [check](const double& v) { return check(v); };
  impl_->desc.add_options()(key.c_str(), typed<double>(target, key, c), help.c_str());
  impl_->entries.push_back({key, help, "number", [&target] { return format_double(target); }});
  return *this;
}

Config& Config::add(const std::string& key, bool& target, const std::string& help) {
  impl_->desc.add_options()(key.c_str(), po::value<bool>(&target)->default_value(target, ""),
                            help.c_str());
  impl_->entries.push_back(
      {key, help, "true|false", [&target] { return std::string(target ? "true" : "false"); }});
  return *this;
}

Config& Config::add_choice(const std::string& key, std::string& target,
                           const std::vector<std::string>& allowed, const std::string& help) {
  auto check = [allowed](const std::string& v) -> std::string {
    if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return "";
    std::string text = fmt::format("allowed values are {}", fmt::join(allowed, ", "));
    if (auto near = closest(v, allowed); !near.empty())
      text += fmt::format(" (did you mean '{}'?)", near);
    return text;
  };
  add(key, target, help, check);
  impl_->entries.back().type = fmt::format("{}", fmt::join(allowed, "|"));
  return *this;
}

Config& Config::flag(const std::string& name, bool& target, const std::string& help) {
  impl_->desc.add_options()(name.c_str(), po::bool_switch(&target), help.c_str());
  impl_->entries.push_back({name, help, "flag", [&target] { return std::string(target ? "true" : "false"); }, false});
  return *this;
}

Config::Action Config::parse(int argc, char** argv, const std::string& default_config_text) {
  std::vector<std::string> known;
  for (const auto& e : impl_->entries) known.push_back(e.key);
  auto unknown_key = [&](const std::string& key, const std::string& where) {
    std::string msg = fmt::format("unknown option '{}' in {}", key, where);
    if (auto near = closest(key, known); !near.empty())
      msg += fmt::format("; did you mean '{}'?", near);
    else
      msg += fmt::format("; '{} --help' lists every option", impl_->app);
    return ConfigError(msg);
  };

  po::options_description cli_only;
  bool help = false, print = false;
  std::string config;
  cli_only.add_options()("help,h", po::bool_switch(&help), "")("print-config",
                                                               po::bool_switch(&print), "")(
      "config", po::value<std::string>(&config), "");
  po::options_description all;
  all.add(impl_->desc).add(cli_only);

  // "--key=" means an empty value, and a repeated "--key=value" overrides the earlier one (as
  // scripts that append overrides expect); Program_options accepts neither, so rewrite.
  std::vector<std::string> args;
  std::map<std::string, std::size_t> last;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    const auto eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      const std::string key = a.substr(0, eq);
      if (eq + 1 == a.size()) a = key + "=" + std::string(kEmptyValue);
      if (auto it = last.find(key); it != last.end()) args[it->second].clear();
      last[key] = args.size();
    }
    args.push_back(std::move(a));
  }
  std::erase_if(args, [](const std::string& a) { return a.empty(); });

  po::variables_map vm;
  std::string text = default_config_text;
  std::string where = "the built-in default config";
  try {
    // No prefix guessing: `--train.epoch=3` must be a typo with a suggestion, not a silent
    // match of train.epochs (nor ambiguous once two keys share the prefix).
    namespace cls = po::command_line_style;
    auto parsed = po::command_line_parser(args)
                      .options(all)
                      .style(cls::default_style & ~cls::allow_guessing)
                      .allow_unregistered()
                      .run();
    for (const auto& o : parsed.options) {
      if (o.unregistered) {
        std::string key = o.string_key;
        if (key.empty() && !o.original_tokens.empty()) key = o.original_tokens.front();
        throw unknown_key(key, "the command line");
      }
    }
    po::store(parsed, vm);
    // Look for --config before reading the file, then store the file (command line wins,
    // because Program_options keeps the first value stored for each key).
    if (vm.count("config")) config = vm["config"].as<std::string>();
    if (!config.empty()) {
      std::error_code ec;
      if (std::filesystem::is_directory(config, ec)) {
        throw ConfigError(fmt::format("config file '{}' is a directory; give --config an INI "
                                      "file (configs/ has examples)", config));
      }
      std::ifstream in(config);
      if (!in) {
        throw ConfigError(fmt::format("cannot read config file '{}'; check the path given to "
                                      "--config", config));
      }
      std::stringstream ss;
      ss << in.rdbuf();
      if (in.bad()) {
        throw ConfigError(fmt::format("cannot read config file '{}'; check the path given to "
                                      "--config", config));
      }
      text = ss.str();
      where = fmt::format("config file '{}'", config);
      config_path_ = config;
    }
    std::istringstream in(text);
    auto file = po::parse_config_file(in, impl_->desc, /*allow_unregistered=*/true);
    for (const auto& o : file.options) {
      if (!o.unregistered) continue;
      // One pipeline config serves every app: sections of other apps are skipped here and
      // checked by their own app; a section nobody knows is an error.
      const std::string section = o.string_key.substr(0, o.string_key.find('.'));
      const bool ours = std::any_of(known.begin(), known.end(), [&](const std::string& k) {
        return k.compare(0, section.size() + 1, section + ".") == 0;
      });
      const auto& all_sections = pipeline_sections();
      const bool other_app = std::find(all_sections.begin(), all_sections.end(), section) !=
                             all_sections.end();
      if (ours || !other_app) {
        if (!ours && o.string_key.find('.') != std::string::npos) {
          std::string msg = fmt::format("unknown section [{}] in {}", section, where);
          if (auto near = closest(section, all_sections); !near.empty())
            msg += fmt::format("; did you mean [{}]?", near);
          throw ConfigError(msg + fmt::format("; known sections: {}", fmt::join(all_sections, ", ")));
        }
        throw unknown_key(o.string_key, where);
      }
    }
    po::store(file, vm);
    po::notify(vm);
  } catch (const po::error& e) {
    const auto* named = dynamic_cast<const po::error_with_option_name*>(&e);
    const bool safe = !has_placeholder(text) && std::none_of(args.begin(), args.end(), has_placeholder);
    if (named != nullptr && safe) {
      std::string key = named->get_option_name();
      key.erase(0, key.find_first_not_of('-'));
      if (dynamic_cast<const po::multiple_occurrences*>(&e) != nullptr) {
        // The command line's repeats were folded above: the repeat is in the file.
        throw ConfigError(fmt::format("option '{}' is set more than once in {}; keep one line "
                                      "for it (a --{}=... on the command line overrides the "
                                      "file)", key, where, key));
      }
      const std::string what = e.what();
      // Boost says "the argument ('') ..." for an empty value on the command line (here the
      // kEmptyValue stand-in) and "the argument for option ..." for one in the file.
      if (dynamic_cast<const po::validation_error*>(&e) != nullptr &&
          (what.find(kEmptyValue) != std::string::npos || what.find("('')") != std::string::npos ||
           what.find("the argument for option") != std::string::npos)) {
        std::string type = "a value";
        for (const auto& entry : impl_->entries)
          if (entry.key == key) type = entry.type;
        throw ConfigError(fmt::format("option '{}' is empty; it takes {} ('{} --help' shows each "
                                      "option's type and default)",
                                      key, type == "integer" ? "an integer"
                                           : type == "number" ? "a number" : type,
                                      impl_->app));
      }
    }
    throw ConfigError(describe(e, args, text, impl_->app));
  }
  if (help) return Action::help;
  if (print) return Action::print_config;
  return Action::run;
}

std::string Config::help_text() const {
  std::string out = fmt::format("usage: {} [--config FILE] [--section.key=value ...]\n\n{}\n\n",
                                impl_->app, impl_->summary);
  out += "  --config FILE          INI config file (default: the built-in default config)\n";
  out += "  --print-config         print the effective config and exit\n";
  out += "  --help                 this text\n";
  for (const auto& e : impl_->entries) {
    out += fmt::format("  --{:<24} {} [{}; default: {}]\n", e.key, e.help, e.type,
                       e.file_option ? e.show() : "off");
  }
  return out;
}

std::string Config::effective_ini() const {
  std::map<std::string, std::vector<const Impl::Entry*>> sections;
  for (const auto& e : impl_->entries)
    if (e.file_option) sections[e.key.substr(0, e.key.find('.'))].push_back(&e);
  std::string out;
  for (const auto& [section, entries] : sections) {
    out += fmt::format("[{}]\n", section);
    for (const auto* e : entries)
      out += fmt::format("{} = {}\n", e->key.substr(e->key.find('.') + 1), e->show());
    out += "\n";
  }
  return out;
}

std::function<std::string(std::int64_t)> at_least(std::int64_t lo) {
  return [lo](std::int64_t v) { return v >= lo ? std::string() : fmt::format("must be >= {}", lo); };
}

std::function<std::string(std::int64_t)> in_range(std::int64_t lo, std::int64_t hi) {
  return [lo, hi](std::int64_t v) {
    return v >= lo && v <= hi ? std::string() : fmt::format("must be in [{}, {}]", lo, hi);
  };
}

std::function<std::string(double)> positive() {
  return [](double v) { return v > 0 ? std::string() : std::string("must be > 0"); };
}

std::function<std::string(double)> non_negative() {
  return [](double v) { return v >= 0 ? std::string() : std::string("must be >= 0"); };
}

std::function<std::string(double)> in_range(double lo, double hi) {
  return [lo, hi](double v) {
    return v >= lo && v <= hi ? std::string() : fmt::format("must be in [{}, {}]", lo, hi);
  };
}

std::vector<std::string> parse_word_list(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::vector<std::int64_t> parse_int_list(const std::string& key, const std::string& text) {
  std::vector<std::int64_t> out;
  for (const auto& w : parse_word_list(text)) {
    std::int64_t v = 0;
    auto [p, ec] = std::from_chars(w.data(), w.data() + w.size(), v);
    if (ec != std::errc() || p != w.data() + w.size()) {
      throw ConfigError(fmt::format("option '{}' = '{}': '{}' is not an integer; expected a "
                                    "comma-separated list such as 784,256,128,10", key, text, w));
    }
    out.push_back(v);
  }
  return out;
}

bool parse_or_answer(Config& config, const mpi::Comm& world, int argc, char** argv,
                     const std::string& default_text, const std::function<void()>& convert) {
  Config::Action action{};
  mpi::agree_on(world, [&] {
    action = config.parse(argc, argv, default_text);
    if (action == Config::Action::run && convert) convert();
  });
  if (action == Config::Action::help && world.is_root()) {
    std::fputs(config.help_text().c_str(), stdout);
  }
  if (action == Config::Action::print_config && world.is_root()) {
    std::fputs(config.effective_ini().c_str(), stdout);
  }
  return action == Config::Action::run;
}

}  // namespace locus::app
