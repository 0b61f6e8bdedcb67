// The stage-to-stage link of pipeline parallelism: non-blocking point-to-point transfers of
// float buffers (activations forward, their gradients back) between neighbouring ranks of a
// pipeline communicator. Shaped like the gradient reducer (reducer.hpp): a small interface
// chosen once at start-up by where the buffers live, over a buffer description (pointer,
// length, memory space, stream) rather than a host span.
//   host buffers:   MPI (make_mpi_link, here);
//   device buffers: NCCL send/recv on a communication stream per tag (make_nccl_link, here)
//                   where every rank of the pipeline has a GPU of its own; else host-staged --
//                   device -> pinned host -> the MPI link -> device, ordered on the buffer's
//                   stream with events (lib/train's CUDA backend, beside its host-staged
//                   reducer). train.stage_link chooses (LinkOptions).
#pragma once

#include <mpi.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/comm/reducer.hpp"

namespace locus::comm {

// One transfer in flight, owned by the caller (a pipeline slot keeps its own) and completed
// by the link that started it. Default: nothing in flight.
struct LinkRequest {
  MPI_Request mpi = MPI_REQUEST_NULL;
  int staging = -1;       // the link's slot for it (a bounce buffer, an event), held until done
  GradientBuffer target;  // a host-staged receive: where the data goes once it has arrived
  bool active() const noexcept { return mpi != MPI_REQUEST_NULL || staging >= 0; }
};

class StageLink {
 public:
  StageLink() = default;
  StageLink(const StageLink&) = delete;
  StageLink& operator=(const StageLink&) = delete;
  virtual ~StageLink() = default;

  // Local, non-blocking: starts sending buf (buf.size floats) to rank `peer` of the link's
  // communicator under `tag`. Messages of one tag between two ranks arrive in the order they
  // were sent, into the receives in the order they were posted (the NCCL link issues a receive
  // at its wait(): wait for the receives of one tag and peer in posting order, or it throws an
  // InternalError). A device buffer is read after the work enqueued on buf.stream so far. buf
  // must stay unchanged until wait(r).
  virtual void send(const GradientBuffer& buf, int peer, int tag, LinkRequest& r) = 0;
  // Local, non-blocking: posts the receive of buf.size floats from `peer` under `tag`.
  virtual void recv(const GradientBuffer& buf, int peer, int tag, LinkRequest& r) = 0;
  // Completes r (returns at once when nothing is in flight). After a receive, buf holds the
  // data for everything enqueued on buf.stream from now on (a device buffer: the copy from the
  // host, or NCCL's receive, is ordered before it); after a send, buf may be reused (by work
  // enqueued on its stream from now on). Host links block until then; the NCCL link does not
  // wait for the transfer here: it orders buf.stream after it with an event. (NCCL connects
  // two ranks at their first transfer, lazily: that first send() or wait() on each channel and
  // peer blocks the host until the peer issues its side, a rendezvous the pipeline's schedules
  // pair up.)
  virtual void wait(LinkRequest& r) = 0;
  // Blocks until every transfer this rank started has completed. Host links: nothing to do
  // (wait() blocks). NCCL: polls for peer errors and gives up after LinkOptions::timeout_s.
  virtual void drain() {}
  // Blocks until the work enqueued on `stream` (a device stream; null: none) so far has
  // completed. Host links: returns at once (their wait() already blocked). NCCL: called before
  // the host waits for a stream that waits for a transfer, it polls for peer errors meanwhile
  // and gives up after LinkOptions::timeout_s, so a dead peer ends the job with an NcclError
  // instead of a wait inside CUDA that only the watchdog ends.
  virtual void settle(void* stream) { (void)stream; }

  virtual std::string_view name() const noexcept = 0;  // "mpi", "mpi-host-staged", "nccl"
};

// train.stage_link: automatic = NCCL between GPU stages where every rank of the pipeline has a
// GPU of its own, else MPI (host-staged for device buffers); mpi; nccl (an error where NCCL
// cannot be used).
enum class LinkBackend { mpi, nccl, automatic };
LinkBackend parse_link_backend(std::string_view name);  // "auto" | "mpi" | "nccl"
std::string_view to_string(LinkBackend b) noexcept;

struct LinkOptions {
  LinkBackend backend = LinkBackend::automatic;
  // NCCL: how long drain() waits for the transfers in flight before it aborts the link and
  // throws an NcclError (0: forever; time stopped by SIGSTOP does not count).
  double timeout_s = 600;
  std::string timeout_key = "train.reducer_timeout_s";  // the option that sets it, for messages
  // Tests only: builds the link between pipeline stages (collective over the pipeline
  // communicator, with the tags the pipeline uses) in place of the choice by backend and
  // memory space, e.g. a model of the NCCL link's ordering over host buffers
  // (tests/train/in_order_link.hpp). Null: by backend.
  std::function<std::unique_ptr<StageLink>(const mpi::Comm&, std::span<const int> tags)> factory;
};

// Collective over comm (duplicated, so the link's messages never mix with the caller's): the
// MPI link for host buffers (InternalError for a device buffer).
std::unique_ptr<StageLink> make_mpi_link(const mpi::Comm& comm);

// Why an NCCL link cannot join comm's ranks, or "" when it can. Collective over comm (the
// ranks compare their devices). Reasons: a build without NCCL, two ranks on one GPU (NCCL
// refuses them in one communicator), a rank without a device.
std::string nccl_link_unusable_reason(const mpi::Comm& comm);

// Collective over comm: the NCCL link for device buffers, with a channel -- an NCCL
// communicator and a stream of its own -- for each tag in `tags` (the only tags it takes).
// Where it cannot be used, a ConfigError (agreed) naming the reason and what to set instead.
//
// How it orders transfers (stricter than MPI's, which buffers): each channel runs its sends
// and receives in the order the host issues them -- a send when send() is called, a receive
// when its wait() is -- and a transfer holds its channel's stream until the peer reaches the
// matching one. So the host must issue one tag's transfers in an order that would not deadlock
// with synchronous sends and receives issued where they are needed, as a pipeline does with
// one tag per direction (activations up, gradients down); tests/train/in_order_link.hpp
// models these rules over host buffers, and test_pipeline runs the pipeline's schedules
// through that model on the CPU. A zero-length transfer moves nothing and needs no peer;
// both sides must agree on every length.
std::unique_ptr<StageLink> make_nccl_link(const mpi::Comm& comm, std::span<const int> tags,
                                          const LinkOptions& options);

}  // namespace locus::comm
