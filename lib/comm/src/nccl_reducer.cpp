// The NCCL gradient reducer (built with LOCUS_WITH_NCCL): buckets of a device gradient buffer,
// cut from its end as the MPI reducer cuts them, each all-reduced in place by NCCL on a
// communication stream of the reducer's own as soon as the compute stream has produced it (an
// event recorded on the producer's stream, waited on by the communication stream); finish()
// makes the producer's stream wait for the last bucket, so the optimizer never reads a
// gradient before it is reduced, and the host never waits for the step it just enqueued.
//
// The NCCL communicator is made from the MPI communicator (rank 0's ncclGetUniqueId sent with
// MPI_Bcast, ncclCommInitRankConfig on the rank's current device) in non-blocking mode, so a
// collective stuck on a dead or stopped peer can be aborted: whenever the host waits (set-up,
// finish() waiting for the PREVIOUS step, the destructor) it polls ncclCommGetAsyncError and
// gives up after options.timeout_s with ncclCommAbort and an NcclError naming the collective,
// the rank, the host and the device. A SIGSTOP counts as at most one poll interval of that
// time, so a suspended job does not time out when it is continued.
//
// Determinism: NCCL's ring all-reduce adds in a fixed order for a fixed communicator, size
// and algorithm; unless the user set them, NCCL_ALGO=Ring and NCCL_PROTO=Simple are pinned
// before the communicator is made (README, "GPU training"), so the same run on the
// same GPUs gives the same bits.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/comm/reducer.hpp"
#include "nccl_reducer.hpp"

namespace locus::comm::detail {

namespace {

using Clock = std::chrono::steady_clock;

std::string device_text() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return "no device";
  }
  char bus[32] = "?";
  if (cudaDeviceGetPCIBusId(bus, sizeof(bus), device) != cudaSuccess) cudaGetLastError();
  return fmt::format("GPU {} ({})", device, bus);
}

[[noreturn]] void cuda_fail(cudaError_t rc, const char* call, const char* file, int line) {
  throw CudaError(fmt::format("{} failed: {} ({}) at {} on {}", call, cudaGetErrorName(rc),
                              cudaGetErrorString(rc), where(file, line), device_text()));
}

#define LOCUS_NCCL_CUDA(call)                                                              \
  do {                                                                                     \
    const cudaError_t locus_rc_ = (call);                                                  \
    if (locus_rc_ != cudaSuccess) cuda_fail(locus_rc_, #call, __FILE__, __LINE__);         \
  } while (0)

// "rank r/n host, GPU d (bus)": where a message comes from.
std::string here(const mpi::Comm& comm) {
  return fmt::format("data-parallel rank {}/{} on {}, {}", comm.rank(), comm.size(),
                     mpi::hostname(), device_text());
}

// Pins what makes the ring reduction's summation order fixed, unless the user chose.
void pin_deterministic_algorithm() {
  setenv("NCCL_ALGO", "Ring", 0);
  setenv("NCCL_PROTO", "Simple", 0);
}

struct PeerDevice {
  char host[64];
  char bus[32];
};

// The host as NCCL tells hosts apart: NCCL_HOSTID where it is set (the test-only way to put
// two ranks of one GPU in one communicator: each rank claims a host of its own, README "GPU
// training"), else the host name.
std::string nccl_host_identity() {
  const char* id = std::getenv("NCCL_HOSTID");
  return id != nullptr && *id != '\0' ? std::string(id) : mpi::hostname();
}

}  // namespace

std::string duplicate_device_reason(const mpi::Comm& comm) {
  PeerDevice mine{};
  std::strncpy(mine.host, nccl_host_identity().c_str(), sizeof(mine.host) - 1);
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetPCIBusId(mine.bus, sizeof(mine.bus), device) != cudaSuccess) {
    cudaGetLastError();
    std::strncpy(mine.bus, "none", sizeof(mine.bus) - 1);
  }
  std::vector<PeerDevice> all(static_cast<std::size_t>(comm.size()));
  LOCUS_MPI_CHECK(MPI_Allgather(&mine, sizeof(mine), MPI_BYTE, all.data(), sizeof(mine), MPI_BYTE,
                                comm.get()));
  for (std::size_t a = 0; a < all.size(); ++a) {
    if (std::strcmp(all[a].bus, "none") == 0) {
      return fmt::format("data-parallel rank {} on {} has no current CUDA device", a,
                         all[a].host);
    }
    for (std::size_t b = a + 1; b < all.size(); ++b) {
      if (std::strcmp(all[a].host, all[b].host) == 0 && std::strcmp(all[a].bus, all[b].bus) == 0) {
        return fmt::format("data-parallel ranks {} and {} share GPU {} on {} (NCCL refuses two "
                           "ranks of one communicator on one device)",
                           a, b, all[a].bus, all[a].host);
      }
    }
  }
  return "";
}

class NcclReducer final : public GradientReducer {
 public:
  NcclReducer(mpi::Comm comm, const GradientBuffer& grads, const ReducerOptions& options)
      : comm_(std::move(comm)),
        data_(grads.data),
        size_(grads.size),
        producer_(static_cast<cudaStream_t>(grads.stream)),
        options_(options) {
    LOCUS_NCCL_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&produced_, cudaEventDisableTiming));
    for (auto& e : done_) LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    build_buckets();
    pin_deterministic_algorithm();
    ncclUniqueId id{};
    if (comm_.is_root()) check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    comm_.bcast(std::span<char>(id.internal, sizeof(id.internal)), 0);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // abortable while a peer is stuck
    const ncclResult_t rc =
        ncclCommInitRankConfig(&nccl_, comm_.size(), id, comm_.rank(), &config);
    if (rc != ncclSuccess && rc != ncclInProgress) fail(rc, "ncclCommInitRankConfig");
    await("ncclCommInitRankConfig", [] { return true; });
  }

  ~NcclReducer() override {
    // Never throws: on a broken or stuck communicator abort it instead of finalizing.
    bool healthy = nccl_ != nullptr;
    if (healthy) {
      try {
        await("the last gradient all-reduce", [this] { return query(done_[0]) && query(done_[1]); });
      } catch (...) {
        healthy = false;
      }
    }
    if (nccl_ != nullptr) {
      if (healthy && ncclCommFinalize(nccl_) != ncclSuccess) healthy = false;
      if (healthy) {
        ncclResult_t st = ncclInProgress;
        const auto start = Clock::now();
        while (st == ncclInProgress && Clock::now() - start < std::chrono::seconds(10)) {
          if (ncclCommGetAsyncError(nccl_, &st) != ncclSuccess) break;
        }
        healthy = st == ncclSuccess;
      }
      if (healthy) {
        ncclCommDestroy(nccl_);
      } else {
        ncclCommAbort(nccl_);
      }
    }
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
    if (produced_ != nullptr) cudaEventDestroy(produced_);
    for (auto e : done_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
  }

  // Launches every bucket now wholly inside [offset, N), after the work the producer's stream
  // has queued so far.
  void ready_from(std::size_t offset) override {
    if (!in_step_) begin_step();
    bool recorded = false;
    while (next_ < buckets_.size() && buckets_[next_].offset >= offset) {
      if (!recorded) {
        LOCUS_NCCL_CUDA(cudaEventRecord(produced_, producer_));
        LOCUS_NCCL_CUDA(cudaStreamWaitEvent(stream_, produced_, 0));
        recorded = true;
      }
      const Bucket& b = buckets_[next_++];
      float* p = data_ + b.offset;
      const ncclRedOp_t op = options_.mode == ReduceMode::average ? ncclAvg : ncclSum;
      const ncclResult_t rc = ncclAllReduce(p, p, b.count, ncclFloat32, op, nccl_, stream_);
      if (rc == ncclInProgress) {
        await("ncclAllReduce", [] { return true; });
      } else if (rc != ncclSuccess) {
        fail(rc, "ncclAllReduce");
      }
    }
  }

  // Enqueues the rest, makes the producer wait for it, and waits (on the host) only for the
  // previous step's reduction: the host stays one step ahead and a stuck peer is noticed.
  void finish() override {
    const auto t0 = Clock::now();
    ready_from(0);
    cudaEvent_t done = done_[step_parity_];
    LOCUS_NCCL_CUDA(cudaEventRecord(done, stream_));
    LOCUS_NCCL_CUDA(cudaStreamWaitEvent(producer_, done, 0));
    cudaEvent_t previous = done_[step_parity_ ^ 1];
    await("the gradient all-reduce of the previous step", [&] { return query(previous); });
    step_parity_ ^= 1;
    in_step_ = false;
    const double blocked = std::chrono::duration<double>(Clock::now() - t0).count();
    ++stats_.steps;
    stats_.last.blocked_s = blocked;
    stats_.total.blocked_s += blocked;
  }

  // Host data (rarely used): MPI on the reducer's own communicator.
  void allreduce_average(std::span<float> data) override {
    const auto t0 = Clock::now();
    comm_.allreduce_inplace(data, MPI_SUM);
    if (options_.mode == ReduceMode::average) {
      const float inv = 1.0f / static_cast<float>(comm_.size());
      for (float& v : data) v *= inv;
    }
    ++stats_.oneshot_calls;
    stats_.oneshot_s += std::chrono::duration<double>(Clock::now() - t0).count();
  }

  const ReducerStats& stats() const noexcept override { return stats_; }
  std::string_view name() const noexcept override { return "nccl"; }
  int comm_size() const noexcept override { return comm_.size(); }
  std::string reduction() const override {
    return "NCCL's own (topology-aware within and across nodes; train.reduction = auto)";
  }

 private:
  struct Bucket {
    std::size_t offset = 0, count = 0;
  };

  // Buckets of bucket_bytes cut from the end (the backward pass fills the buffer end first);
  // only the first may be short. Bucket k of the list is the k-th to become ready.
  void build_buckets() {
    const std::size_t per = std::max<std::size_t>(options_.bucket_bytes / sizeof(float), 1);
    for (std::size_t end = size_; end > 0;) {
      const std::size_t begin = end > per ? end - per : 0;
      buckets_.push_back({begin, end - begin});
      end = begin;
    }
  }

  void begin_step() {
    next_ = 0;
    in_step_ = true;
  }

  bool query(cudaEvent_t e) {
    const cudaError_t rc = cudaEventQuery(e);
    if (rc == cudaSuccess) return true;
    if (rc == cudaErrorNotReady) return false;
    cuda_fail(rc, "cudaEventQuery", __FILE__, __LINE__);
  }

  // Polls until done() and the communicator has no operation in progress, failing on an
  // asynchronous NCCL error or after options_.timeout_s of polling (each interval counted as
  // at most kMaxTick, so time spent stopped does not count).
  void await(const char* what, const std::function<bool()>& done) {
    constexpr auto kMaxTick = std::chrono::seconds(1);
    Clock::duration waited{};
    auto last = Clock::now();
    const auto limit = std::chrono::duration<double>(options_.timeout_s);
    for (int spins = 0;; ++spins) {
      ncclResult_t st = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(nccl_, &st);
      if (rc != ncclSuccess) fail(rc, "ncclCommGetAsyncError");
      if (st != ncclSuccess && st != ncclInProgress) fail(st, what);
      if (st == ncclSuccess && done()) return;
      const auto now = Clock::now();
      waited += std::min<Clock::duration>(now - last, kMaxTick);
      last = now;
      if (options_.timeout_s > 0 && waited > limit) {
        ncclCommAbort(nccl_);
        nccl_ = nullptr;
        throw NcclError(fmt::format(
            "{} did not complete within train.reducer_timeout_s = {:g} s ({}): a peer rank "
            "died, stopped or hangs; the NCCL communicator was aborted. HINT: look at the other "
            "ranks' logs for the first error, or raise train.reducer_timeout_s for very slow "
            "steps",
            what, options_.timeout_s, here(comm_)));
      }
      if (spins > 100) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void check(ncclResult_t rc, const char* call) {
    if (rc != ncclSuccess) fail(rc, call);
  }

  [[noreturn]] void fail(ncclResult_t rc, const char* call) {
    const char* last = nccl_ != nullptr ? ncclGetLastError(nccl_) : "";
    const std::string text = fmt::format("{} failed: {} ({}{}{}) on {}", call,
                                         ncclGetErrorString(rc), static_cast<int>(rc),
                                         last != nullptr && *last ? ": " : "",
                                         last != nullptr ? last : "", here(comm_));
    if (nccl_ != nullptr) {
      ncclCommAbort(nccl_);
      nccl_ = nullptr;
    }
    throw NcclError(text);
  }

  mpi::Comm comm_;
  float* data_;
  std::size_t size_;
  cudaStream_t producer_;
  ReducerOptions options_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t produced_ = nullptr;
  std::array<cudaEvent_t, 2> done_{};
  int step_parity_ = 0;
  ncclComm_t nccl_ = nullptr;
  std::vector<Bucket> buckets_;
  std::size_t next_ = 0;
  bool in_step_ = false;
  ReducerStats stats_;
};

std::unique_ptr<GradientReducer> make_nccl(mpi::Comm comm, const GradientBuffer& grads,
                                           const ReducerOptions& options) {
  return std::make_unique<NcclReducer>(std::move(comm), grads, options);
}

std::string nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return "NCCL (version unknown)";
  return fmt::format("NCCL {}.{}.{}", v / 10000, v / 100 % 100, v % 100);
}

}  // namespace locus::comm::detail
