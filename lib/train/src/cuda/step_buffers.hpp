// Private to the CUDA backend: the whole model's double-buffered input slots, and the pinned
// rings that carry per-pass scalars to the device (the activations and scratch of a pass are
// layers.hpp's).
#pragma once

#include <cuda_bf16.h>

#include <vector>

#include "cuda/kernels.hpp"
#include "cuda/memory.hpp"
#include <cstdint>

namespace locus::train::cuda {

// Per-pass values the kernels read from device memory (a captured graph reads each replay's):
// the step that keys the dropout masks and 1 / the gradient divisor.
struct PassScalars {
  std::uint64_t step;
  float inv_divisor;
};

// The inputs of one step, double-buffered: the copy stream fills slot (k % 2) while the
// compute stream still reads slot (k - 1) % 2.
struct InputSlot {
  // bf16_input: the inputs arrive as bf16 (x_bf16; x is then empty).
  InputSlot(int capacity, int input_width, int output_width, bool targets, bool bf16_input);
  DeviceBuffer<float> x;                     // [rows, input width]
  DeviceBuffer<__nv_bfloat16> x_bf16;        // [rows, input width] (loader.gather = device, bf16)
  DeviceBuffer<std::int64_t> resident_rows;  // [rows] (device cache, loader.gather = device)
  DeviceBuffer<std::int32_t> labels;         // [rows]
  DeviceBuffer<std::uint64_t> sample_ids;    // [rows] (dropout)
  DeviceBuffer<float> targets;               // [rows, output width] (mse)
  // uploaded: the host batch's bytes are on the device (the loader may reuse its memory);
  // copied: the slot is complete (after a gather from mapped host memory too); consumed: the
  // step that read it is done.
  Event uploaded, copied, consumed;
  // A timing event recorded just before `copied` (when the slot was complete), handed to the
  // step that reads the slot, which times its stream's stall against it (null once handed
  // over).
  Event arrived;
  // The host batch whose inputs this slot holds or is receiving ahead of its step
  // (prefetch_inputs; null: none): its first host array and row count.
  const void* prefetched = nullptr;
  int prefetched_rows = -1;
};

// Small values written by the host for the device to read at run time (a captured graph reads
// each replay's), through a ring of pinned slots so an in-flight copy is never overwritten.
template <class T>
class ScalarUpload {
 public:
  explicit ScalarUpload(int slots = 8) : ring_(static_cast<std::size_t>(slots)), device_(1) {
    for (int i = 0; i < slots; ++i) done_.push_back(make_event());
  }
  T* device() const noexcept { return device_.data(); }
  // Enqueues *device() = value on stream.
  void upload(const T& value, cudaStream_t stream) {
    const std::size_t i = next_++ % ring_.size();
    LOCUS_CUDA_CHECK(cudaEventSynchronize(done_[i].get()));  // that slot's last copy is done
    ring_.data()[i] = value;
    LOCUS_CUDA_CHECK(cudaMemcpyAsync(device_.data(), ring_.data() + i, sizeof(T),
                                     cudaMemcpyHostToDevice, stream));
    LOCUS_CUDA_CHECK(cudaEventRecord(done_[i].get(), stream));
  }

 private:
  PinnedBuffer<T> ring_;
  DeviceBuffer<T> device_;
  std::vector<Event> done_;
  std::size_t next_ = 0;
};

}  // namespace locus::train::cuda
