// Shared pieces of the CUDA kernel tests: the fixture that skips without a usable device,
// device buffers with NaN poison and guard zones, float64 comparisons and a host bf16 rounding.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace locus::train::cuda::test {

inline void check(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(rc) + " (" +
                             cudaGetErrorString(rc) + ")");
  }
}
#define LOCUS_TEST_CUDA(call) ::locus::train::cuda::test::check((call), #call)

// Why no kernel can run here, or nothing. Leaves no error behind for later calls.
inline std::optional<std::string> no_device() {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    cudaGetLastError();
    return std::string("no CUDA device (") + cudaGetErrorString(rc) +
           "): GPU tests run on a GPU host (bench/gpu)";
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major < 9) {
    return std::string("device 0 (") + prop.name + ") is compute capability " +
           std::to_string(prop.major) + "." + std::to_string(prop.minor) +
           ": the kernels are built for sm_90 (CMAKE_CUDA_ARCHITECTURES)";
  }
  cudaGetLastError();
  return std::nullopt;
}

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    static const std::optional<std::string> why = no_device();
    if (why) GTEST_SKIP() << *why;
    LOCUS_TEST_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) {
      EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
      cudaStreamDestroy(stream_);
    }
    if (!no_device()) {
      EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    }
  }
  void sync() {
    LOCUS_TEST_CUDA(cudaStreamSynchronize(stream_));
    LOCUS_TEST_CUDA(cudaGetLastError());
  }
  cudaStream_t stream_ = nullptr;
};

// n elements at `offset` elements past a cudaMalloc'd base (offset 1 defeats float4 paths),
// with kGuard elements after them (and the offset before) filled with 0xA5 bytes: a kernel
// that writes out of bounds is caught by intact().
template <class T>
class Dev {
 public:
  static constexpr std::size_t kGuard = 64;
  explicit Dev(std::size_t n, std::size_t offset = 0) : n_(n), offset_(offset) {
    LOCUS_TEST_CUDA(cudaMalloc(&base_, total() * sizeof(T)));
    LOCUS_TEST_CUDA(cudaMemset(base_, 0xA5, total() * sizeof(T)));
  }
  explicit Dev(const std::vector<T>& host, std::size_t offset = 0) : Dev(host.size(), offset) {
    upload(host);
  }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  ~Dev() { cudaFree(base_); }

  T* get() const noexcept { return base_ + offset_; }
  std::size_t size() const noexcept { return n_; }
  void upload(const std::vector<T>& host) {
    if (host.size() != n_) throw std::runtime_error("upload size mismatch");
    LOCUS_TEST_CUDA(cudaMemcpy(get(), host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  void set(const T& value) { upload(std::vector<T>(n_, value)); }
  // 0xFF bytes: NaN as float, double and bf16, -1 as an integer.
  void poison() { LOCUS_TEST_CUDA(cudaMemset(get(), 0xFF, n_ * sizeof(T))); }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    LOCUS_TEST_CUDA(cudaMemcpy(host.data(), get(), n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  bool intact() const {
    std::vector<unsigned char> all(total() * sizeof(T));
    LOCUS_TEST_CUDA(cudaMemcpy(all.data(), base_, all.size(), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < offset_ * sizeof(T); ++i) {
      if (all[i] != 0xA5) return false;
    }
    for (std::size_t i = (offset_ + n_) * sizeof(T); i < all.size(); ++i) {
      if (all[i] != 0xA5) return false;
    }
    return true;
  }

 private:
  std::size_t total() const noexcept { return offset_ + n_ + kGuard; }
  T* base_ = nullptr;
  std::size_t n_, offset_;
};

inline std::vector<float> uniform(std::size_t n, float lo, float hi, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
std::size_t count_nan(const std::vector<T>& v) {
  std::size_t n = 0;
  for (const T& x : v) n += std::isnan(static_cast<double>(x)) ? 1 : 0;
  return n;
}

// out against a float64 reference: ||out - ref|| / ||ref|| <= rtol, and per element
// |out - ref| <= rtol * |ref| + atol_scale * max|ref| (the atol term covers values that come
// out of a cancellation). NaN anywhere fails.
template <class T>
::testing::AssertionResult matches(std::span<const T> out, std::span<const double> ref,
                                 double rtol, double atol_scale = 1e-6) {
  if (out.size() != ref.size()) {
    return ::testing::AssertionFailure() << out.size() << " values for " << ref.size();
  }
  double diff2 = 0, ref2 = 0, ref_max = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) ref_max = std::max(ref_max, std::abs(ref[i]));
  const double atol = atol_scale * ref_max;
  std::size_t bad = 0, worst = 0, nans = 0;
  double worst_excess = -1;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double o = static_cast<double>(out[i]);
    if (std::isnan(o)) ++nans;
    const double d = o - ref[i];
    diff2 += d * d;
    ref2 += ref[i] * ref[i];
    const double excess = std::abs(d) - (rtol * std::abs(ref[i]) + atol);
    if (!(excess <= 0)) ++bad;
    if (!(excess <= worst_excess)) {
      worst_excess = excess;
      worst = i;
    }
  }
  const double rel = ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2);
  if (nans == 0 && bad == 0 && rel <= rtol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "relative error " << rel << " (limit " << rtol << "), " << bad << " of " << ref.size()
         << " elements out of tolerance, " << nans << " NaN; worst at " << worst << ": "
         << static_cast<double>(out[worst]) << " vs " << ref[worst];
}
template <class T>
::testing::AssertionResult matches(const std::vector<T>& out, const std::vector<double>& ref,
                                 double rtol, double atol_scale = 1e-6) {
  return matches<T>(std::span<const T>(out), std::span<const double>(ref), rtol, atol_scale);
}

// float -> bf16 bits, round to nearest even (NaN stays NaN).
inline std::uint16_t bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

// Device bf16 values (as raw bits) against the rounding of fp32 values: exact, NaN for NaN.
inline ::testing::AssertionResult bf16_of(const std::vector<std::uint16_t>& got,
                                          const std::vector<float>& fp32) {
  if (got.size() != fp32.size()) return ::testing::AssertionFailure() << "size mismatch";
  for (std::size_t i = 0; i < got.size(); ++i) {
    const std::uint16_t want = bf16_bits(fp32[i]);
    const bool want_nan = (want & 0x7fffu) > 0x7f80u;
    const bool got_nan = (got[i] & 0x7fffu) > 0x7f80u;
    if (want_nan != got_nan || (!want_nan && want != got[i])) {
      return ::testing::AssertionFailure() << "element " << i << ": bf16 bits 0x" << std::hex
                                           << got[i] << ", expected 0x" << want << " for "
                                           << std::dec << fp32[i];
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace locus::train::cuda::test
