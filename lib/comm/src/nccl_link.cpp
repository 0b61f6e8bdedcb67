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
// program would, and the pipeline's schedules complete (link.hpp states the rule). NCCL pairs
// the transfers between two ranks in the order they are issued, so the receives of one tag and
// peer must be waited for in the order they were posted (checked: a bug otherwise).
//
// Ordering on the device: a send's channel stream waits for the work enqueued on the buffer's
// stream so far (an event); a receive's channel stream waits the same way for the buffer's
// stream (the buffer may still be read by earlier work). wait() makes the buffer's stream wait
// for the transfer (an event per request). The host blocks in drain() and in settle() (before
// the pipeline waits for a stream that waits for a transfer: the last stage's loss, the CUDA
// backend's own waits mid-step -- a new GEMM shape timed, the frees of buffers that grew), which
// poll every channel's NCCL error state and give up after the timeout (nccl_comm.hpp); any
// failure there aborts every channel -- all at once, with the process's other communicators
// (nccl_comm.hpp says why) -- since a channel left stuck would hang the next CUDA call that
// synchronizes the device (a cudaFree while unwinding).
//
// Both channels' kernels must run side by side: serialized on one hardware queue, a send could
// wait behind the other channel's transfer that waits for it (link.cpp refuses the settings
// that serialize them).
#include "nccl_entry.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "locus/comm/error.hpp"
#include "nccl_comm.hpp"

namespace locus::comm::detail {

namespace {

class NcclLink final : public StageLink {
 public:
  NcclLink(const mpi::Comm& comm, std::span<const int> tags, const LinkOptions& options)
      : rank_(comm.rank()), size_(comm.size()) {
    LOCUS_ASSERT(!tags.empty(), "an NCCL stage link needs at least one tag");
    // The channels' streams one right after the other, before any communicator (whose setup
    // creates streams of NCCL's own): the driver hands new streams its hardware queues in
    // turn (8 by default, CUDA_DEVICE_MAX_CONNECTIONS), so streams made in a row never share
    // one and the channels' transfers cannot queue behind each other (top of this file).
    for (const int tag : tags) {
      LOCUS_ASSERT(std::ranges::none_of(channels_, [&](const auto& c) { return c->tag == tag; }),
                   fmt::format("the NCCL link's tags repeat {}", tag));
      auto c = std::make_unique<Channel>();
      c->tag = tag;
      LOCUS_NCCL_CUDA(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
      LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&c->idle, cudaEventDisableTiming));
      channels_.push_back(std::move(c));
    }
    for (auto& c : channels_) {
      c->nccl = std::make_unique<NcclComm>(comm, "pipeline",
                                           NcclTimeout{options.timeout_s, options.timeout_key});
    }
    LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&settled_, cudaEventDisableTiming));
  }

  ~NcclLink() override {
    // Never throws. Unwinding (a peer's error, a timeout) aborts at once: the peers may be gone,
    // and a wait here would hold the job's exit for the whole timeout. Otherwise the transfers
    // in flight are waited for, and the channels finalized.
    bool healthy = std::uncaught_exceptions() == 0 &&
                   std::ranges::all_of(channels_, [](const auto& c) { return c->nccl->get(); });
    if (healthy) {
      try {
        await_idle("the last pipeline transfer");
      } catch (...) {
        healthy = false;  // await_idle aborted every channel
      }
    }
    for (auto& c : channels_) c->nccl->close(healthy);
    for (Slot& s : slots_) cudaEventDestroy(s.done);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
    if (settled_ != nullptr) cudaEventDestroy(settled_);
  }

  void send(const GradientBuffer& buf, int peer, int tag, LinkRequest& r) override {
    Channel& c = channel(buf, peer, tag, r);
    const int i = acquire();
    Slot& s = slots_[static_cast<std::size_t>(i)];
    s.buf = buf;
    s.receive_pending = false;
    if (buf.size > 0) {
      after(buf, c);
      issue(c, ncclSend(buf.data, buf.size, ncclFloat32, peer, c.nccl->get(), c.stream),
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
    s.order = posted_[{tag, peer}]++;
    r.staging = i;
  }

  void wait(LinkRequest& r) override {
    if (r.staging < 0) return;
    Slot& s = slots_[static_cast<std::size_t>(r.staging)];
    if (s.receive_pending) {  // issued now, where it is needed (see the top of this file)
      std::uint64_t& next = issued_[{s.tag, s.peer}];
      LOCUS_ASSERT(s.order == next,
                   fmt::format("the NCCL stage link's receive {} from rank {} under tag {} was "
                               "waited for before receive {}, posted earlier: NCCL would pair it "
                               "with the earlier message",
                               s.order, s.peer, s.tag, next));
      ++next;
      Channel& c = channel_of(s.tag);
      if (s.buf.size > 0) {
        after(s.buf, c);
        issue(c, ncclRecv(s.buf.data, s.buf.size, ncclFloat32, s.peer, c.nccl->get(), c.stream),
              "ncclRecv");
      }
      LOCUS_NCCL_CUDA(cudaEventRecord(s.done, c.stream));
      s.receive_pending = false;
    }
    LOCUS_NCCL_CUDA(cudaStreamWaitEvent(static_cast<cudaStream_t>(s.buf.stream), s.done, 0));
    s.busy = false;
    r.staging = -1;
  }

  void drain() override { await_idle("a pipeline transfer (stage link)"); }

  void settle(void* stream) override {
    if (stream == nullptr) return;  // none (link.hpp); not the legacy default stream
    LOCUS_NCCL_CUDA(cudaEventRecord(settled_, static_cast<cudaStream_t>(stream)));
    await_all("a pipeline transfer a host wait depends on (stage link)",
              [&] { return event_done(settled_); });
  }

  std::string_view name() const noexcept override { return "nccl"; }

 private:
  struct Channel {
    Channel() = default;
    Channel(const Channel&) = delete;
    Channel& operator=(const Channel&) = delete;
    // The communicator goes first (aborted unless closed), then what its kernels used.
    ~Channel() {
      nccl.reset();
      if (stream != nullptr) {
        cudaStreamSynchronize(stream);
        cudaStreamDestroy(stream);
      }
      if (idle != nullptr) cudaEventDestroy(idle);
    }
    int tag = 0;
    cudaStream_t stream = nullptr;
    cudaEvent_t idle = nullptr;  // recorded after everything queued on the stream
    std::unique_ptr<NcclComm> nccl;
  };
  // One request in flight: its event, and for a receive what to issue at wait().
  struct Slot {
    cudaEvent_t done = nullptr;  // the transfer is complete on the device after it
    GradientBuffer buf;
    int peer = -1;
    int tag = 0;
    std::uint64_t order = 0;  // a receive's place among those of its tag and peer
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

  // A transfer just enqueued on channel c (NcclComm::issued); when it fails, every channel is
  // aborted before the error goes on, as in await_all (the first close aborts them all at once,
  // with every other communicator of the process: nccl_comm.hpp).
  void issue(Channel& c, ncclResult_t rc, const char* call) {
    try {
      c.nccl->issued(rc, call);
    } catch (...) {
      for (auto& other : channels_) other->nccl->close(false);
      throw;
    }
  }

  // Polls until done(), failing on any channel's NCCL error; after the timeout (counted by the
  // first channel) or on any failure, every channel is aborted before the error goes on.
  void await_all(const char* what, const std::function<bool()>& done) {
    try {
      channels_.front()->nccl->await(what, [&] {
        for (std::size_t i = 1; i < channels_.size(); ++i) channels_[i]->nccl->check(what);
        return done();
      });
    } catch (...) {
      for (auto& c : channels_) c->nccl->close(false);
      throw;
    }
  }

  // Waits for everything queued on every channel's stream (as await_all).
  void await_idle(const char* what) {
    for (auto& c : channels_) LOCUS_NCCL_CUDA(cudaEventRecord(c->idle, c->stream));
    await_all(what, [&] {
      return std::ranges::all_of(channels_, [](const auto& c) { return event_done(c->idle); });
    });
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
  // Receives posted and issued so far, by (tag, peer): issued in posting order.
  std::map<std::pair<int, int>, std::uint64_t> posted_, issued_;
  cudaEvent_t ready_ = nullptr;    // reused: each record is waited on at once
  cudaEvent_t settled_ = nullptr;  // settle(): recorded on the stream it waits for
};

}  // namespace

std::unique_ptr<StageLink> make_nccl_link(const mpi::Comm& comm, std::span<const int> tags,
                                          const LinkOptions& options) {
  pin_deterministic_algorithm();  // nothing is summed, but every NCCL user sets it the same
  return std::make_unique<NcclLink>(comm, tags, options);
}

}  // namespace locus::comm::detail
