// Optimizers fused into one pass over the parameter buffer (PyTorch semantics), with their
// state in buffers of the parameter layout, exposed by name for checkpoints.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace locus::train {

//   sgd:   torch.optim.SGD(momentum, dampening, nesterov, weight_decay)
//   adam:  torch.optim.Adam  (weight_decay is L2: added to the gradient)
//   adamw: torch.optim.AdamW (weight_decay is decoupled: p *= 1 - lr * weight_decay)
enum class OptimizerKind { sgd, adam, adamw };
OptimizerKind parse_optimizer_kind(std::string_view name);  // "sgd" | "adam" | "adamw"
std::string_view to_string(OptimizerKind kind) noexcept;

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::sgd;
  double weight_decay = 0.0;
  double momentum = 0.0;   // sgd
  double dampening = 0.0;  // sgd
  bool nesterov = false;   // sgd: needs momentum > 0 and dampening == 0 (as PyTorch)
  double beta1 = 0.9;      // adam, adamw
  double beta2 = 0.999;
  double eps = 1e-8;
};
void validate(const OptimizerOptions& options);  // throws ConfigError

// A named view of one state buffer (same layout as the parameters).
template <class T> struct NamedSpan {
  std::string name;
  std::span<T> data;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // One fused pass over params: reads grads * grad_scale (grad_scale is where gradient
  // clipping's factor goes, see clip.hpp; grads are not modified), updates params and the
  // state in place, then increments steps(). lr comes from the schedule for this step.
  // Same as update(params, grads, lr, grad_scale, 0, size()) followed by finish_step().
  void step(std::span<float> params, std::span<const float> grads, double lr,
            float grad_scale = 1.0f);

  // The same update restricted to elements [begin, end) of the (full-size) buffers, as step
  // number steps() + 1. Lets a trainer update each layer's slice from on_grads_ready, while
  // its gradient is still in cache (or right after that slice's all-reduce completes), when
  // nothing needs the whole gradient first -- i.e. without clipping. Every element must be
  // updated exactly once before finish_step().
  virtual void update(std::span<float> params, std::span<const float> grads, double lr,
                      float grad_scale, std::size_t begin, std::size_t end) = 0;
  void finish_step() noexcept { ++steps_; }

  // State for checkpoints, by PyTorch's names: sgd with momentum "momentum_buffer"; adam and
  // adamw "exp_avg", "exp_avg_sq"; plain sgd has none. Restore by writing into the spans
  // and calling set_steps().
  virtual std::vector<NamedSpan<float>> state() = 0;
  std::vector<NamedSpan<const float>> state() const;

  std::int64_t steps() const noexcept { return steps_; }  // steps taken so far
  void set_steps(std::int64_t steps);
  const OptimizerOptions& options() const noexcept { return options_; }
  std::size_t size() const noexcept { return size_; }

 protected:
  Optimizer(const OptimizerOptions& options, std::size_t size);
  void check_sizes(std::span<float> params, std::span<const float> grads, std::size_t begin,
                   std::size_t end) const;

  OptimizerOptions options_;
  std::size_t size_ = 0;
  std::int64_t steps_ = 0;
};

// An optimizer for `size` parameters (ParamLayout::size()), state zeroed, steps() == 0.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerOptions& options, std::size_t size);

}  // namespace locus::train
