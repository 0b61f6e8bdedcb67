// The NCCL communicator shared by the NCCL reducer and the NCCL stage link (nccl_comm.hpp).
#include "nccl_comm.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "locus/comm/error.hpp"
#include "nccl_entry.hpp"

namespace locus::comm::detail {

namespace {

using Clock = std::chrono::steady_clock;

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

// The process's communicators that are made and not yet closed or aborted (abort_all).
std::mutex live_mutex;
std::vector<NcclComm*> live;

// ncclCommAbort on each of comms at once, a thread each (inline where a thread cannot start).
void abort_concurrently(const std::vector<ncclComm_t>& comms) noexcept {
  if (comms.size() == 1) {
    ncclCommAbort(comms.front());
    return;
  }
  std::vector<std::thread> threads;
  std::size_t started = 0;
  try {
    threads.reserve(comms.size());
    for (; started < comms.size(); ++started) {
      threads.emplace_back([c = comms[started]] { ncclCommAbort(c); });
    }
  } catch (...) {  // std::system_error: no thread to be had
  }
  for (std::size_t i = started; i < comms.size(); ++i) ncclCommAbort(comms[i]);
  for (std::thread& t : threads) t.join();
}

}  // namespace

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

void cuda_fail(cudaError_t rc, const char* call, const char* file, int line) {
  throw CudaError(fmt::format("{} failed: {} ({}) at {} on {}", call, cudaGetErrorName(rc),
                              cudaGetErrorString(rc), where(file, line), device_text()));
}

bool event_done(cudaEvent_t e) {
  const cudaError_t rc = cudaEventQuery(e);
  if (rc == cudaSuccess) return true;
  if (rc == cudaErrorNotReady) return false;
  cuda_fail(rc, "cudaEventQuery", __FILE__, __LINE__);
}

std::string duplicate_device_reason(const mpi::Comm& comm, std::string_view role) {
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
      return fmt::format("{} rank {} on {} has no current CUDA device", role, a, all[a].host);
    }
    for (std::size_t b = a + 1; b < all.size(); ++b) {
      if (std::strcmp(all[a].host, all[b].host) == 0 && std::strcmp(all[a].bus, all[b].bus) == 0) {
        return fmt::format("{} ranks {} and {} share GPU {} on {} (NCCL refuses two ranks of "
                           "one communicator on one device)",
                           role, a, b, all[a].bus, all[a].host);
      }
    }
  }
  return "";
}

void pin_deterministic_algorithm() {
  setenv("NCCL_ALGO", "Ring", 0);
  setenv("NCCL_PROTO", "Simple", 0);
}

NcclComm::NcclComm(const mpi::Comm& comm, std::string role, NcclTimeout timeout)
    : rank_(comm.rank()), size_(comm.size()), role_(std::move(role)), timeout_(std::move(timeout)) {
  // Rank 0's id and the result of making it, together: a failure there must reach every rank,
  // which would otherwise wait in the broadcast for an id that never comes.
  struct {
    ncclUniqueId id;
    int rc;
  } root{};
  if (comm.is_root()) root.rc = static_cast<int>(ncclGetUniqueId(&root.id));
  LOCUS_MPI_CHECK(MPI_Bcast(&root, sizeof(root), MPI_BYTE, 0, comm.get()));
  if (root.rc != ncclSuccess) {
    fail(static_cast<ncclResult_t>(root.rc),
         comm.is_root() ? "ncclGetUniqueId" : "ncclGetUniqueId (on rank 0)");
  }
  const ncclUniqueId& id = root.id;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // abortable while a peer is stuck
  const ncclResult_t rc = ncclCommInitRankConfig(&nccl_, size_, id, rank_, &config);
  if (rc != ncclSuccess && rc != ncclInProgress) fail(rc, "ncclCommInitRankConfig");
  // The set-up waits at least kSetupLimitS whatever the operations' timeout: a process's
  // first communicator loads and probes (seconds; more with many ranks over sockets), and a
  // short timeout meant for stuck transfers would fail a healthy start.
  setting_up_ = true;
  await("ncclCommInitRankConfig", [] { return true; });
  setting_up_ = false;
  const std::lock_guard lock(live_mutex);
  live.push_back(this);
}

NcclComm::~NcclComm() { close(false); }

void NcclComm::forget() noexcept {
  const std::lock_guard lock(live_mutex);
  std::erase(live, this);
}

void NcclComm::abort_all() noexcept {
  std::vector<ncclComm_t> comms;
  if (nccl_ != nullptr) comms.push_back(std::exchange(nccl_, nullptr));  // live or not yet
  {
    const std::lock_guard lock(live_mutex);
    for (NcclComm* c : live) {
      if (c->nccl_ != nullptr) comms.push_back(std::exchange(c->nccl_, nullptr));
    }
    live.clear();
  }
  if (!comms.empty()) abort_concurrently(comms);
}

void NcclComm::issued(ncclResult_t rc, const char* call) {
  if (nccl_ == nullptr) aborted_already(call);  // NCCL's "invalid argument" would say less
  if (rc == ncclInProgress) {
    await(call, [] { return true; });
  } else if (rc != ncclSuccess) {
    fail(rc, call);
  }
}

void NcclComm::await(const char* what, const std::function<bool()>& done) {
  constexpr auto kMaxTick = std::chrono::seconds(1);
  // Spin for the first millisecond: the host waits here once a step or more (the previous
  // step's reduction, a step's loss sums), mostly for well under that, and a sleep's wake-up
  // (~50-100 us) would show in a 100 us step.
  constexpr auto kSpin = std::chrono::milliseconds(1);
  Clock::duration waited{};
  const auto start = Clock::now();
  auto last = start;
  const double seconds = setting_up_ && timeout_.seconds > 0
                             ? std::max(timeout_.seconds, kSetupLimitS)
                             : timeout_.seconds;
  const auto limit = std::chrono::duration<double>(seconds);
  while (true) {
    if (nccl_ == nullptr) aborted_already(what);
    ncclResult_t st = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(nccl_, &st);
    if (rc != ncclSuccess) fail(rc, "ncclCommGetAsyncError");
    if (st != ncclSuccess && st != ncclInProgress) fail(st, what);
    if (st == ncclSuccess && done()) return;
    const auto now = Clock::now();
    waited += std::min<Clock::duration>(now - last, kMaxTick);
    last = now;
    if (seconds > 0 && waited > limit) {
      abort_all();
      if (setting_up_) {
        throw NcclError(fmt::format(
            "{} did not complete within {:g} s, the NCCL set-up's limit (the longer of {} and "
            "{:g} s) ({}): a peer rank died, stopped or hangs before the communicator was made; "
            "it was aborted. HINT: look at the other ranks' logs for the first error",
            what, seconds, timeout_.key, kSetupLimitS, here()));
      }
      throw NcclError(fmt::format(
          "{} did not complete within {} = {:g} s ({}): a peer rank died, stopped or hangs; the "
          "NCCL communicator was aborted. HINT: look at the other ranks' logs for the first "
          "error, or raise {} for very slow steps",
          what, timeout_.key, timeout_.seconds, here(), timeout_.key));
    }
    if (now - start > kSpin) std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void NcclComm::check(const char* what) {
  if (nccl_ == nullptr) aborted_already(what);
  ncclResult_t st = ncclSuccess;
  const ncclResult_t rc = ncclCommGetAsyncError(nccl_, &st);
  if (rc != ncclSuccess) fail(rc, "ncclCommGetAsyncError");
  if (st != ncclSuccess && st != ncclInProgress) fail(st, what);
}

void NcclComm::fail(ncclResult_t rc, const char* call) {
  const char* last = nccl_ != nullptr ? ncclGetLastError(nccl_) : "";
  const std::string text = fmt::format("{} failed: {} ({}{}{}) on {}", call,
                                       ncclGetErrorString(rc), static_cast<int>(rc),
                                       last != nullptr && *last ? ": " : "",
                                       last != nullptr ? last : "", here());
  abort_all();
  throw NcclError(text);
}

void NcclComm::aborted_already(const char* what) const {
  throw NcclError(fmt::format(
      "{} on {}: its NCCL communicator was aborted after an earlier NCCL error or timeout in "
      "this process (the first error says which)",
      what, here()));
}

void NcclComm::close(bool healthy) noexcept {
  if (nccl_ == nullptr) return;
  if (!healthy) {
    abort_all();
    return;
  }
  forget();
  {
    // On a non-blocking communicator the finalization runs in the background: the call
    // returns ncclInProgress, and ncclCommGetAsyncError says when it is done.
    const ncclResult_t rc = ncclCommFinalize(nccl_);
    healthy = rc == ncclSuccess || rc == ncclInProgress;
  }
  if (healthy) {
    ncclResult_t st = ncclInProgress;
    const auto start = Clock::now();
    while (st == ncclInProgress && Clock::now() - start < std::chrono::seconds(10)) {
      if (ncclCommGetAsyncError(nccl_, &st) != ncclSuccess) break;
      if (st == ncclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    healthy = st == ncclSuccess;
  }
  if (healthy) {
    ncclCommDestroy(nccl_);
  } else {
    ncclCommAbort(nccl_);
  }
  nccl_ = nullptr;
}

std::string NcclComm::here() const {
  return fmt::format("{} rank {}/{} on {}, {}", role_, rank_, size_, mpi::hostname(),
                     device_text());
}

}  // namespace locus::comm::detail
