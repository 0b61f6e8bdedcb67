// The compute backend factory (the one place that knows which backends this build has) and
// what every backend shares: argmax hits (precision names: model/precision.cpp).
#include "locus/train/compute.hpp"

#include <fmt/format.h>

#include "cpu/cpu_compute.hpp"
#include "cpu/cpu_layer_ops.hpp"
#include "trainer_impl.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/error.hpp"
#include "locus/config.hpp"
#include "locus/train/optim/clip.hpp"
#if LOCUS_WITH_CUDA
#include "cuda/cuda_compute.hpp"
#endif

namespace locus::train {

std::string available_backends() {
#if LOCUS_WITH_CUDA
  return fmt::format("cpu, and cuda: {}", cuda::describe_devices());
#else
  return "cpu (this build has no CUDA backend: rebuild with CUDA 13 under /usr/local/cuda and "
         "-DLOCUS_WITH_CUDA=ON)";
#endif
}

void validate(const ComputeOptions& options) {
  if (options.backend == "cpu") {
    if (options.precision != Precision::fp32) {
      throw ConfigError(fmt::format("train.precision = {} needs a GPU backend: the cpu backend "
                                    "computes in fp32 (set train.precision = fp32, or "
                                    "train.backend = cuda)",
                                    to_string(options.precision)));
    }
    if (options.device != -1) {
      throw ConfigError(fmt::format("train.device = {} picks a GPU, but train.backend = cpu "
                                    "computes on the host (set train.backend = cuda, or "
                                    "train.device = -1)",
                                    options.device));
    }
    return;
  }
#if LOCUS_WITH_CUDA
  if (options.backend == "cuda") {
    if (cuda::device_count() == 0) {
      throw ConfigError(fmt::format("train.backend = cuda, but host {} has {}; available: cpu "
                                    "(set train.backend = cpu, or run on a GPU node; under "
                                    "Slurm ask for GPUs: docs/SLURM.md, \"GPU jobs\")",
                                    mpi::hostname(), cuda::describe_devices()));
    }
    return;
  }
#endif
  throw ConfigError(fmt::format("train.backend = {} is not available here; available: {}",
                                options.backend, available_backends()));
}

std::unique_ptr<Compute> make_compute(const ComputeOptions& options, const mpi::Comm& world,
                                      TrainState& state, Loss loss) {
  validate(options);
  if (options.factory) return options.factory(state, loss);
#if LOCUS_WITH_CUDA
  if (options.backend == "cuda") return cuda::make_cuda_compute(options, world, state, loss);
#else
  (void)world;
#endif
  return detail::make_cpu_compute(state, loss);
}

double Compute::grad_squares() { return sum_of_squares(grads().host()); }

double Compute::take_step_values(std::vector<LossStats>& out) {
  drain_stats(out);
  return grad_squares();
}

void Compute::cache_dataset(std::span<const float>, std::int64_t, std::int64_t) {
  throw ConfigError(fmt::format("loader.device_cache_mb needs a GPU backend: the {} backend "
                                "reads batches from host memory (set loader.device_cache_mb = 0)",
                                name()));
}

void Compute::map_dataset(std::span<const float>, std::int64_t, std::int64_t) {
  throw ConfigError(fmt::format("loader.gather = device needs a GPU backend: the {} backend "
                                "reads batches from host memory (set loader.gather = host)",
                                name()));
}

namespace detail {

std::unique_ptr<LayerOps> make_layer_ops(const ComputeOptions& options, const mpi::Comm& world,
                                         TrainState& state) {
  validate(options);
  LOCUS_ASSERT(!options.factory, "a compute factory builds whole-model backends, not the layer "
                                 "operations of a pipeline stage");
#if LOCUS_WITH_CUDA
  if (options.backend == "cuda") return cuda::make_cuda_layer_ops(options, world, state);
#else
  (void)world;
#endif
  return make_cpu_layer_ops(state);
}

std::unique_ptr<comm::GradientReducer> make_reducer(const comm::GradientBuffer& grads,
                                                    const mpi::Comm& dp,
                                                    const comm::ReducerOptions& options,
                                                    std::string* why) {
  std::string unused;
  if (why == nullptr) why = &unused;  // the reason is still named in a refusal below
  if (grads.space == comm::MemorySpace::host) {
    return comm::make_gradient_reducer(dp, grads.host(), options);
  }
  if (options.backend == comm::ReducerBackend::nccl) {
    return comm::make_nccl_reducer(dp, grads, options);
  }
  if (options.backend == comm::ReducerBackend::automatic &&
      options.reduction != comm::Reduction::automatic) {
    // A chosen reduction order is the MPI reducer's: NCCL picks its own.
    *why = fmt::format("train.reduction = {} asks for the MPI reducer",
                       comm::to_string(options.reduction));
  } else if (options.backend == comm::ReducerBackend::automatic) {
    const std::string reason = comm::nccl_unusable_reason(dp, grads);
    if (reason.empty()) return comm::make_nccl_reducer(dp, grads, options);
    *why = reason;
  }
  mpi::agree_on(dp, [&] {
    if (options.precision == comm::ReducePrecision::fp32) return;
    throw ConfigError(comm::bf16_sum_refusal(
        options.backend == comm::ReducerBackend::mpi
            ? std::string("the host-staged MPI reducer (train.reducer = mpi)")
            : fmt::format("the host-staged MPI reducer (train.reducer = auto: not NCCL, as {})",
                          *why)));
  });
#if LOCUS_WITH_CUDA
  return cuda::make_staged_reducer(grads, dp, options);
#else
  LOCUS_ASSERT(false, "a device gradient buffer in a build without CUDA");
  return nullptr;
#endif
}

}  // namespace detail

std::int64_t count_correct(std::span<const float> outputs, int rows, int classes,
                           std::span<const std::int32_t> labels) noexcept {
  std::int64_t correct = 0;
  for (int r = 0; r < rows; ++r) {
    const float* z = outputs.data() + static_cast<std::size_t>(r) * static_cast<std::size_t>(classes);
    int best = 0;
    for (int j = 1; j < classes; ++j) best = z[j] > z[best] ? j : best;  // first max, as the loss
    correct += best == labels[static_cast<std::size_t>(r)] ? 1 : 0;
  }
  return correct;
}

}  // namespace locus::train
