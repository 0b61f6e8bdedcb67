// Private to the CUDA backend: check macros that turn a failed CUDA runtime or cuBLAS(Lt)
// call into a CudaError / CublasError carrying the call's text, file:line, rank, host and the
// current device, and the RAII traits of the CUDA handles (streams, events, buffers).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "locus/comm/error.hpp"
#include "locus/comm/handle.hpp"

namespace locus::train::cuda {

[[noreturn]] void cuda_fail(cudaError_t rc, const char* call, const char* file, int line);
[[noreturn]] void cublas_fail(cublasStatus_t rc, const char* call, const char* file, int line);
// "device 0 (NVIDIA H100 80GB HBM3)" for messages; "no device" before one is selected.
std::string device_text();

}  // namespace locus::train::cuda

#define LOCUS_CUDA_CHECK(call)                                                        \
  do {                                                                                \
    const cudaError_t locus_cuda_rc_ = (call);                                        \
    if (locus_cuda_rc_ != cudaSuccess)                                                \
      ::locus::train::cuda::cuda_fail(locus_cuda_rc_, #call, __FILE__, __LINE__);     \
  } while (0)

// After a kernel launch: a launch error (bad configuration, no kernel image) surfaces here.
#define LOCUS_CUDA_CHECK_LAUNCH(what) LOCUS_CUDA_CHECK(cudaPeekAtLastError())

#define LOCUS_CUBLAS_CHECK(call)                                                      \
  do {                                                                                \
    const cublasStatus_t locus_cublas_rc_ = (call);                                   \
    if (locus_cublas_rc_ != CUBLAS_STATUS_SUCCESS)                                    \
      ::locus::train::cuda::cublas_fail(locus_cublas_rc_, #call, __FILE__, __LINE__); \
  } while (0)
