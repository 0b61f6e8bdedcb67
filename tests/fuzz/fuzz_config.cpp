// Fuzzes the configuration path of every app (apps/common/config.cpp and the apps' option
// mapping): the INI text and `--section.key=value` overrides, through parse_or_answer and the
// same conversion to library options that each app's main runs.
// Input: the INI text, then optionally a line "%%" and one command-line argument per line.
// Arguments naming --config are dropped (they would read other files of this machine).
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_support.hpp"
#include "locus-infer/infer_options.hpp"
#include "locus-ingest/ingest_options.hpp"
#include "locus-train/train_options.hpp"

namespace {

struct Input {
  std::string ini;
  std::vector<std::string> args{"locus-fuzz"};
};

Input split_input(std::string_view in) {
  Input out;
  const std::size_t sep = in.starts_with("%%\n") ? 0 : in.find("\n%%\n");
  if (sep == std::string_view::npos) {
    out.ini = std::string(in);
    return out;
  }
  out.ini = std::string(in.substr(0, sep));
  std::string_view rest = in.substr(sep + (sep == 0 ? 3 : 4));
  while (!rest.empty()) {
    const std::size_t nl = std::min(rest.find('\n'), rest.size());
    const std::string_view arg = rest.substr(0, nl);
    rest.remove_prefix(std::min(nl + 1, rest.size()));
    if (arg.substr(0, std::min(arg.find('='), arg.size())) == "--config") continue;
    out.args.emplace_back(arg);
  }
  return out;
}

std::vector<char*> argv_of(std::vector<std::string>& args) {
  std::vector<char*> v;
  for (auto& a : args) v.push_back(a.data());
  v.push_back(nullptr);
  return v;
}

// True when the app accepted the configuration.
template <class Settings, class Convert>
bool run_app(const char* name, Input in, Convert&& convert) {
  locus::app::Config config(name, "fuzz");
  Settings settings;
  settings.register_options(config);
  std::vector<char*> argv = argv_of(in.args);
  return locus::fuzz::parses([&] {
    locus::app::parse_or_answer(config, locus::fuzz::world(), static_cast<int>(in.args.size()),
                                argv.data(), in.ini, [&] { convert(settings, config); });
  });
}

// Every app, as its main parses and converts: false when any refused the configuration.
bool run_all(const Input& in) {
  bool ok = run_app<locus::app::IngestSettings>("locus-ingest", in, [](auto& s, auto& c) {
    s.to_options(c);
  });
  ok &= run_app<locus::app::InferSettings>("locus-infer", in, [](auto& s, auto& c) {
    s.to_options(c);
  });
  Input train = in;
  train.args = locus::app::resume_alias(static_cast<int>(in.args.size()),
                                        argv_of(train.args).data());
  ok &= run_app<locus::app::TrainSettings>("locus-train", train, [](auto& s, auto&) {
    s.to_options();
    s.checkpoint_options();
  });
  return ok;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  locus::fuzz::world();
  // The embedded default config must be accepted by every app, or the harness tests nothing.
  if (!run_all(Input{locus::app::default_pipeline_config(), {"locus-fuzz"}}))
    locus::fuzz::unexpected("baseline", "the default pipeline config is refused");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  run_all(split_input(std::string_view(reinterpret_cast<const char*>(data), size)));
  return 0;
}
