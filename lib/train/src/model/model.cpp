// Model spec parsing and validation, the flat parameter layout, and seeded initialisation.
#include "locus/train/model/model.hpp"

#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <numbers>

#include "model/hash.hpp"
#include "locus/comm/error.hpp"

namespace locus::train {

namespace {

constexpr int kMaxWidth = 1 << 24;  // keeps every [out, in] and [batch, width] index in range

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

}  // namespace

Activation parse_activation(std::string_view name) {
  if (name == "relu") return Activation::relu;
  if (name == "gelu") return Activation::gelu;
  if (name == "tanh") return Activation::tanh;
  throw ConfigError(fmt::format("unknown activation '{}': use relu, gelu (tanh approximation) "
                                "or tanh", name));
}

Init parse_init(std::string_view name) {
  if (name == "he") return Init::he;
  if (name == "xavier") return Init::xavier;
  throw ConfigError(fmt::format("unknown init '{}': use he or xavier", name));
}

std::string_view to_string(Activation a) noexcept {
  switch (a) {
    case Activation::relu: return "relu";
    case Activation::gelu: return "gelu";
    case Activation::tanh: return "tanh";
  }
  return "?";
}

std::string_view to_string(Init i) noexcept {
  return i == Init::he ? "he" : "xavier";
}

std::vector<int> parse_widths(std::string_view text) {
  std::vector<int> widths;
  std::string_view rest = text;
  while (true) {
    const std::size_t comma = rest.find(',');
    const std::string_view item = trim(rest.substr(0, comma));
    int value = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), value);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size() || value < 1 ||
        value > kMaxWidth) {
      throw ConfigError(fmt::format(
          "model widths '{}': entry {} ('{}') is not an integer in [1, {}]: give "
          "comma-separated layer widths, input first and output last, e.g. 784,256,128,10",
          text, widths.size() + 1, item, kMaxWidth));
    }
    widths.push_back(value);
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  if (widths.size() < 2) {
    throw ConfigError(fmt::format("model widths '{}' name {} layer width(s): give at least the "
                                  "input and output widths, e.g. 784,10",
                                  text, widths.size()));
  }
  return widths;
}

std::string format_widths(std::span<const int> widths) {
  return fmt::format("{}", fmt::join(widths, ","));
}

void validate(const ModelSpec& spec) {
  if (spec.widths.size() < 2) {
    throw ConfigError(fmt::format("model has {} width(s) ({}): give at least the input and "
                                  "output widths, e.g. 784,256,10",
                                  spec.widths.size(), format_widths(spec.widths)));
  }
  for (std::size_t i = 0; i < spec.widths.size(); ++i) {
    if (spec.widths[i] < 1 || spec.widths[i] > kMaxWidth) {
      throw ConfigError(fmt::format("model widths {}: width {} of entry {} is outside [1, {}]",
                                    format_widths(spec.widths), spec.widths[i], i, kMaxWidth));
    }
  }
  if (!(spec.dropout >= 0.0f && spec.dropout < 1.0f)) {
    throw ConfigError(fmt::format("dropout {} is outside [0, 1): give the probability of "
                                  "dropping a hidden unit, e.g. 0.1 (0 disables dropout)",
                                  spec.dropout));
  }
}

std::size_t TensorInfo::size() const noexcept {
  std::size_t n = 1;
  for (std::size_t d : shape) n *= d;
  return n;
}

ParamLayout::ParamLayout(std::span<const int> widths) : widths_(widths.begin(), widths.end()) {
  LOCUS_ASSERT(widths_.size() >= 2, "a layout needs at least input and output widths");
  std::size_t offset = 0;
  for (std::size_t l = 0; l + 1 < widths_.size(); ++l) {
    LayerLayout ly;
    ly.in = widths_[l];
    ly.out = widths_[l + 1];
    LOCUS_ASSERT(ly.in >= 1 && ly.out >= 1, "layer widths must be positive");
    ly.weight_offset = offset;
    ly.bias_offset = offset + static_cast<std::size_t>(ly.out) * static_cast<std::size_t>(ly.in);
    offset = ly.end();
    layers_.push_back(ly);
  }
  size_ = offset;
}

const LayerLayout& ParamLayout::layer(int l) const {
  LOCUS_ASSERT(l >= 0 && l < num_layers(), fmt::format("layer {} of {}", l, num_layers()));
  return layers_[static_cast<std::size_t>(l)];
}

std::string ParamLayout::weight_name(int l) { return fmt::format("layers.{}.weight", l); }
std::string ParamLayout::bias_name(int l) { return fmt::format("layers.{}.bias", l); }

std::size_t ParamLayout::begin_of(LayerRange r) const {
  LOCUS_ASSERT(r.first >= 0 && r.first < r.end && r.end <= num_layers(),
               fmt::format("layers [{}, {}) of {}", r.first, r.end, num_layers()));
  return layer(r.first).begin();
}

std::size_t ParamLayout::end_of(LayerRange r) const {
  LOCUS_ASSERT(r.first >= 0 && r.first < r.end && r.end <= num_layers(),
               fmt::format("layers [{}, {}) of {}", r.first, r.end, num_layers()));
  return layer(r.end - 1).end();
}

std::vector<TensorInfo> ParamLayout::tensors() const {
  std::vector<TensorInfo> out;
  for (int l = 0; l < num_layers(); ++l) {
    const LayerLayout& ly = layer(l);
    const auto in = static_cast<std::size_t>(ly.in);
    const auto o = static_cast<std::size_t>(ly.out);
    out.push_back({weight_name(l), ly.weight_offset, {o, in}, l});
    out.push_back({bias_name(l), ly.bias_offset, {o}, l});
  }
  return out;
}

void init_params(const ModelSpec& spec, const ParamLayout& layout, std::span<float> params) {
  init_params(spec, layout, layout.all_layers(), params);
}

void init_params(const ModelSpec& spec, const ParamLayout& layout, LayerRange held,
                 std::span<float> params) {
  const std::size_t begin = layout.begin_of(held);
  LOCUS_ASSERT(params.size() == layout.end_of(held) - begin,
               fmt::format("params hold {} floats, layers [{}, {}) have {}", params.size(),
                           held.first, held.end, layout.end_of(held) - begin));
  const std::uint64_t seed_key = detail::mix64(spec.seed ^ detail::kInitDomain);
  for (int l = held.first; l < held.end; ++l) {
    const LayerLayout& ly = layout.layer(l);
    const std::uint64_t layer_key =
        detail::mix64(seed_key + static_cast<std::uint64_t>(l) * detail::kGolden);
    std::span<float> w = params.subspan(ly.weight_offset - begin,
                                        static_cast<std::size_t>(ly.out) * ly.in);
    const double fan_in = ly.in;
    const double fan_out = ly.out;
    for (std::size_t i = 0; i < w.size(); ++i) {
      const std::uint64_t h = detail::mix64(layer_key + (i + 1) * detail::kGolden);
      // Two 32-bit uniforms: u1 in (0, 1] (log-safe), u2 in [0, 1).
      const double u1 = (static_cast<double>(h >> 32) + 1.0) / 4294967296.0;
      const double u2 = static_cast<double>(h & 0xffffffffull) / 4294967296.0;
      double value = 0.0;
      if (spec.init == Init::he) {
        const double normal = std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
        value = normal * std::sqrt(2.0 / fan_in);
      } else {
        const double a = std::sqrt(6.0 / (fan_in + fan_out));
        value = (2.0 * u2 - 1.0) * a;
      }
      w[i] = static_cast<float>(value);
    }
    for (float& b : params.subspan(ly.bias_offset - begin, static_cast<std::size_t>(ly.out))) {
      b = 0.0f;
    }
  }
}

namespace {
ModelSpec validated(ModelSpec spec) {
  validate(spec);
  return spec;
}
}  // namespace

Mlp::Mlp(ModelSpec spec) : spec_(validated(std::move(spec))), layout_(spec_.widths) {
  held_ = layout_.all_layers();
  params_.assign(layout_.size(), 0.0f);
  init_params(spec_, layout_, held_, params_);
}

Mlp::Mlp(ModelSpec spec, LayerRange held)
    : spec_(validated(std::move(spec))), layout_(spec_.widths), held_(held) {
  if (held.first < 0 || held.first >= held.end || held.end > layout_.num_layers()) {
    throw ConfigError(fmt::format("a model of {} layers (widths {}) has no layers [{}, {}): "
                                  "give a non-empty range inside [0, {})",
                                  layout_.num_layers(), format_widths(spec_.widths), held.first,
                                  held.end, layout_.num_layers()));
  }
  offset_ = layout_.begin_of(held_);
  params_.assign(layout_.end_of(held_) - offset_, 0.0f);
  init_params(spec_, layout_, held_, params_);
}

}  // namespace locus::train
