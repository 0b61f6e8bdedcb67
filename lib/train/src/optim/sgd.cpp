// SGD with momentum, dampening, Nesterov and L2 weight decay in one pass, with the exact
// operation order of torch.optim.SGD (single-tensor path) so results match to rounding.
#include <algorithm>
#include <vector>

#include "optim/optimizers.hpp"

namespace locus::train::detail {

namespace {

struct SgdArgs {
  float* p;
  const float* g;
  float* buf;
  std::size_t n;
  float neg_lr;      // -lr
  float scale;       // gradient clipping factor
  float decay;       // weight_decay
  float momentum;
  float grad_coef;   // 1 - dampening, or 1 on the first step (PyTorch: buf = clone(d_p))
};

template <bool kDecay, bool kMomentum, bool kNesterov>
[[gnu::always_inline]] inline void sgd_loop(const SgdArgs& a) noexcept {
  float* __restrict p = a.p;
  const float* __restrict g = a.g;
  float* __restrict buf = a.buf;
  for (std::size_t i = 0; i < a.n; ++i) {
    float d = g[i] * a.scale;
    if constexpr (kDecay) d = d + a.decay * p[i];                        // d_p.add(p, wd)
    if constexpr (kMomentum) {
      const float b = buf[i] * a.momentum + a.grad_coef * d;             // buf.mul_.add_
      buf[i] = b;
      d = kNesterov ? d + a.momentum * b : b;                            // d_p.add(buf, mom)
    }
    p[i] = p[i] + a.neg_lr * d;                                          // p.add_(d_p, -lr)
  }
}

LOCUS_TRAIN_CLONES void sgd_kernel(const SgdArgs& a, bool decay, bool momentum,
                                   bool nesterov) noexcept {
  if (!momentum) {
    decay ? sgd_loop<true, false, false>(a) : sgd_loop<false, false, false>(a);
  } else if (!nesterov) {
    decay ? sgd_loop<true, true, false>(a) : sgd_loop<false, true, false>(a);
  } else {
    decay ? sgd_loop<true, true, true>(a) : sgd_loop<false, true, true>(a);
  }
}

class Sgd final : public Optimizer {
 public:
  Sgd(const OptimizerOptions& options, std::size_t size) : Optimizer(options, size) {
    if (options.momentum != 0.0) momentum_buffer_.assign(size, 0.0f);
  }

  void update(std::span<float> params, std::span<const float> grads, double lr,
              float grad_scale, std::size_t begin, std::size_t end) override {
    check_sizes(params, grads, begin, end);
    const bool momentum = !momentum_buffer_.empty();
    // PyTorch starts the buffer as a copy of the first gradient; with a zero buffer that is
    // buf * momentum + 1 * d_p exactly, so the first step only changes the coefficient.
    const bool first = steps_ == 0;
    float* buf = momentum ? momentum_buffer_.data() + begin : nullptr;
    if (momentum && first) std::fill(buf, buf + (end - begin), 0.0f);
    const SgdArgs a{params.data() + begin,
                    grads.data() + begin,
                    buf,
                    end - begin,
                    static_cast<float>(-lr),
                    grad_scale,
                    static_cast<float>(options_.weight_decay),
                    static_cast<float>(options_.momentum),
                    first ? 1.0f : static_cast<float>(1.0 - options_.dampening)};
    sgd_kernel(a, options_.weight_decay != 0.0, momentum, options_.nesterov);
  }

  std::vector<NamedSpan<float>> state() override {
    if (momentum_buffer_.empty()) return {};
    return {{"momentum_buffer", momentum_buffer_}};
  }

 private:
  std::vector<float> momentum_buffer_;
};

}  // namespace

std::unique_ptr<Optimizer> make_sgd(const OptimizerOptions& options, std::size_t size) {
  return std::make_unique<Sgd>(options, size);
}

}  // namespace locus::train::detail
