// Pipeline configuration: options and their parsing, the cut of the layers into stages
// (balanced by FLOPs and parameter bytes, or explicit), and the GPipe / 1F1B operation orders.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <limits>

#include "locus/comm/error.hpp"
#include "locus/train/pipeline/pipeline.hpp"

namespace locus::train {

PipelineSchedule parse_pipeline_schedule(std::string_view name) {
  if (name == "gpipe") return PipelineSchedule::gpipe;
  if (name == "1f1b") return PipelineSchedule::one_f_one_b;
  throw ConfigError(
      fmt::format("train.schedule = '{}' is unknown: use gpipe (all forwards, then "
                  "all backwards) or 1f1b (bounded activation memory)",
                  name));
}

std::string_view to_string(PipelineSchedule schedule) noexcept {
  return schedule == PipelineSchedule::gpipe ? "gpipe" : "1f1b";
}

void validate(const PipelineOptions& o) {
  if (o.micro_batches < 1) {
    throw ConfigError(
        fmt::format("train.micro_batches = {} is invalid: use 1 or more (each "
                    "replica's rows of a batch are split into this many)",
                    o.micro_batches));
  }
}

std::vector<int> parse_stage_boundaries(std::string_view text) {
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t comma = text.find(',', pos);
    if (comma == std::string_view::npos) comma = text.size();
    std::string_view item = text.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    int v = 0;
    const auto [end, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    if (item.empty() || ec != std::errc() || end != item.data() + item.size()) {
      throw ConfigError(
          fmt::format("train.stage_boundaries = '{}' is not a comma-separated "
                      "list of layer indices (e.g. 3,6): fix '{}'",
                      text, item));
    }
    out.push_back(v);
    pos = comma + 1;
  }
  return out;
}

namespace {

double layer_flops(const LayerLayout& ly, int l) {
  const double mac = static_cast<double>(ly.in) * ly.out;
  return (l == 0 ? 4.0 : 6.0) * mac;  // forward 2, weight gradient 2, input gradient 2
}

std::vector<int> checked_boundaries(const ParamLayout& layout, int stages, std::span<const int> b) {
  const int layers = layout.num_layers();
  const auto text = fmt::format("{}", fmt::join(b, ","));
  if (static_cast<int>(b.size()) != stages - 1) {
    throw ConfigError(fmt::format(
        "train.stage_boundaries = {} gives {} stages but train.pipeline_stages = {}: give {} "
        "boundaries (the first layer of stages 1..{}), or leave it empty to balance "
        "automatically",
        text, b.size() + 1, stages, stages - 1, stages - 1));
  }
  int prev = 0;
  for (const int v : b) {
    if (v <= prev || v >= layers) {
      throw ConfigError(fmt::format(
          "train.stage_boundaries = {} is invalid for a model of {} layers: boundaries must "
          "increase strictly within 1..{} (every stage keeps at least one layer)",
          text, layers, layers - 1));
    }
    prev = v;
  }
  return {b.begin(), b.end()};
}

// Minimises the most expensive stage over every contiguous cut (dynamic programming over
// prefixes; L and S are small). cost[l] is layer l's share of FLOPs plus its share of bytes.
std::vector<int> balanced_boundaries(const std::vector<double>& cost, int stages) {
  const int layers = static_cast<int>(cost.size());
  std::vector<double> prefix(static_cast<std::size_t>(layers) + 1, 0.0);
  for (int l = 0; l < layers; ++l) prefix[l + 1] = prefix[l] + cost[static_cast<std::size_t>(l)];
  const auto span_cost = [&](int a, int b) { return prefix[b] - prefix[a]; };
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const auto idx = [&](int s, int j) { return static_cast<std::size_t>(s) * (layers + 1) + j; };
  // best[s][j]: the cheapest max-stage cost of layers [0, j) in s + 1 stages; cut[s][j]: where
  // its last stage starts.
  std::vector<double> best(static_cast<std::size_t>(stages) * (layers + 1), kInf);
  std::vector<int> cut(best.size(), 0);
  for (int j = 1; j <= layers; ++j) best[idx(0, j)] = span_cost(0, j);
  for (int s = 1; s < stages; ++s) {
    for (int j = s + 1; j <= layers; ++j) {
      for (int i = s; i < j; ++i) {
        const double c = std::max(best[idx(s - 1, i)], span_cost(i, j));
        // Strictly cheaper beyond rounding: equal cuts keep the earliest boundary.
        if (c < best[idx(s, j)] * (1.0 - 1e-12)) {
          best[idx(s, j)] = c;
          cut[idx(s, j)] = i;
        }
      }
    }
  }
  std::vector<int> b(static_cast<std::size_t>(stages) - 1);
  int j = layers;
  for (int s = stages - 1; s >= 1; --s) {
    j = cut[idx(s, j)];
    b[static_cast<std::size_t>(s) - 1] = j;
  }
  return b;
}

}  // namespace

StagePartition::StagePartition(const ParamLayout& layout, int stages,
                               std::span<const int> boundaries)
    : automatic_(boundaries.empty()) {
  const int layers = layout.num_layers();
  if (stages < 1) {
    throw ConfigError(fmt::format("train.pipeline_stages = {} is invalid: use 1 or more", stages));
  }
  if (stages > layers) {
    throw ConfigError(fmt::format(
        "train.pipeline_stages = {} but model.widths = {} has {} layer{}: every stage needs at "
        "least one layer; use at most {} stages or a deeper model",
        stages, format_widths(layout.widths()), layers, layers == 1 ? "" : "s", layers));
  }
  std::vector<double> flops(static_cast<std::size_t>(layers));
  double total_flops = 0, total_bytes = 0;
  for (int l = 0; l < layers; ++l) {
    flops[static_cast<std::size_t>(l)] = layer_flops(layout.layer(l), l);
    total_flops += flops[static_cast<std::size_t>(l)];
    total_bytes += static_cast<double>(layout.layer(l).end() - layout.layer(l).begin());
  }
  std::vector<int> cuts;
  if (!automatic_ || stages == 1) {
    cuts = checked_boundaries(layout, stages, boundaries);
  } else {
    std::vector<double> cost(static_cast<std::size_t>(layers));
    for (int l = 0; l < layers; ++l) {
      const auto& ly = layout.layer(l);
      cost[static_cast<std::size_t>(l)] = flops[static_cast<std::size_t>(l)] / total_flops +
                                          static_cast<double>(ly.end() - ly.begin()) / total_bytes;
    }
    cuts = balanced_boundaries(cost, stages);
  }
  cuts.push_back(layers);
  int first = 0;
  for (const int end : cuts) {
    StageRange r;
    r.first_layer = first;
    r.end_layer = end;
    r.begin = layout.layer(first).begin();
    r.end = layout.layer(end - 1).end();
    for (int l = first; l < end; ++l) r.flops_per_sample += flops[static_cast<std::size_t>(l)];
    ranges_.push_back(r);
    first = end;
  }
}

const StageRange& StagePartition::stage(int s) const {
  LOCUS_ASSERT(s >= 0 && s < stages(), fmt::format("stage {} of {}", s, stages()));
  return ranges_[static_cast<std::size_t>(s)];
}

std::vector<int> StagePartition::boundaries() const {
  std::vector<int> b;
  for (std::size_t s = 1; s < ranges_.size(); ++s) b.push_back(ranges_[s].first_layer);
  return b;
}

namespace {

// Human-readable quantities: (628, 1000, "", "FLOP") -> "628 FLOP", (16.79e6, 1000, "",
// " params") -> "16.79M params", (67108864, 1024, "i", "B") -> "64.00 MiB".
std::string human(double v, double base, const char* infix, const char* unit) {
  const char* prefixes[] = {"", "k", "M", "G", "T"};
  int p = 0;
  while (v >= base && p < 4) {
    v /= base;
    ++p;
  }
  const char* space = unit[0] == ' ' ? "" : " ";
  if (p == 0) return fmt::format("{:.0f}{}{}", v, space, unit);
  const char* prefix = p == 1 && base == 1024.0 ? "K" : prefixes[p];
  return fmt::format("{:.2f}{}{}{}{}", v, space, prefix, infix, unit);
}

}  // namespace

std::string StagePartition::describe() const {
  double total = 0;
  for (const auto& r : ranges_) total += r.flops_per_sample;
  std::string out = fmt::format(
      "pipeline partition ({}, {} stage{}, boundaries {}):",
      automatic_ ? "balanced by FLOPs and parameter bytes" : "explicit", stages(),
      stages() == 1 ? "" : "s",
      ranges_.size() > 1 ? fmt::format("{}", fmt::join(boundaries(), ",")) : std::string("none"));
  for (std::size_t s = 0; s < ranges_.size(); ++s) {
    const StageRange& r = ranges_[s];
    out += fmt::format(
        "\n  stage {}: layers {}-{} ({} layer{}, {}, {}, {}/sample, {:.1f}% of the FLOPs)", s,
        r.first_layer, r.end_layer - 1, r.layers(), r.layers() == 1 ? "" : "s",
        human(static_cast<double>(r.size()), 1000.0, "", " params"),
        human(static_cast<double>(r.param_bytes()), 1024.0, "i", "B"),
        human(r.flops_per_sample, 1000.0, "", "FLOP"),
        total > 0 ? 100.0 * r.flops_per_sample / total : 0.0);
  }
  return out;
}

std::vector<PipelineOp> pipeline_ops(PipelineSchedule schedule, int stages, int stage,
                                     int micro_batches) {
  LOCUS_ASSERT(stages >= 1 && stage >= 0 && stage < stages && micro_batches >= 1,
               fmt::format("pipeline_ops(stages {}, stage {}, micro_batches {})", stages, stage,
                           micro_batches));
  std::vector<PipelineOp> ops;
  const auto fwd = [&](int m) { ops.push_back({PipelineOp::forward, m}); };
  const auto bwd = [&](int m) { ops.push_back({PipelineOp::backward, m}); };
  if (schedule == PipelineSchedule::gpipe) {
    for (int m = 0; m < micro_batches; ++m) fwd(m);
    for (int m = 0; m < micro_batches; ++m) bwd(m);
    return ops;
  }
  // 1F1B: stage s runs ahead by the S-1-s forwards its successors need to fill the pipeline,
  // then each backward frees the activations the next forward takes.
  const int warmup = std::min(stages - 1 - stage, micro_batches);
  for (int m = 0; m < warmup; ++m) fwd(m);
  for (int i = 0; i + warmup < micro_batches; ++i) {
    fwd(warmup + i);
    bwd(i);
  }
  for (int m = micro_batches - warmup; m < micro_batches; ++m) bwd(m);
  return ops;
}

int peak_live(std::span<const PipelineOp> ops) {
  int live = 0, peak = 0;
  for (const PipelineOp& op : ops) {
    live += op.kind == PipelineOp::forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

}  // namespace locus::train
