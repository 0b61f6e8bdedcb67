// Shared by lib/comm's GPU tests: a checked CUDA call and the reason to skip without a device.
#pragma once

#include <cuda_runtime.h>

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

namespace locus::comm::test {

inline void cuda(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(rc));
  }
}
#define CU(call) ::locus::comm::test::cuda((call), #call)

// Why this process has no CUDA device to test on, or nothing.
inline std::optional<std::string> no_device() {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    cudaGetLastError();
    return std::string("no CUDA device (") + cudaGetErrorString(rc) +
           "): GPU tests run on a GPU host (bench/gpu)";
  }
  return std::nullopt;
}

// LOCUS_REQUIRE_NCCL=1 (set by bench/gpu/hostid_rank.sh, where the ranks can form NCCL
// communicators): a test that would skip because NCCL refused its ranks fails instead, so a
// phase meant to run the NCCL paths cannot pass by skipping them.
inline bool nccl_required() {
  const char* v = std::getenv("LOCUS_REQUIRE_NCCL");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace locus::comm::test
