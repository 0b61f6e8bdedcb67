// Adam (L2 weight decay) and AdamW (decoupled weight decay) in one pass over the parameters,
// with torch.optim.Adam/AdamW's bias correction and operation order (single-tensor path).
#include <cmath>
#include <vector>

#include "optim/optimizers.hpp"

namespace locus::train::detail {

namespace {

struct AdamArgs {
  float* p;
  const float* g;
  float* m;
  float* v;
  std::size_t n;
  float scale;             // gradient clipping factor
  float decay;             // adam: L2 coefficient
  float decay_factor;      // adamw: 1 - lr * weight_decay
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float bias2_sqrt;        // sqrt(1 - beta2^t)
  float eps;
  float neg_step_size;     // -lr / (1 - beta1^t)
};

enum class Decay { none, l2, decoupled };

template <Decay kDecay>
[[gnu::always_inline]] inline void adam_loop(const AdamArgs& a) noexcept {
  float* __restrict p = a.p;
  const float* __restrict g = a.g;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  for (std::size_t i = 0; i < a.n; ++i) {
    float grad = g[i] * a.scale;
    float param = p[i];
    if constexpr (kDecay == Decay::l2) grad = grad + a.decay * param;  // grad.add(p, wd)
    if constexpr (kDecay == Decay::decoupled) param = param * a.decay_factor;
    const float mi = m[i] * a.beta1 + a.one_minus_beta1 * grad;        // exp_avg
    const float vi = v[i] * a.beta2 + a.one_minus_beta2 * grad * grad;  // addcmul_
    m[i] = mi;
    v[i] = vi;
    const float denom = std::sqrt(vi) / a.bias2_sqrt + a.eps;
    p[i] = param + a.neg_step_size * mi / denom;                        // addcdiv_
  }
}

LOCUS_TRAIN_CLONES void adam_kernel(const AdamArgs& a, Decay decay) noexcept {
  switch (decay) {
    case Decay::none: adam_loop<Decay::none>(a); break;
    case Decay::l2: adam_loop<Decay::l2>(a); break;
    case Decay::decoupled: adam_loop<Decay::decoupled>(a); break;
  }
}

class Adam final : public Optimizer {
 public:
  Adam(const OptimizerOptions& options, std::size_t size)
      : Optimizer(options, size), exp_avg_(size, 0.0f), exp_avg_sq_(size, 0.0f) {}

  void update(std::span<float> params, std::span<const float> grads, double lr,
              float grad_scale, std::size_t begin, std::size_t end) override {
    check_sizes(params, grads, begin, end);
    const OptimizerOptions& o = options_;
    const double t = static_cast<double>(steps_ + 1);
    // Scalars in double, then rounded to float once, as PyTorch does with Python floats.
    const double bias1 = 1.0 - std::pow(o.beta1, t);
    const double bias2 = 1.0 - std::pow(o.beta2, t);
    Decay decay = Decay::none;
    if (o.weight_decay != 0.0) {
      decay = o.kind == OptimizerKind::adamw ? Decay::decoupled : Decay::l2;
    }
    const AdamArgs a{params.data() + begin,
                     grads.data() + begin,
                     exp_avg_.data() + begin,
                     exp_avg_sq_.data() + begin,
                     end - begin,
                     grad_scale,
                     static_cast<float>(o.weight_decay),
                     static_cast<float>(1.0 - lr * o.weight_decay),
                     static_cast<float>(o.beta1),
                     static_cast<float>(1.0 - o.beta1),
                     static_cast<float>(o.beta2),
                     static_cast<float>(1.0 - o.beta2),
                     static_cast<float>(std::sqrt(bias2)),
                     static_cast<float>(o.eps),
                     static_cast<float>(-lr / bias1)};
    adam_kernel(a, decay);
  }

  std::vector<NamedSpan<float>> state() override {
    return {{"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}};
  }

 private:
  std::vector<float> exp_avg_;
  std::vector<float> exp_avg_sq_;
};

}  // namespace

std::unique_ptr<Optimizer> make_adam(const OptimizerOptions& options, std::size_t size) {
  return std::make_unique<Adam>(options, size);
}

}  // namespace locus::train::detail
