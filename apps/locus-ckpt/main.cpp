// locus-ckpt: lists, verifies, inspects, exports (as a model file for locus-infer) and compares
// locus-train checkpoints. An MPI app like the others: any rank count, every rank reading its
// share of each tensor.
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "ckpt_commands.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/app.hpp"

namespace {

using namespace locus;

constexpr const char* kUsage =
    "usage: locus-ckpt COMMAND ...\n"
    "  list DIR                   the checkpoints of a directory, newest first, each verified\n"
    "                             (* marks the one the `latest` pointer names)\n"
    "  verify FILE|DIR...         reads every tensor and checks its CRC-32; exit 3 if any fails\n"
    "  inspect FILE               metadata, tensors (shape, CRC-32) and verification\n"
    "  export CHECKPOINT OUT      the model of a verified checkpoint as a model file (locus-infer)\n"
    "  diff A B [--tolerance X]   per tensor: bitwise (X = 0, default) or |a - b| <= X;\n"
    "                             exit 1 when they differ\n"
    "Exit codes: 0 ok, 1 diff found differences, 2 usage, 3 damaged or unreadable checkpoint,\n"
    "5 output not writable.\n";

double parse_tolerance(const std::string& text) {
  double v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !(v >= 0) || !std::isfinite(v)) {
    throw ConfigError(fmt::format("--tolerance '{}' is not a non-negative number", text));
  }
  return v;
}

int ckpt_main(mpi::Comm& world, int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    if (world.is_root()) std::fputs(kUsage, stdout);
    return args.empty() ? exit_code::config : exit_code::ok;
  }
  const std::string cmd = args[0];
  args.erase(args.begin());
  double tolerance = 0;
  std::vector<std::string> operands;
  mpi::agree_on(world, [&] {
    for (std::size_t i = 0; i < args.size(); ++i) {
      if (args[i].rfind("--tolerance=", 0) == 0) {
        tolerance = parse_tolerance(args[i].substr(12));
      } else if (args[i] == "--tolerance") {
        if (i + 1 == args.size()) {
          throw ConfigError("--tolerance needs a value: diff A B --tolerance X (X >= 0)");
        }
        tolerance = parse_tolerance(args[++i]);
      } else if (args[i].rfind("--", 0) == 0) {
        throw ConfigError(fmt::format("unknown option '{}'\n{}", args[i], kUsage));
      } else {
        operands.push_back(args[i]);
      }
    }
    auto need = [&](std::size_t lo, std::size_t hi) {
      if (operands.size() < lo || operands.size() > hi) {
        throw ConfigError(fmt::format("'{}' takes {} operand{}, got {}\n{}", cmd,
                                      lo == hi ? std::to_string(lo) : fmt::format("{}+", lo),
                                      lo == 1 && hi == 1 ? "" : "s", operands.size(), kUsage));
      }
    };
    if (cmd == "list" || cmd == "inspect") need(1, 1);
    else if (cmd == "verify") need(1, 1u << 20);
    else if (cmd == "export" || cmd == "diff") need(2, 2);
    else throw ConfigError(fmt::format("unknown command '{}'\n{}", cmd, kUsage));
    if (cmd != "diff" && tolerance != 0) {
      throw ConfigError("--tolerance applies to diff only");
    }
  });
  if (cmd == "list") return app::ckpt_list(world, operands[0]);
  if (cmd == "verify") return app::ckpt_verify(world, operands);
  if (cmd == "inspect") return app::ckpt_inspect(world, operands[0]);
  if (cmd == "export") return app::ckpt_export(world, operands[0], operands[1]);
  return app::ckpt_diff(world, operands[0], operands[1], tolerance);
}

}  // namespace

int main(int argc, char** argv) {
  return locus::run_app(argc, argv,
                        [&](locus::mpi::Comm& world) { return ckpt_main(world, argc, argv); });
}
