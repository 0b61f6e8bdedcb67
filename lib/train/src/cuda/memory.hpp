// Private to the CUDA backend: owning handles for device buffers, pinned host buffers,
// streams, events and graph executables (comm/handle.hpp's move-only template), so nothing
// leaks on an exception and nothing is freed twice.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <span>

#include "cuda/cuda_check.hpp"

namespace locus::train::cuda {

// A failed allocation of `bytes`: CudaError naming what was asked, what is free and what to
// lower (out of memory), or the CUDA error otherwise.
[[noreturn]] void out_of_memory(cudaError_t rc, std::size_t bytes, bool pinned);

// Page-locks an existing host range (cudaHostRegister) for its lifetime, so device<->host
// copies of it run at full speed and asynchronously; a range that cannot be registered stays
// pageable (copies still work, slower).
class HostRegistration {
 public:
  HostRegistration() = default;
  HostRegistration(void* p, std::size_t bytes) {
    if (p == nullptr || bytes == 0) return;
    refused_ = cudaHostRegister(p, bytes, cudaHostRegisterPortable);
    if (refused_ == cudaSuccess) {
      p_ = p;
    } else {
      cudaGetLastError();  // not sticky; clear it so the next check reports its own
    }
  }
  // Why the range stays pageable (cudaSuccess: it is page-locked, or there was none).
  cudaError_t refused() const noexcept { return refused_; }
  HostRegistration(const HostRegistration&) = delete;
  HostRegistration& operator=(const HostRegistration&) = delete;
  HostRegistration(HostRegistration&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), refused_(o.refused_) {}
  HostRegistration& operator=(HostRegistration&&) = delete;
  ~HostRegistration() {
    if (p_ != nullptr) cudaHostUnregister(p_);
  }

 private:
  void* p_ = nullptr;
  cudaError_t refused_ = cudaSuccess;
};

struct StreamTraits {
  using value_type = cudaStream_t;
  static value_type invalid() noexcept { return nullptr; }
  static void close(value_type s) noexcept { cudaStreamDestroy(s); }
};
struct EventTraits {
  using value_type = cudaEvent_t;
  static value_type invalid() noexcept { return nullptr; }
  static void close(value_type e) noexcept { cudaEventDestroy(e); }
};
struct GraphExecTraits {
  using value_type = cudaGraphExec_t;
  static value_type invalid() noexcept { return nullptr; }
  static void close(value_type g) noexcept { cudaGraphExecDestroy(g); }
};
struct GraphTraits {
  using value_type = cudaGraph_t;
  static value_type invalid() noexcept { return nullptr; }
  static void close(value_type g) noexcept { cudaGraphDestroy(g); }
};
using Stream = Handle<StreamTraits>;
using Event = Handle<EventTraits>;
using GraphExec = Handle<GraphExecTraits>;
using Graph = Handle<GraphTraits>;

inline Stream make_stream() {
  cudaStream_t s = nullptr;
  LOCUS_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return Stream(s);
}
// Timing is off: events here only order work (cheaper to record and wait on).
inline Event make_event() {
  cudaEvent_t e = nullptr;
  LOCUS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return Event(e);
}
// With timing, for cudaEventElapsedTime between two of them.
inline Event make_timing_event() {
  cudaEvent_t e = nullptr;
  LOCUS_CUDA_CHECK(cudaEventCreate(&e));
  return Event(e);
}

// count elements of T on the device (cudaMalloc: 256-byte aligned), or in page-locked host
// memory (cudaHostAlloc with kHostFlags), which asynchronous copies need to overlap with
// compute.
template <class T, bool kPinned, unsigned kHostFlags = cudaHostAllocPortable>
class Buffer {
 public:
  Buffer() = default;
  explicit Buffer(std::size_t count) : count_(count) {
    if (count == 0) return;
    void* p = nullptr;
    const cudaError_t rc = kPinned ? cudaHostAlloc(&p, count * sizeof(T), kHostFlags)
                                   : cudaMalloc(&p, count * sizeof(T));
    if (rc != cudaSuccess) out_of_memory(rc, count * sizeof(T), kPinned);
    data_ = static_cast<T*>(p);
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), count_(std::exchange(o.count_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      free();
      data_ = std::exchange(o.data_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  ~Buffer() { free(); }

  T* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return count_; }
  std::size_t bytes() const noexcept { return count_ * sizeof(T); }
  std::span<T> span() const noexcept { return {data_, count_}; }

 private:
  void free() noexcept {
    if (data_ == nullptr) return;
    if constexpr (kPinned) {
      cudaFreeHost(data_);
    } else {
      cudaFree(data_);
    }
    data_ = nullptr;
  }
  T* data_ = nullptr;
  std::size_t count_ = 0;
};
template <class T> using DeviceBuffer = Buffer<T, false>;
template <class T> using PinnedBuffer = Buffer<T, true>;
// Page-locked and mapped: kernels read it over the host link (cudaHostGetDevicePointer).
template <class T>
using MappedBuffer = Buffer<T, true, cudaHostAllocPortable | cudaHostAllocMapped>;

}  // namespace locus::train::cuda
