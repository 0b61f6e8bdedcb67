// Precision names (model/precision.hpp).
#include "locus/train/model/precision.hpp"

#include <fmt/format.h>

#include "locus/comm/error.hpp"

namespace locus::train {

Precision parse_precision(std::string_view name, std::string_view key) {
  if (name == "fp32") return Precision::fp32;
  if (name == "tf32") return Precision::tf32;
  if (name == "bf16") return Precision::bf16;
  throw ConfigError(fmt::format("{} = '{}' is unknown: use fp32, tf32 or bf16", key, name));
}

std::string_view to_string(Precision p) noexcept {
  switch (p) {
    case Precision::fp32: return "fp32";
    case Precision::tf32: return "tf32";
    case Precision::bf16: return "bf16";
  }
  return "?";
}

}  // namespace locus::train
