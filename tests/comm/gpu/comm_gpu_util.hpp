// Shared by lib/comm's GPU tests: a checked CUDA call and the reason to skip without a device.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "locus/comm/error.hpp"

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

// A rank giving up on an NCCL operation its peer never joins: wait() (which must throw an
// NcclError after the timeout) and then release() (the link or reducer going), each timed.
struct GaveUp {
  std::string error;      // the NcclError's text; empty if none was thrown
  double wait_s = -1;     // until wait() returned or threw
  double release_s = -1;  // release()
};
template <class Wait, class Release>
GaveUp give_up(Wait&& wait, Release&& release) {
  using Clock = std::chrono::steady_clock;
  const auto seconds = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  GaveUp g;
  auto t = Clock::now();
  try {
    wait();
  } catch (const NcclError& e) {
    g.error = e.what();
  }
  g.wait_s = seconds(t);
  t = Clock::now();
  release();
  g.release_s = seconds(t);
  return g;
}

// The error names `what` and the 3 s timeout of train.reducer_timeout_s and the abort, came
// within the timeout plus NCCL's polling tick (at least once a second), and the aborted
// communicator let its owner go at once.
inline void expect_gave_up_in_time(const GaveUp& g, std::string_view what) {
  EXPECT_NE(g.error.find(what), std::string::npos) << g.error;
  EXPECT_NE(g.error.find("did not complete within train.reducer_timeout_s = 3 s"),
            std::string::npos)
      << g.error;
  EXPECT_NE(g.error.find("aborted"), std::string::npos) << g.error;
  EXPECT_GE(g.wait_s, 2.9);
  EXPECT_LT(g.wait_s, 10.0) << "the timeout is 3 s, polled at least once a second";
  EXPECT_LT(g.release_s, 5.0) << "an aborted communicator must not wait for its peers";
}

}  // namespace locus::comm::test
