// The CUDA backend's error paths: CudaError / CublasError with the call, file:line, rank, host
// and device, and an out-of-memory hint.
#include "cuda/cuda_check.hpp"

#include <fmt/format.h>

#include "cuda/cublaslt_api.hpp"
#include "locus/comm/mpi.hpp"

namespace locus::train::cuda {

std::string device_text() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later checks report their own
    return "no device";
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("device {}", device);
  }
  return fmt::format("device {} ({})", device, prop.name);
}

void cuda_fail(cudaError_t rc, const char* call, const char* file, int line) {
  std::string hint;
  if (rc == cudaErrorMemoryAllocation) {
    std::size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) cudaGetLastError();
    hint = fmt::format(" ({:.1f} of {:.1f} GiB free): lower train.batch, eval.batch or "
                       "loader.device_cache_mb",
                       static_cast<double>(free_b) / (1 << 30),
                       static_cast<double>(total_b) / (1 << 30));
  }
  throw CudaError(fmt::format("{} failed: {} ({}){} at {} on {}", call, cudaGetErrorName(rc),
                              cudaGetErrorString(rc), hint, where(file, line), device_text()));
}

void out_of_memory(cudaError_t rc, std::size_t bytes, bool pinned) {
  if (rc != cudaErrorMemoryAllocation) {
    throw CudaError(fmt::format("{} of {} bytes failed: {} ({}) on {}",
                                pinned ? "cudaHostAlloc" : "cudaMalloc", bytes,
                                cudaGetErrorName(rc), cudaGetErrorString(rc), device_text()));
  }
  std::size_t free_b = 0, total_b = 0;
  if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) cudaGetLastError();
  constexpr double kMiB = 1 << 20;
  if (pinned) {
    throw CudaError(fmt::format("out of page-locked host memory: {:.1f} MiB asked (rank {} on "
                                "{}): lower train.batch or loader.prefetch, or raise the "
                                "locked-memory limit (ulimit -l)",
                                static_cast<double>(bytes) / kMiB, mpi::world_rank(),
                                mpi::hostname()));
  }
  throw CudaError(fmt::format("out of GPU memory: {:.1f} MiB asked, {:.1f} of {:.1f} MiB free on "
                              "{} (rank {} on {}): lower train.batch, eval.batch or "
                              "loader.device_cache_mb",
                              static_cast<double>(bytes) / kMiB, static_cast<double>(free_b) / kMiB,
                              static_cast<double>(total_b) / kMiB, device_text(),
                              mpi::world_rank(), mpi::hostname()));
}

void cublas_fail(cublasStatus_t rc, const char* call, const char* file, int line) {
  throw CublasError(fmt::format("{} failed: {} ({}) at {} on {}", call,
                                lt().GetStatusName(rc), lt().GetStatusString(rc),
                                where(file, line), device_text()));
}

}  // namespace locus::train::cuda
