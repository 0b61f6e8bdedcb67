// The NCCL stage link (built with LOCUS_WITH_NCCL): device buffers go straight from GPU to GPU
// with ncclSend / ncclRecv, never through the host. Each tag is a channel of its own -- an
// NCCL communicator and a communication stream -- so the activations going up the pipeline
// and the gradients coming down never queue behind each other.
//
// Why receives are issued at wait() and not at recv(): an NCCL transfer holds its stream until
// the peer reaches the matching one. A receive posted ahead (as the pipeline posts the next
// micro-batch's input before it sends this one's output, which MPI buffers) would hold the
// channel's stream, and the send queued behind it, until the previous stage produced that
// input -- which in 1F1B needs this stage's gradient, which needs this send: a cycle. Issued
// where the data is needed, each channel runs its transfers in the order a synchronous
// program would, and the pipeline's schedules complete (link.hpp states the rule).
//
// Ordering on the device: a send's channel stream waits for the work enqueued on the buffer's
// stream so far (an event); a receive's channel stream waits the same way for the buffer's
// stream (the buffer may still be read by earlier work). wait() makes the buffer's stream wait
// for the transfer (an event per request). The host never blocks except in drain(), which
// polls NCCL's asynchronous error state and gives up after the timeout (nccl_comm.hpp).
#include "nccl_entry.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "locus/comm/error.hpp"
#include "nccl_comm.hpp"

namespace locus::comm::detail {

namespace {

class NcclLink final : public StageLink {
 public:
  NcclLink(const mpi::Comm& comm, std::span<const int> tags, const LinkOptions& options)
      : rank_(comm.rank()), size_(comm.size()) {
    for (const int tag : tags) {
      LOCUS_ASSERT(std::ranges::none_of(channels_, [&](const auto& c) { return c->tag == tag; }),
                   fmt::format("the NCCL link's tags repeat {}", tag));
      auto c = std::make_unique<Channel>();
      c->tag = tag;
      LOCUS_NCCL_CUDA(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
      LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&c->idle, cudaEventDisableTiming));
      c->nccl = std::make_unique<NcclComm>(comm, "pipeline",
                                           NcclTimeout{options.timeout_s, options.timeout_key});
      channels_.push_back(std::move(c));
    }
    LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  }

  ~NcclLink() override {
    // Never throws: a channel whose transfers did not all complete is aborted, not finalized.
    for (auto& c : channels_) {
      bool healthy = c->nccl->get() != nullptr;
      if (healthy) {
        try {
          LOCUS_NCCL_CUDA(cudaEventRecord(c->idle, c->stream));
          c->nccl->await("the last pipeline transfer", [&] { return event_done(c->idle); });
        } catch (...) {
          healthy = false;
        }
      }
      c->nccl->close(healthy);
      cudaStreamSynchronize(c->stream);
      cudaStreamDestroy(c->stream);
      cudaEventDestroy(c->idle);
    }
    for (Slot& s : slots_) cudaEventDestroy(s.done);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
  }

  void send(const GradientBuffer& buf, int peer, int tag, LinkRequest& r) override {
    Channel& c = channel(buf, peer, tag, r);
    const int i = acquire();
    Slot& s = slots_[static_cast<std::size_t>(i)];
    s.buf = buf;
    s.receive_pending = false;
    if (buf.size > 0) {
      after(buf, c);
      c.nccl->issued(ncclSend(buf.data, buf.size, ncclFloat32, peer, c.nccl->get(), c.stream),
                     "ncclSend");
    }
    LOCUS_NCCL_CUDA(cudaEventRecord(s.done, c.stream));
    r.staging = i;
  }

  void recv(const GradientBuffer& buf, int peer, int tag, LinkRequest& r) override {
    channel(buf, peer, tag, r);
    const int i = acquire();
    Slot& s = slots_[static_cast<std::size_t>(i)];
    s.buf = buf;
    s.peer = peer;
    s.tag = tag;
    s.receive_pending = true;
    r.staging = i;
  }

  void wait(LinkRequest& r) override {
    if (r.staging < 0) return;
    Slot& s = slots_[static_cast<std::size_t>(r.staging)];
    if (s.receive_pending) {  // issued now, where it is needed (see the top of this file)
      Channel& c = channel_of(s.tag);
      if (s.buf.size > 0) {
        after(s.buf, c);
        c.nccl->issued(
            ncclRecv(s.buf.data, s.buf.size, ncclFloat32, s.peer, c.nccl->get(), c.stream),
            "ncclRecv");
      }
      LOCUS_NCCL_CUDA(cudaEventRecord(s.done, c.stream));
      s.receive_pending = false;
    }
    LOCUS_NCCL_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.buf.stream), s.done, 0));
    s.busy = false;
    r.staging = -1;
  }

  void drain() override {
    for (auto& c : channels_) {
      LOCUS_NCCL_CUDA(cudaEventRecord(c->idle, c->stream));
      c->nccl->await("a pipeline transfer (stage link)", [&] { return event_done(c->idle); });
    }
  }

  std::string_view name() const noexcept override { return "nccl"; }

 private:
  struct Channel {
    int tag = 0;
    cudaStream_t stream = nullptr;
    cudaEvent_t idle = nullptr;  // drain(): recorded after everything queued on the stream
    std::unique_ptr<NcclComm> nccl;
  };
  // One request in flight: its event, and for a receive what to issue at wait().
  struct Slot {
    cudaEvent_t done = nullptr;  // the transfer is complete on the device after it
    GradientBuffer buf;
    int peer = -1;
    int tag = 0;
    bool receive_pending = false;
    bool busy = false;
  };

  Channel& channel_of(int tag) {
    for (auto& c : channels_) {
      if (c->tag == tag) return *c;
    }
    throw InternalError(fmt::format("the NCCL stage link has no channel for tag {}", tag));
  }

  // Checks a transfer's arguments and returns its tag's channel.
  Channel& channel(const GradientBuffer& buf, int peer, int tag, const LinkRequest& r) {
    LOCUS_ASSERT(buf.space == MemorySpace::cuda && buf.stream != nullptr,
                 "the NCCL stage link moves device buffers ordered on their stream");
    LOCUS_ASSERT(!r.active(), "a link request was reused while its transfer is in flight");
    LOCUS_ASSERT(peer >= 0 && peer < size_ && peer != rank_,
                 fmt::format("the NCCL stage link of pipeline rank {} of {} cannot send to or "
                             "receive from rank {}",
                             rank_, size_, peer));
    return channel_of(tag);
  }

  // The channel's stream waits for the work enqueued on buf's stream so far.
  void after(const GradientBuffer& buf, Channel& c) {
    LOCUS_NCCL_CUDA(cudaEventRecord(ready_, static_cast<cudaStream_t>(buf.stream)));
    LOCUS_NCCL_CUDA(cudaStreamWaitEvent(c.stream, ready_, 0));
  }

  // A free slot; its event may be recorded again (every earlier record was waited on already).
  int acquire() {
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i].busy) {
        slots_[i].busy = true;
        return static_cast<int>(i);
      }
    }
    Slot s;
    LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&s.done, cudaEventDisableTiming));
    s.busy = true;
    slots_.push_back(s);
    return static_cast<int>(slots_.size()) - 1;
  }

  int rank_;
  int size_;
  std::vector<std::unique_ptr<Channel>> channels_;
  std::vector<Slot> slots_;
  cudaEvent_t ready_ = nullptr;  // reused: each record is waited on at once
};

}  // namespace

std::unique_ptr<StageLink> make_nccl_link(const mpi::Comm& comm, std::span<const int> tags,
                                          const LinkOptions& options) {
  pin_deterministic_algorithm();  // nothing is summed, but every NCCL user sets it the same
  return std::make_unique<NcclLink>(comm, tags, options);
}

}  // namespace locus::comm::detail
