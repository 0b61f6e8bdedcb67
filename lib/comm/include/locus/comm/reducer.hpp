// The data-parallel gradient reducer: a small interface chosen once at start-up (MPI for host
// buffers; NCCL, or MPI host-staged by lib/train, for device buffers) that averages a
// contiguous float gradient buffer across the data-parallel communicator, bucket by bucket
// while the backward pass is still running.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "locus/comm/mpi.hpp"

namespace locus::comm {

// train.reducer: automatic = NCCL for device gradients where NCCL can be used (one GPU per
// rank), else MPI (host-staged for device gradients); mpi; nccl (an error where it cannot).
enum class ReducerBackend { mpi, nccl, automatic };
ReducerBackend parse_reducer_backend(std::string_view name);  // "auto" | "mpi" | "nccl"
std::string_view to_string(ReducerBackend b) noexcept;

// train.reduction: how the MPI reducer moves data between the ranks.
//  flat: every rank exchanges with every other rank (one level).
//  hierarchical: reduce within each node to its leader, a chain of leaders in node order that
//    continues the running sum, broadcast back within each node. Bitwise equal to flat where
//    every node's ranks are consecutive in the communicator (the sum stays in rank order);
//    otherwise summed node by node (deterministic, not bitwise flat). See comm::Topology for
//    how nodes are found and the test-only LOCUS_TEST_RANKS_PER_NODE.
//  automatic: hierarchical where the ranks span several nodes and some node has more than one
//    rank, else flat.
// The NCCL reducer has its own topology-aware algorithms: it accepts automatic (NCCL's own)
// and refuses flat and hierarchical (ConfigError), which would claim an order it does not use.
enum class Reduction { automatic, flat, hierarchical };
Reduction parse_reduction(std::string_view name);  // "auto" | "flat" | "hierarchical"
std::string_view to_string(Reduction r) noexcept;

// train.reducer_precision: the element type the NCCL reducer sums in. fp32: the gradients' own
// (bitwise the MPI reducer's sum at 2 ranks). bf16: each bucket is rounded to bf16 (nearest,
// ties to even) on the device, summed in bf16 by NCCL, and widened back into the fp32 buffer:
// half the bytes on the wire, at the cost of each rank's gradient and each partial sum keeping
// 8 significant bits (the optimizer and its state stay fp32). The NCCL reducer only: the MPI
// reducers (host gradients, or host-staged GPU ones) refuse bf16 (ConfigError).
enum class ReducePrecision { fp32, bf16 };
ReducePrecision parse_reduce_precision(std::string_view name);  // "fp32" | "bf16"
std::string_view to_string(ReducePrecision p) noexcept;

// Where a gradient buffer lives.
enum class MemorySpace { host, cuda };

// A gradient buffer as a compute backend describes it: a reducer for host memory binds to it
// directly; one for device memory (host-staged MPI now, NCCL next) works on `stream`'s order.
// Readiness of a device buffer: when the backend announces a layer (GradsReadyFn), the work
// that writes it has been enqueued on `stream`, not necessarily finished; a reducer orders
// itself after it with an event recorded on that stream.
struct GradientBuffer {
  float* data = nullptr;
  std::size_t size = 0;
  MemorySpace space = MemorySpace::host;
  void* stream = nullptr;  // cudaStream_t of the producer (device buffers)
  // The buffer as a host span (InternalError unless space == host).
  std::span<float> host() const;
};

// What finish() / allreduce_average() leave in the buffer.
enum class ReduceMode {
  // Sum over ranks, then divide every element by the communicator size.
  average,
  // Sum only: the caller already scaled its gradients by 1/size (e.g. folded into the loss),
  // so the sum is the average. Saves one pass over the buffer.
  presummed_average,
};

struct ReducerOptions {
  ReducerBackend backend = ReducerBackend::mpi;
  ReduceMode mode = ReduceMode::average;
  ReducePrecision precision = ReducePrecision::fp32;
  Reduction reduction = Reduction::automatic;
  // Launch granularity of the streaming path: buckets are cut from the END of the buffer
  // (the backward pass fills it end first), so only the first bucket may be short.
  std::size_t bucket_bytes = std::size_t{4} << 20;
  // Transport granularity: every bucket (and every one-shot buffer) travels as chunks of at
  // most this size, pipelined through scratch allocated once, so large buffers never hit the
  // MPI library's per-call temporaries (the 32-64 MiB hole, see bench/comm/RESULTS.md).
  std::size_t chunk_bytes = std::size_t{1} << 20;
  // Chunks at most this large use one exchange round (every rank receives every other rank's
  // whole chunk) instead of reduce-scatter + allgather, and messages at most this large travel
  // as eager-sized fragments instead of one rendezvous: fewer latency rounds for small data.
  std::size_t small_bytes = std::size_t{32} << 10;
  // Chunks in flight at once. Scratch memory is about max_in_flight * chunk_bytes.
  int max_in_flight = 4;
  // NCCL: how long the host waits for a collective (polling NCCL's asynchronous error state)
  // before it aborts the communicator and throws an NcclError; 0: forever. Time a process
  // spends stopped (SIGSTOP, a suspended Slurm job) is not counted.
  double timeout_s = 600;
};

// Timings of the streaming path (seconds). Host reducers (MPI, host-staged) time them on the
// host; the NCCL reducer on the device, with events, and adds each step's once its reduction
// is done (the next finish() or settle(): its totals run one step behind).
struct ReduceTimes {
  // From the first chunk launched to the last chunk seen complete: the communication time
  // (NCCL: from where the first bucket may start on the communication stream to the end of
  // the last).
  double comm_s = 0;
  // Time spent inside finish(): the part of comm_s the caller waited for (NCCL: the part the
  // producer's stream waited for after its backward pass).
  double blocked_s = 0;
  // Time spent inside ready_from() (MPI_Test, local reductions): work taken from compute
  // (NCCL: the host's time in ready_from() and finish(), enqueueing and waiting for the
  // previous step).
  double progress_s = 0;
  // Share of the communication hidden behind compute: 1 - blocked/comm, in [0, 1]. Over
  // shared-memory MPI the CPU itself moves the bytes inside ready_from()/finish(), so this
  // share is overlap in time, not free work: progress_s + blocked_s against the one-shot time
  // is what the step saves (bench/comm/overlap_bench.cpp measures both).
  double hidden_fraction() const noexcept;
};

struct ReducerStats {
  std::int64_t steps = 0;   // completed finish() calls
  ReduceTimes last;         // the last completed step
  ReduceTimes total;        // summed over all steps
  std::int64_t oneshot_calls = 0;
  double oneshot_s = 0;     // time inside allreduce_average()
};

// Streaming protocol for one step over a bound gradient buffer of N floats:
//   backward of the last layer writes [off_L, N)   -> ready_from(off_L)
//   backward of layer L-1 writes [off_{L-1}, off_L) -> ready_from(off_{L-1})
//   ...                                              -> finish()
// ready_from() launches every bucket that is now entirely inside [offset, N) and progresses
// the chunks in flight, so communication overlaps the next layer's compute; finish() launches
// whatever is left, completes everything and leaves the reduced gradients in place. The next
// ready_from() after finish() starts a new step; buffers are allocated once, at construction.
//
// Communication advances only inside these calls (MPI has no progress thread here): call
// ready_from() after every layer, even when no new bucket is complete. Not thread-safe: one
// thread drives a reducer.
//
// Results are deterministic and bitwise identical on every rank: each element is reduced as
// ((x_0 + x_1) + x_2) + ... in rank order, in float, then divided by the size (average mode),
// whatever the bucket, chunk or protocol sizes; the streaming and one-shot paths agree bit for
// bit.
class GradientReducer {
 public:
  GradientReducer() = default;
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;
  virtual ~GradientReducer() = default;

  // Local, non-blocking. Elements [offset, N) of the bound buffer are final for this step.
  // Offsets must not increase within a step. Ranks may call it at different offsets (only the
  // bucket layout, fixed at construction, decides what travels together).
  virtual void ready_from(std::size_t offset) = 0;
  // Collective over the reducer's communicator: completes the step.
  virtual void finish() = 0;
  // Collective over the reducer's communicator: reduces data (any size, identical on every
  // rank) in place, blocking. Must not be called between ready_from() and finish().
  virtual void allreduce_average(std::span<float> data) = 0;
  // Local, called before the host waits for `stream` (a device stream that finish() ordered
  // after a reduction: a step's loss sums, its gradient norm, its state): blocks until the last
  // finished step's reduction has completed -- all the stream can wait for from this reducer
  // -- so that the host's wait is then held only by the stream's own work or by what else it
  // waits for (a pipeline stage's link settles that). Callable mid-step (the buckets already
  // enqueued are not waited for). Host reducers: returns at once (finish() already blocked).
  // NCCL: polls NCCL's error state meanwhile and gives up after ReducerOptions::timeout_s, so
  // a dead peer ends the job with an NcclError naming the all-reduce instead of a wait inside
  // CUDA.
  virtual void settle(void* stream) { (void)stream; }

  virtual const ReducerStats& stats() const noexcept = 0;
  virtual std::string_view name() const noexcept = 0;
  virtual int comm_size() const noexcept = 0;
  // Which reduction runs and why, e.g. "hierarchical (train.reduction = auto: 4 ranks on 2
  // nodes (2+2; ...); summed in rank order: bitwise equal to flat)"; NCCL: its own.
  virtual std::string reduction() const = 0;
};

// Collective over comm (the data-parallel communicator), which is duplicated so the reducer's
// messages never mix with the caller's. grads is the gradient buffer of the streaming path;
// it must have the same length on every rank and outlive the reducer. Options are validated
// on every rank and must be identical everywhere (ConfigError, on all ranks, otherwise).
std::unique_ptr<GradientReducer> make_gradient_reducer(const mpi::Comm& comm,
                                                       std::span<float> grads,
                                                       const ReducerOptions& options = {});

// Why the NCCL reducer cannot reduce `grads` over comm, or "" when it can. Collective over
// comm (the ranks compare their devices). Reasons: a build without NCCL, gradients in host
// memory, two ranks on one GPU (NCCL refuses them in one communicator), a rank without a
// device.
std::string nccl_unusable_reason(const mpi::Comm& comm, const GradientBuffer& grads);

// Collective over comm (duplicated): the NCCL reducer of a device buffer written on
// grads.stream. Where it cannot be used, a ConfigError (agreed) naming the reason and what to
// set instead. Options as make_gradient_reducer's (mode: presummed_average = ncclSum,
// average = ncclAvg; the chunk options do not apply).
std::unique_ptr<GradientReducer> make_nccl_reducer(const mpi::Comm& comm,
                                                   const GradientBuffer& grads,
                                                   const ReducerOptions& options);

// "NCCL 2.28.9", or "no NCCL in this build".
std::string nccl_version();

// What a ConfigError says of train.reducer_precision = bf16 where the gradients go through
// `reducer` (an MPI reducer, and why), which sums in fp32 only.
std::string bf16_sum_refusal(std::string_view reducer);

}  // namespace locus::comm
