// The stage-to-stage link of pipeline parallelism: non-blocking point-to-point transfers of
// float buffers (activations forward, their gradients back) between neighbouring ranks of a
// pipeline communicator. Shaped like the gradient reducer (reducer.hpp): a small interface
// chosen once at start-up by where the buffers live, over a buffer description (pointer,
// length, memory space, stream) rather than a host span.
//   host buffers:   MPI (make_mpi_link, here);
//   device buffers: host-staged -- device -> pinned host -> this MPI link -> device, ordered on
//                   the buffer's stream with events (lib/train's CUDA backend, beside its
//                   host-staged reducer);
//   next:           NCCL send/recv on the buffer's stream (one more implementation of StageLink
//                   beside the NCCL reducer, picked by the same factory; nothing else changes).
#pragma once

#include <mpi.h>

#include <memory>
#include <string_view>

#include "locus/comm/mpi.hpp"
#include "locus/comm/reducer.hpp"

namespace locus::comm {

// One transfer in flight, owned by the caller (a pipeline slot keeps its own) and completed
// by the link that started it. Default: nothing in flight.
struct LinkRequest {
  MPI_Request mpi = MPI_REQUEST_NULL;
  int staging = -1;       // a host-staged link's bounce buffer, held until the transfer is done
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
  // were sent, into the receives in the order they were posted. A device buffer is read after
  // the work enqueued on buf.stream so far. buf must stay unchanged until wait(r).
  virtual void send(const GradientBuffer& buf, int peer, int tag, LinkRequest& r) = 0;
  // Local, non-blocking: posts the receive of buf.size floats from `peer` under `tag`.
  virtual void recv(const GradientBuffer& buf, int peer, int tag, LinkRequest& r) = 0;
  // Blocks until r is complete (returns at once when nothing is in flight). After a receive,
  // buf holds the data for everything enqueued on buf.stream from now on (a device buffer:
  // the copy from the host is ordered before it); after a send, buf may be reused (for work
  // enqueued on its stream from now on).
  virtual void wait(LinkRequest& r) = 0;

  virtual std::string_view name() const noexcept = 0;  // "mpi", "mpi-host-staged"
};

// Collective over comm (duplicated, so the link's messages never mix with the caller's): the
// MPI link for host buffers (InternalError for a device buffer).
std::unique_ptr<StageLink> make_mpi_link(const mpi::Comm& comm);

}  // namespace locus::comm
