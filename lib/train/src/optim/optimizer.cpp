// Optimizer options, validation, the shared base class and the factory.
#include "locus/train/optim/optimizer.hpp"

#include <fmt/format.h>

#include <cmath>

#include "locus/comm/error.hpp"
#include "optim/optimizers.hpp"

namespace locus::train {

OptimizerKind parse_optimizer_kind(std::string_view name) {
  if (name == "sgd") return OptimizerKind::sgd;
  if (name == "adam") return OptimizerKind::adam;
  if (name == "adamw") return OptimizerKind::adamw;
  throw ConfigError(fmt::format("unknown optimizer '{}': use sgd, adam or adamw", name));
}

std::string_view to_string(OptimizerKind kind) noexcept {
  switch (kind) {
    case OptimizerKind::sgd: return "sgd";
    case OptimizerKind::adam: return "adam";
    case OptimizerKind::adamw: return "adamw";
  }
  return "?";
}

namespace {

void require(bool ok, std::string_view key, double value, std::string_view rule) {
  if (!ok) {
    throw ConfigError(fmt::format("optimizer option {} = {} is invalid: it must be {}", key,
                                  value, rule));
  }
}

}  // namespace

void validate(const OptimizerOptions& o) {
  require(std::isfinite(o.weight_decay) && o.weight_decay >= 0.0, "weight_decay",
          o.weight_decay, ">= 0");
  if (o.kind == OptimizerKind::sgd) {
    require(std::isfinite(o.momentum) && o.momentum >= 0.0, "momentum", o.momentum, ">= 0");
    require(std::isfinite(o.dampening) && o.dampening >= 0.0 && o.dampening <= 1.0, "dampening",
            o.dampening, "in [0, 1]");
    if (o.nesterov && (o.momentum <= 0.0 || o.dampening != 0.0)) {
      throw ConfigError(fmt::format("nesterov momentum needs momentum > 0 and dampening = 0 "
                                    "(got momentum {}, dampening {}): set both or drop nesterov",
                                    o.momentum, o.dampening));
    }
  } else {
    require(o.beta1 >= 0.0 && o.beta1 < 1.0, "beta1", o.beta1, "in [0, 1)");
    require(o.beta2 >= 0.0 && o.beta2 < 1.0, "beta2", o.beta2, "in [0, 1)");
    require(std::isfinite(o.eps) && o.eps >= 0.0, "eps", o.eps, ">= 0");
  }
}

Optimizer::Optimizer(const OptimizerOptions& options, std::size_t size)
    : options_(options), size_(size) {
  validate(options_);
}

std::vector<NamedSpan<const float>> Optimizer::state() const {
  // The derived classes only hand out views, so this reuses them read-only.
  std::vector<NamedSpan<const float>> out;
  for (auto& s : const_cast<Optimizer*>(this)->state()) out.push_back({s.name, s.data});
  return out;
}

void Optimizer::set_steps(std::int64_t steps) {
  if (steps < 0) {
    throw DataError(fmt::format("optimizer step counter {} is negative: the checkpoint is "
                                "corrupt",
                                steps));
  }
  steps_ = steps;
}

void Optimizer::step(std::span<float> params, std::span<const float> grads, double lr,
                     float grad_scale) {
  update(params, grads, lr, grad_scale, 0, size_);
  finish_step();
}

void Optimizer::check_sizes(std::span<float> params, std::span<const float> grads,
                            std::size_t begin, std::size_t end) const {
  LOCUS_ASSERT(params.size() == size_ && grads.size() == size_,
               fmt::format("optimizer for {} parameters got {} params and {} grads", size_,
                           params.size(), grads.size()));
  LOCUS_ASSERT(begin <= end && end <= size_,
               fmt::format("optimizer range [{}, {}) outside [0, {})", begin, end, size_));
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& options, std::size_t size) {
  validate(options);
  if (options.kind == OptimizerKind::sgd) return detail::make_sgd(options, size);
  return detail::make_adam(options, size);
}

}  // namespace locus::train
