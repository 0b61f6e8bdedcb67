// A TrainState's held layers on the device: allocation, host <-> device copies, and the
// fused SGD / Adam(W) update with its host-computed scalars.
#include "cuda/device_state.hpp"

#include <cmath>
#include <utility>

namespace locus::train::cuda {

DeviceState::DeviceState(TrainState& state, bool bf16)
    : state_(state), n_(state.model.params().size()), params_(n_), grads_(n_) {
  const auto opt_state = state.optimizer->state();
  if (!opt_state.empty()) state_a_ = DeviceBuffer<float>(n_);
  if (opt_state.size() > 1) state_b_ = DeviceBuffer<float>(n_);
  if (bf16) params_bf16_ = DeviceBuffer<__nv_bfloat16>(n_);
  registered_.emplace_back(state.model.params().data(), state.model.params().size_bytes());
  for (const auto& s : opt_state) registered_.emplace_back(s.data.data(), s.data.size_bytes());
}

// The copies go on `stream`, ahead of the bf16 conversion that reads them: a cudaMemcpy from
// pageable memory (the registration refused) may return before its DMA lands, and `stream`
// does not wait for the legacy default stream.
void DeviceState::sync_from_host(cudaStream_t stream) {
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(stream));
  LOCUS_CUDA_CHECK(cudaMemcpyAsync(params_.data(), state_.model.params().data(), params_.bytes(),
                                   cudaMemcpyHostToDevice, stream));
  const auto st = std::as_const(*state_.optimizer).state();
  DeviceBuffer<float>* targets[2] = {&state_a_, &state_b_};
  for (std::size_t i = 0; i < st.size() && i < 2; ++i) {
    LOCUS_CUDA_CHECK(cudaMemcpyAsync(targets[i]->data(), st[i].data.data(), targets[i]->bytes(),
                                     cudaMemcpyHostToDevice, stream));
  }
  if (params_bf16_.size() > 0) to_bf16(params_.data(), params_bf16_.data(), n_, stream);
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void DeviceState::sync_to_host(cudaStream_t stream) {
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(stream));
  LOCUS_CUDA_CHECK(cudaMemcpy(state_.model.params().data(), params_.data(), params_.bytes(),
                              cudaMemcpyDeviceToHost));
  auto st = state_.optimizer->state();
  const DeviceBuffer<float>* sources[2] = {&state_a_, &state_b_};
  for (std::size_t i = 0; i < st.size() && i < 2; ++i) {
    LOCUS_CUDA_CHECK(cudaMemcpy(st[i].data.data(), sources[i]->data(), sources[i]->bytes(),
                                cudaMemcpyDeviceToHost));
  }
}

OptimizerScalars DeviceState::scalars(double lr) const {
  const OptimizerOptions& o = state_.optimizer->options();
  OptimizerScalars sc{};
  const std::int64_t steps = state_.optimizer->steps();
  sc.neg_lr = static_cast<float>(-lr);
  sc.first_step = steps == 0 ? 1 : 0;
  sc.grad_coef = steps == 0 ? 1.0f : static_cast<float>(1.0 - o.dampening);
  const double t = static_cast<double>(steps + 1);
  sc.decay_factor = static_cast<float>(1.0 - lr * o.weight_decay);
  sc.bias2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(o.beta2, t)));
  sc.neg_step_size = static_cast<float>(-lr / (1.0 - std::pow(o.beta1, t)));
  return sc;
}

void DeviceState::issue_update(const OptimizerScalars* scalars, const float* grad_scale,
                               cudaStream_t s, const double* gate) {
  __nv_bfloat16* p16 = params_bf16_.size() > 0 ? params_bf16_.data() : nullptr;
  const OptimizerOptions& o = state_.optimizer->options();
  if (o.kind == OptimizerKind::sgd) {
    SgdConfig c;
    c.weight_decay = static_cast<float>(o.weight_decay);
    c.momentum = static_cast<float>(o.momentum);
    c.nesterov = o.nesterov;
    sgd_update(params_.data(), grads_.data(), state_a_.size() > 0 ? state_a_.data() : nullptr,
               p16, n_, c, scalars, grad_scale, s, gate);
  } else {
    AdamConfig c;
    c.weight_decay = static_cast<float>(o.weight_decay);
    c.decoupled = o.kind == OptimizerKind::adamw;
    c.beta1 = o.beta1;
    c.beta2 = o.beta2;
    c.eps = o.eps;
    adam_update(params_.data(), grads_.data(), state_a_.data(), state_b_.data(), p16, n_, c,
                scalars, grad_scale, s, gate);
  }
}

}  // namespace locus::train::cuda
