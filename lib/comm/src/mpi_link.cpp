// The MPI stage link for host buffers: MPI_Isend / MPI_Irecv of floats on a communicator of
// its own, MPI_Wait to complete (MPI's non-overtaking rule keeps each tag's messages in order).
#include <fmt/format.h>

#include <limits>

#include "locus/comm/error.hpp"
#include "locus/comm/link.hpp"

namespace locus::comm {

namespace {

int count_of(const GradientBuffer& buf) {
  LOCUS_ASSERT(buf.space == MemorySpace::host,
               "the MPI stage link moves host buffers (a device buffer needs a host-staged or "
               "NCCL link)");
  LOCUS_ASSERT(buf.size <= static_cast<std::size_t>(std::numeric_limits<int>::max()),
               fmt::format("a stage transfer of {} floats is over MPI's int count", buf.size));
  return static_cast<int>(buf.size);
}

class MpiLink final : public StageLink {
 public:
  explicit MpiLink(mpi::Comm comm) : comm_(std::move(comm)) {}

  void send(const GradientBuffer& buf, int peer, int tag, LinkRequest& r) override {
    LOCUS_ASSERT(!r.active(), "a link request was reused while its transfer is in flight");
    LOCUS_MPI_CHECK(MPI_Isend(buf.data, count_of(buf), MPI_FLOAT, peer, tag, comm_.get(), &r.mpi));
  }
  void recv(const GradientBuffer& buf, int peer, int tag, LinkRequest& r) override {
    LOCUS_ASSERT(!r.active(), "a link request was reused while its transfer is in flight");
    LOCUS_MPI_CHECK(MPI_Irecv(buf.data, count_of(buf), MPI_FLOAT, peer, tag, comm_.get(), &r.mpi));
  }
  void wait(LinkRequest& r) override {
    if (r.mpi != MPI_REQUEST_NULL) LOCUS_MPI_CHECK(MPI_Wait(&r.mpi, MPI_STATUS_IGNORE));
  }
  std::string_view name() const noexcept override { return "mpi"; }

 private:
  mpi::Comm comm_;
};

}  // namespace

std::unique_ptr<StageLink> make_mpi_link(const mpi::Comm& comm) {
  return std::make_unique<MpiLink>(comm.dup());
}

}  // namespace locus::comm
