// Private to lib/comm (built with LOCUS_WITH_NCCL): an NCCL communicator over the ranks of an
// MPI communicator, and what the NCCL gradient reducer and the NCCL stage link share about
// it: how it is made, how the host waits for it, how its errors read.
//
// The communicator is made from the MPI communicator (rank 0's ncclGetUniqueId sent with
// MPI_Bcast, ncclCommInitRankConfig on the rank's current device) in non-blocking mode, so an
// operation stuck on a dead or stopped peer can be aborted: whenever the host waits it polls
// ncclCommGetAsyncError and gives up after the timeout with ncclCommAbort and an NcclError
// naming the operation, the rank, the host and the device. A SIGSTOP counts as at most one
// poll interval of that time, so a suspended job does not time out when it is continued.
//
// An abort ends every communicator of the process, all at once (abort_all). ncclCommAbort
// returns only once each kernel its communicator launched has started and seen the abort, and
// such a kernel may sit in a stream behind work that waits for another communicator's
// transfer -- a stage link's send queued behind the compute stream, which waits for the other
// channel's receive from a dead peer; a reducer's bucket behind a stage's receive. Aborted one
// at a time, the first abort could wait forever for a kernel that only a later one would free.
// What aborts: a timeout, an NCCL error, and any unclean close -- a link or reducer destroyed
// while an exception unwinds or mid-step, whatever the error was. Each of those ends the job,
// so nothing is lost by ending them all.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <functional>
#include <string>
#include <string_view>

#include "locus/comm/mpi.hpp"

namespace locus::comm::detail {

// "GPU 0 (0000:19:00.0)" for the current device, or "no device".
std::string device_text();

// A CudaError naming the call, where it was made and the current device.
[[noreturn]] void cuda_fail(cudaError_t rc, const char* call, const char* file, int line);

#define LOCUS_NCCL_CUDA(call)                                                                   \
  do {                                                                                          \
    const cudaError_t locus_rc_ = (call);                                                       \
    if (locus_rc_ != cudaSuccess) ::locus::comm::detail::cuda_fail(locus_rc_, #call, __FILE__, \
                                                                   __LINE__);                   \
  } while (0)

// Whether the work recorded in e has completed (a CudaError on a failed query).
bool event_done(cudaEvent_t e);

// Pins what makes NCCL's summation order fixed (NCCL_ALGO=Ring, NCCL_PROTO=Simple), unless the
// user set them: the same run on the same GPUs gives the same bits.
void pin_deterministic_algorithm();

// What a wait gives up after: seconds (0: never) and the option that sets them, for messages.
struct NcclTimeout {
  double seconds = 600;
  std::string key = "train.reducer_timeout_s";
};

class NcclComm {
 public:
  // Collective over comm: a non-blocking NCCL communicator of comm's ranks, each on its current
  // device. `role` names the ranks in messages ("data-parallel", "pipeline").
  NcclComm(const mpi::Comm& comm, std::string role, NcclTimeout timeout);
  // Aborts a communicator that close() did not finish. Never throws.
  ~NcclComm();
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  ncclComm_t get() const noexcept { return nccl_; }

  // The result of an NCCL call that enqueues work: ncclInProgress is waited out (the call is
  // then issued), anything else but ncclSuccess fails.
  void issued(ncclResult_t rc, const char* call);
  // Polls until done() and the communicator has no operation in progress; fails on an
  // asynchronous NCCL error, and after the timeout aborts (abort_all) and throws an NcclError
  // naming `what` (each poll interval counted as at most a second). On a communicator aborted
  // already (another's error), an NcclError saying so.
  void await(const char* what, const std::function<bool()>& done);
  // Without waiting: fails (as await) when NCCL reports an asynchronous error.
  void check(const char* what);
  // Aborts (abort_all) and throws an NcclError naming the call and NCCL's last error.
  [[noreturn]] void fail(ncclResult_t rc, const char* call);

  // Finalizes and destroys the communicator when `healthy` (every operation waited for) and
  // NCCL agrees within 10 s, else aborts it with every other communicator of the process
  // (abort_all; an abort also ends NCCL kernels stuck on a dead peer). Never throws;
  // idempotent.
  void close(bool healthy) noexcept;

  // "pipeline rank 1/2 on host, GPU 0 (0000:19:00.0)": where a message comes from.
  std::string here() const;

 private:
  // Aborts this communicator and every other live one of the process concurrently (a thread
  // per communicator: each sets its abort flag at once, then waits for its kernels), and
  // leaves them all without one. Never throws.
  void abort_all() noexcept;
  void forget() noexcept;  // leaves the registry of live communicators
  [[noreturn]] void aborted_already(const char* what) const;

  int rank_ = 0;
  int size_ = 0;
  std::string role_;
  NcclTimeout timeout_;
  // While the communicator is made, waits give up after at least kSetupLimitS (nccl_comm.cpp).
  static constexpr double kSetupLimitS = 60;
  bool setting_up_ = false;
  ncclComm_t nccl_ = nullptr;
};

}  // namespace locus::comm::detail
