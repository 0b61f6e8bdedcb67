// Private to the CUDA backend: a TrainState's held layers on the device -- parameters (and
// their bf16 copy), gradients and optimizer state, one contiguous buffer each in the host's
// layout -- its host <-> device copies and the fused optimizer update, shared by the
// whole-model backend and pipeline stages.
#pragma once

#include <cuda_bf16.h>

#include <vector>

#include "cuda/kernels.hpp"
#include "cuda/memory.hpp"
#include "locus/train/train_state.hpp"

namespace locus::train::cuda {

class DeviceState {
 public:
  // Allocates the buffers and page-locks the host state for this object's lifetime (so
  // sync_to_host / sync_from_host copy at full speed); loads nothing (call sync_from_host).
  DeviceState(TrainState& state, bool bf16);

  std::size_t size() const noexcept { return n_; }
  float* params() const noexcept { return params_.data(); }
  float* grads() const noexcept { return grads_.data(); }
  // bf16 precision: the GEMM operands, refreshed by every update (else null).
  __nv_bfloat16* params_bf16() const noexcept { return params_bf16_.data(); }
  std::size_t grads_bytes() const noexcept { return grads_.bytes(); }

  // Waits for stream, then copies the host state's parameters and optimizer state in (and
  // refreshes the bf16 copy), or out.
  void sync_from_host(cudaStream_t stream);
  void sync_to_host(cudaStream_t stream);

  // The optimizer's per-step scalars at lr for its next step, exactly as optim/sgd.cpp and
  // optim/adam.cpp compute theirs.
  OptimizerScalars scalars(double lr) const;
  // Enqueues one fused pass over every parameter reading grads * (*grad_scale) and *scalars
  // (device memory, so a captured graph reads each replay's). Capturable. The host's step
  // counter is the caller's (Optimizer::finish_step). gate: see sgd_update (kernels.hpp).
  void issue_update(const OptimizerScalars* scalars, const float* grad_scale, cudaStream_t s,
                    const double* gate = nullptr);

 private:
  TrainState& state_;
  std::vector<HostRegistration> registered_;
  std::size_t n_ = 0;
  DeviceBuffer<float> params_, grads_, state_a_, state_b_;
  DeviceBuffer<__nv_bfloat16> params_bf16_;
};

}  // namespace locus::train::cuda
