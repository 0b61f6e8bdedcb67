// The host-staged gradient reducer for device gradients: each announced slice is copied to
// pinned host memory on a stream of its own as soon as the compute stream has produced it
// (an event), the MPI reducer sums the host copy over dp, and the result goes back to the
// device before anything later on the compute stream reads it (an event the compute stream
// waits on). Correct on any MPI; the NCCL reducer (next) replaces it where NCCL can be used.
#include <fmt/format.h>

#include "cuda/cuda_compute.hpp"
#include "cuda/memory.hpp"

namespace locus::train::cuda {

namespace {

class StagedReducer final : public comm::GradientReducer {
 public:
  StagedReducer(const comm::GradientBuffer& grads, const mpi::Comm& dp,
                const comm::ReducerOptions& options)
      : device_(grads.data),
        size_(grads.size),
        producer_(static_cast<cudaStream_t>(grads.stream)),
        host_(grads.size),
        stream_(make_stream()),
        produced_(make_event()),
        returned_(make_event()),
        inner_(comm::make_gradient_reducer(dp, host_.span(), options)),
        staged_from_(grads.size),
        alone_(dp.size() == 1) {}

  ~StagedReducer() override {
    if (stream_) cudaStreamSynchronize(stream_.get());
  }

  // Enqueues the device -> host copy of [offset, previous offset) after the work the compute
  // stream has queued so far (which includes the gradients of those layers).
  void ready_from(std::size_t offset) override {
    if (alone_) return;  // one replica: the gradients are already the average
    LOCUS_ASSERT(offset <= staged_from_,
                 fmt::format("ready_from({}) after ready_from({}) in one step", offset,
                             staged_from_));
    if (offset == staged_from_) return;
    LOCUS_CUDA_CHECK(cudaEventRecord(produced_.get(), producer_));
    LOCUS_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), produced_.get(), 0));
    LOCUS_CUDA_CHECK(cudaMemcpyAsync(host_.data() + offset, device_ + offset,
                                     (staged_from_ - offset) * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_.get()));
    staged_from_ = offset;
  }

  void finish() override {
    if (alone_) return;
    ready_from(0);
    LOCUS_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
    inner_->ready_from(0);
    inner_->finish();
    LOCUS_CUDA_CHECK(cudaMemcpyAsync(device_, host_.data(), size_ * sizeof(float),
                                     cudaMemcpyHostToDevice, stream_.get()));
    LOCUS_CUDA_CHECK(cudaEventRecord(returned_.get(), stream_.get()));
    LOCUS_CUDA_CHECK(cudaStreamWaitEvent(producer_, returned_.get(), 0));
    staged_from_ = size_;
  }

  void allreduce_average(std::span<float> data) override { inner_->allreduce_average(data); }
  const comm::ReducerStats& stats() const noexcept override { return inner_->stats(); }
  std::string_view name() const noexcept override { return "mpi-host-staged"; }
  int comm_size() const noexcept override { return inner_->comm_size(); }
  std::string reduction() const override { return inner_->reduction(); }

 private:
  float* device_;
  std::size_t size_;
  cudaStream_t producer_;
  PinnedBuffer<float> host_;
  Stream stream_;
  Event produced_, returned_;
  std::unique_ptr<comm::GradientReducer> inner_;
  std::size_t staged_from_;
  bool alone_;  // a communicator of one: nothing to stage, the device never waits
};

}  // namespace

std::unique_ptr<comm::GradientReducer> make_staged_reducer(const comm::GradientBuffer& grads,
                                                           const mpi::Comm& dp,
                                                           const comm::ReducerOptions& options) {
  LOCUS_ASSERT(grads.space == comm::MemorySpace::cuda && grads.stream != nullptr,
               "the host-staged reducer needs a device buffer and its stream");
  return std::make_unique<StagedReducer>(grads, dp, options);
}

}  // namespace locus::train::cuda
