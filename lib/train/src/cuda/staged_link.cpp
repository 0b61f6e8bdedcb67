// The host-staged stage link for device buffers: a send copies the buffer to a pinned bounce
// buffer on a stream of the link's own after the producer's work (an event), waits for that
// copy, then hands the host copy to the MPI link; a receive lands in a pinned bounce buffer
// and, once MPI has it, is copied to the device on the consumer's stream. Bounce buffers are
// reused once the copies that read them are done (an event each). Correct on any MPI; NCCL
// send/recv (next) replaces it where NCCL can be used, behind the same StageLink interface.
#include <fmt/format.h>

#include <algorithm>
#include <vector>

#include "cuda/cuda_compute.hpp"
#include "cuda/memory.hpp"

namespace locus::train::cuda {

namespace {

class StagedLink final : public comm::StageLink {
 public:
  explicit StagedLink(const mpi::Comm& comm)
      : inner_(comm::make_mpi_link(comm)), stream_(make_stream()), produced_(make_event()) {}

  ~StagedLink() override {
    // Never throw here; copies still queued must not outlive the pinned memory they use.
    if (stream_) cudaStreamSynchronize(stream_.get());
    for (Bounce& b : bounces_) {
      if (b.pending) cudaEventSynchronize(b.released.get());
    }
  }

  void send(const comm::GradientBuffer& buf, int peer, int tag, comm::LinkRequest& r) override {
    check(buf, r);
    const int i = acquire(buf.size);
    Bounce& b = bounces_[static_cast<std::size_t>(i)];
    if (buf.size > 0) {
      LOCUS_CUDA_CHECK(cudaEventRecord(produced_.get(), static_cast<cudaStream_t>(buf.stream)));
      LOCUS_CUDA_CHECK(cudaStreamWaitEvent(stream_.get(), produced_.get(), 0));
      LOCUS_CUDA_CHECK(cudaMemcpyAsync(b.host.data(), buf.data, buf.size * sizeof(float),
                                       cudaMemcpyDeviceToHost, stream_.get()));
      // MPI reads the host copy from now on: it must be there.
      LOCUS_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
    }
    inner_->send(host_view(b, buf.size), peer, tag, r);
    r.staging = i;
  }

  void recv(const comm::GradientBuffer& buf, int peer, int tag, comm::LinkRequest& r) override {
    check(buf, r);
    const int i = acquire(buf.size);
    inner_->recv(host_view(bounces_[static_cast<std::size_t>(i)], buf.size), peer, tag, r);
    r.staging = i;
    r.target = buf;
  }

  void wait(comm::LinkRequest& r) override {
    inner_->wait(r);
    if (r.staging < 0) return;
    Bounce& b = bounces_[static_cast<std::size_t>(r.staging)];
    if (r.target.data != nullptr && r.target.size > 0) {  // a receive: on to the device
      const auto s = static_cast<cudaStream_t>(r.target.stream);
      LOCUS_CUDA_CHECK(cudaMemcpyAsync(r.target.data, b.host.data(), r.target.size * sizeof(float),
                                       cudaMemcpyHostToDevice, s));
      LOCUS_CUDA_CHECK(cudaEventRecord(b.released.get(), s));
      b.pending = true;
    }
    b.busy = false;
    r.staging = -1;
    r.target = {};
  }

  std::string_view name() const noexcept override { return "mpi-host-staged"; }

 private:
  struct Bounce {
    PinnedBuffer<float> host;
    Event released = make_event();  // the last device copy that read `host` is done after it
    bool pending = false;           // `released` was recorded and may not have completed
    bool busy = false;              // held by a transfer in flight
  };

  static void check(const comm::GradientBuffer& buf, const comm::LinkRequest& r) {
    LOCUS_ASSERT(buf.space == comm::MemorySpace::cuda && buf.stream != nullptr,
                 "the host-staged link moves device buffers ordered on their stream");
    LOCUS_ASSERT(!r.active(), "a link request was reused while its transfer is in flight");
  }
  static comm::GradientBuffer host_view(Bounce& b, std::size_t n) {
    return {b.host.data(), n, comm::MemorySpace::host, nullptr};
  }

  // A free bounce buffer of at least n floats: the smallest free one that fits, else a free
  // one grown, else a new one. Its last device copy has completed when it is returned.
  int acquire(std::size_t n) {
    int fit = -1, any = -1;
    for (std::size_t i = 0; i < bounces_.size(); ++i) {
      const Bounce& b = bounces_[i];
      if (b.busy) continue;
      if (any < 0) any = static_cast<int>(i);
      if (b.host.size() >= n &&
          (fit < 0 || b.host.size() < bounces_[static_cast<std::size_t>(fit)].host.size())) {
        fit = static_cast<int>(i);
      }
    }
    int best = fit >= 0 ? fit : any;
    if (best < 0) {
      bounces_.emplace_back();
      best = static_cast<int>(bounces_.size()) - 1;
    }
    Bounce& b = bounces_[static_cast<std::size_t>(best)];
    if (b.pending) {
      LOCUS_CUDA_CHECK(cudaEventSynchronize(b.released.get()));
      b.pending = false;
    }
    if (b.host.size() < n) b.host = PinnedBuffer<float>(std::max<std::size_t>(n, 1));
    b.busy = true;
    return best;
  }

  std::unique_ptr<comm::StageLink> inner_;
  Stream stream_;
  Event produced_;
  // Requests hold indices (the pinned memory itself never moves when the vector grows).
  std::vector<Bounce> bounces_;
};

}  // namespace

std::unique_ptr<comm::StageLink> make_staged_link(const mpi::Comm& comm) {
  return std::make_unique<StagedLink>(comm);
}

}  // namespace locus::train::cuda
