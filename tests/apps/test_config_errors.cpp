// The bad-config catalogue, table-driven over every key of every app (apps/common/config.cpp
// and each app's option registration): a wrong type, an empty value, a non-finite number, a
// key set twice in the INI file and an unknown section are ConfigErrors (exit 2) that name the
// key and the value; a value below every sane range is refused except by the keys listed in
// kNegativeAllowed. The app-level rows (missing file, directory, empty required paths, exit
// codes on every rank, nothing published) are in test_bad_input_app.py.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "locus-infer/infer_options.hpp"
#include "locus-ingest/ingest_options.hpp"
#include "locus-train/train_options.hpp"
#include "locus/comm/error.hpp"

using namespace locus;

namespace {

struct Key {
  std::string name, type;  // type as --help prints it: integer, number, true|false, a|b|c, text
};

// An app's options, registered on a Config with fresh settings each time (a refused value may
// be left in its target).
struct App {
  const char* name;
  std::function<std::shared_ptr<void>(app::Config&)> register_options;
};

template <class Settings>
App app_of(const char* name) {
  return {name, [](app::Config& c) {
            auto s = std::make_shared<Settings>();
            s->register_options(c);
            return std::shared_ptr<void>(s);
          }};
}

const std::vector<App>& apps() {
  static const std::vector<App> all{app_of<app::IngestSettings>("locus-ingest"),
                                    app_of<app::TrainSettings>("locus-train"),
                                    app_of<app::InferSettings>("locus-infer")};
  return all;
}

// The file options of an app, from its --help text ("  --key  help [type; default: x]").
std::vector<Key> keys_of(const App& a) {
  app::Config c(a.name, "test");
  const auto settings = a.register_options(c);
  std::vector<Key> keys;
  std::istringstream in(c.help_text());
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("  --", 0) != 0) continue;
    const std::string key = line.substr(4, line.find(' ', 4) - 4);
    if (key.find('.') == std::string::npos) continue;  // --config, --help, switches
    const auto open = line.rfind('[');
    const std::string type = line.substr(open + 1, line.find(';', open) - open - 1);
    if (type == "flag") continue;
    keys.push_back({key, type});
  }
  return keys;
}

// The ConfigError message of parsing `ini` and `args` with app a's options, or "" when
// accepted.
std::string parse_error(const App& a, const std::string& ini, std::vector<std::string> args) {
  app::Config c(a.name, "test");
  const auto settings = a.register_options(c);
  args.insert(args.begin(), a.name);
  std::vector<char*> argv;
  for (auto& s : args) argv.push_back(s.data());
  try {
    c.parse(static_cast<int>(argv.size()), argv.data(), ini);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string ini_line(const std::string& key, const std::string& value) {
  const auto dot = key.find('.');
  return "[" + key.substr(0, dot) + "]\n" + key.substr(dot + 1) + " = " + value + "\n";
}

bool is_choice(const Key& k) { return k.type.find('|') != std::string::npos && k.type != "true|false"; }
bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Keys where any negative value means something (train.device takes -1 only: refused here).
const std::set<std::string> kNegativeAllowed{
    "gates.rows_within_pct",   // -1 (< 0): rule off
    "gates.max_mean_shift",    // -1 (< 0): rule off
    "gates.max_psi",           // -1 (< 0): rule off
};

TEST(ConfigErrors, EveryKeyRefusesAWrongTypedValueNamingKeyAndValue) {
  int checked = 0;
  for (const App& a : apps()) {
    for (const Key& k : keys_of(a)) {
      if (k.type == "text") continue;  // any text is a text
      const std::string bad = "x7z";
      for (const bool in_file : {false, true}) {
        const std::string msg = in_file ? parse_error(a, ini_line(k.name, bad), {})
                                        : parse_error(a, "", {"--" + k.name + "=" + bad});
        EXPECT_TRUE(contains(msg, k.name) && contains(msg, bad))
            << a.name << " " << k.name << " (" << k.type << ") in " << (in_file ? "file" : "argv")
            << ": " << msg;
        if (is_choice(k)) {
          EXPECT_TRUE(contains(msg, "allowed values")) << msg;
        }
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(ConfigErrors, EveryNonTextKeyRefusesAnEmptyValue) {
  for (const App& a : apps()) {
    for (const Key& k : keys_of(a)) {
      if (k.type == "text") continue;
      // A choice says "= '' is not allowed: allowed values are ...", the others "is empty".
      const auto says_empty = [&](const std::string& m) {
        return contains(m, k.name) && !contains(m, "locus-empty") &&
               (is_choice(k) ? contains(m, "= ''") && contains(m, "allowed values")
                             : contains(m, "empty"));
      };
      const std::string msg = parse_error(a, "", {"--" + k.name + "="});
      EXPECT_TRUE(says_empty(msg)) << a.name << " " << k.name << ": " << msg;
      if (k.type == "true|false") continue;  // Boost reads "key =" in a file as true
      const std::string file_msg = parse_error(a, ini_line(k.name, ""), {});
      EXPECT_TRUE(says_empty(file_msg)) << a.name << " " << k.name << " in the file: " << file_msg;
    }
  }
}

TEST(ConfigErrors, EveryNumberRefusesNanAndInf) {
  for (const App& a : apps()) {
    for (const Key& k : keys_of(a)) {
      if (k.type != "number") continue;
      for (const char* v : {"nan", "inf", "-inf"}) {
        const std::string msg = parse_error(a, "", {"--" + k.name + "=" + v});
        EXPECT_TRUE(contains(msg, k.name) && contains(msg, v)) << k.name << "=" << v << ": " << msg;
      }
    }
  }
}

TEST(ConfigErrors, NegativeValuesAreOutOfRangeWhereTheyMeanNothing) {
  std::set<std::string> accepted;
  for (const App& a : apps()) {
    for (const Key& k : keys_of(a)) {
      if (k.type != "integer" && k.type != "number") continue;
      const std::string v = k.type == "integer" ? "-1000000000000" : "-1e12";
      const std::string msg = parse_error(a, "", {"--" + k.name + "=" + v});
      if (msg.empty()) {
        accepted.insert(k.name);
      } else {
        EXPECT_TRUE(contains(msg, k.name) && contains(msg, "out of range")) << msg;
      }
    }
  }
  // A key missing from the list lost its range check; one added needs a reason there.
  EXPECT_EQ(accepted, (std::set<std::string>{kNegativeAllowed.begin(), kNegativeAllowed.end()}));
}

TEST(ConfigErrors, DuplicatedKeysAndUnknownSectionsInTheFile) {
  for (const App& a : apps()) {
    const Key k = keys_of(a).front();
    const std::string twice = ini_line(k.name, "1") + k.name.substr(k.name.find('.') + 1) + " = 2\n";
    std::string msg = parse_error(a, twice, {});
    EXPECT_TRUE(contains(msg, k.name) && contains(msg, "more than once")) << msg;
    // Twice across two [section] headers of the same name, too.
    msg = parse_error(a, ini_line(k.name, "1") + ini_line(k.name, "2"), {});
    EXPECT_TRUE(contains(msg, k.name) && contains(msg, "more than once")) << msg;
    msg = parse_error(a, "[trian]\nepochs = 3\n", {});
    EXPECT_TRUE(contains(msg, "unknown section [trian]") && contains(msg, "did you mean [train]"))
        << msg;
    msg = parse_error(a, "[nonsense]\nx = 1\n", {});
    EXPECT_TRUE(contains(msg, "unknown section [nonsense]") && contains(msg, "known sections"))
        << msg;
  }
}

}  // namespace
