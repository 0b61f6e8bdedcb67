// The NCCL gradient reducer (built with LOCUS_WITH_NCCL): buckets of a device gradient buffer,
// cut from its end as the MPI reducer cuts them, each all-reduced in place by NCCL on a
// communication stream of the reducer's own as soon as the compute stream has produced it (an
// event recorded on the producer's stream, waited on by the communication stream); finish()
// makes the producer's stream wait for the last bucket, so the optimizer never reads a
// gradient before it is reduced, and the host never waits for the step it just enqueued.
//
// The NCCL communicator (nccl_comm.hpp) is non-blocking, so a collective stuck on a dead or
// stopped peer can be aborted: whenever the host waits (set-up, finish() waiting for the
// PREVIOUS step, settle(), the destructor) it polls NCCL's asynchronous error state and gives
// up after options.timeout_s (train.reducer_timeout_s) with an NcclError naming the collective.
//
// Timings (ReducerStats), on the device: a step's communication time runs from the moment its
// first bucket may start (a timing event on the communication stream after its first wait on
// the producer) to the end of its last bucket, and the part of it the step waited for from the
// end of the producer's backward (a timing event on the producer's stream where finish() makes
// it wait) to that same end. Each step's figures are read once its reduction is done (the next
// finish(), or settle()), so the totals run one step behind. A time that cannot be read is left
// out, never an error: the figures must not stop a training. The host's own time in
// ready_from() and finish() (NCCL's enqueue; finish() waiting for the previous step) is
// progress_s.
//
// train.reducer_precision = bf16: each bucket is rounded into a bf16 copy on the
// communication stream, NCCL sums the copy in bf16, and the sum is widened back into the
// bucket (nccl_bf16.hpp): half the bytes between the GPUs, 2 bytes of device memory a gradient.
//
// Determinism: NCCL's ring all-reduce adds in a fixed order for a fixed communicator, size
// and algorithm; unless the user set them, NCCL_ALGO=Ring and NCCL_PROTO=Simple are pinned
// before the communicator is made (README, "GPU training"), so the same run on the
// same GPUs gives the same bits.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <exception>
#include <optional>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/comm/reducer.hpp"
#include "nccl_bf16.hpp"
#include "nccl_comm.hpp"
#include "nccl_entry.hpp"

namespace locus::comm::detail {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

class NcclReducer final : public GradientReducer {
 public:
  NcclReducer(mpi::Comm comm, const GradientBuffer& grads, const ReducerOptions& options)
      : comm_(std::move(comm)),
        data_(grads.data),
        size_(grads.size),
        producer_(static_cast<cudaStream_t>(grads.stream)),
        options_(options) {
    try {
      LOCUS_NCCL_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
      LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&produced_, cudaEventDisableTiming));
      for (auto& e : done_) LOCUS_NCCL_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      for (auto& t : timing_) {
        LOCUS_NCCL_CUDA(cudaEventCreate(&t.started));
        LOCUS_NCCL_CUDA(cudaEventCreate(&t.produced));
        LOCUS_NCCL_CUDA(cudaEventCreate(&t.reduced));
      }
      if (options_.precision == ReducePrecision::bf16 && size_ > 0) {
        LOCUS_NCCL_CUDA(cudaMalloc(&wire_, size_ * sizeof(std::uint16_t)));
      }
      build_buckets();
      pin_deterministic_algorithm();
      nccl_.emplace(comm_, "data-parallel",
                    NcclTimeout{options_.timeout_s, "train.reducer_timeout_s"});
    } catch (...) {
      release();  // no destructor runs for a constructor that throws
      throw;
    }
  }

  ~NcclReducer() override {
    // Never throws: on a broken or stuck communicator abort it instead of finalizing, and
    // while unwinding (a peer's error, a timeout) at once: the peers may be gone, and a wait
    // here would hold the job's exit for the whole timeout.
    if (nccl_) {
      // A step begun and never finished (its caller gave up) may hold buckets no peer will
      // join: aborted, as while unwinding.
      bool healthy = std::uncaught_exceptions() == 0 && nccl_->get() != nullptr && !in_step_;
      if (healthy) {
        try {
          nccl_->await("the last gradient all-reduce",
                       [this] { return event_done(done_[0]) && event_done(done_[1]); });
        } catch (...) {
          healthy = false;
        }
      }
      nccl_->close(healthy);
    }
    release();
  }

  // Launches every bucket now wholly inside [offset, N), after the work the producer's stream
  // has queued so far.
  void ready_from(std::size_t offset) override {
    const auto t0 = Clock::now();
    enqueue_ready(offset);
    add_host_time(t0);
  }

  // Enqueues the rest, makes the producer wait for it, and waits (on the host) only for the
  // previous step's reduction: the host stays one step ahead and a stuck peer is noticed.
  void finish() override {
    const auto t0 = Clock::now();
    enqueue_ready(0);
    StepTiming& t = timing_[static_cast<std::size_t>(step_parity_)];
    cudaEvent_t done = done_[step_parity_];
    if (t.timed) {  // `reduced` before `done` on its stream: complete wherever `done` is
      LOCUS_NCCL_CUDA(cudaEventRecord(t.reduced, stream_));
      LOCUS_NCCL_CUDA(cudaEventRecord(t.produced, producer_));
    }
    LOCUS_NCCL_CUDA(cudaEventRecord(done, stream_));
    LOCUS_NCCL_CUDA(cudaStreamWaitEvent(producer_, done, 0));
    cudaEvent_t previous = done_[step_parity_ ^ 1];
    nccl_->await("the gradient all-reduce of the previous step",
                  [&] { return event_done(previous); });
    take_timing(step_parity_ ^ 1);
    step_parity_ ^= 1;
    in_step_ = false;
    ++stats_.steps;
    add_host_time(t0);
    stats_.last.progress_s = step_host_s_;
  }

  // Waits for the last finished step's reduction -- all a producer's stream waits for (finish()
  // orders it after that step's done event) -- not for all of `stream`, nor for the buckets of
  // a step under way: what else the stream waits for (a pipeline stage's received activations)
  // is its owner's to watch, and a peer stuck there must be blamed on it (reducer.hpp). Before
  // any finish(), the event was never recorded: done at once.
  void settle(void* stream) override {
    (void)stream;
    cudaEvent_t last = done_[step_parity_ ^ 1];
    nccl_->await("the gradient all-reduce a host wait depends on",
                  [&] { return event_done(last); });
    take_timing(step_parity_ ^ 1);
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
    return fmt::format("NCCL's own (topology-aware within and across nodes; train.reduction = "
                       "auto), summed in {} (train.reducer_precision)",
                       to_string(options_.precision));
  }

 private:
  // Launches every bucket now wholly inside [offset, N), after the work the producer's stream
  // has queued so far.
  void enqueue_ready(std::size_t offset) {
    if (!in_step_) begin_step();
    bool recorded = false;
    while (next_ < buckets_.size() && buckets_[next_].offset >= offset) {
      if (!recorded) {
        LOCUS_NCCL_CUDA(cudaEventRecord(produced_, producer_));
        LOCUS_NCCL_CUDA(cudaStreamWaitEvent(stream_, produced_, 0));
        StepTiming& t = timing_[static_cast<std::size_t>(step_parity_)];
        if (!t.timed) {  // the step's first bucket may start here
          LOCUS_NCCL_CUDA(cudaEventRecord(t.started, stream_));
          t.timed = true;
        }
        recorded = true;
      }
      const Bucket& b = buckets_[next_++];
      float* p = data_ + b.offset;
      const ncclRedOp_t op = options_.mode == ReduceMode::average ? ncclAvg : ncclSum;
      if (wire_ == nullptr) {
        nccl_->issued(ncclAllReduce(p, p, b.count, ncclFloat32, op, nccl_->get(), stream_),
                      "ncclAllReduce");
        continue;
      }
      std::uint16_t* w = wire_ + b.offset;
      round_to_bf16(p, w, b.count, stream_);
      nccl_->issued(ncclAllReduce(w, w, b.count, ncclBfloat16, op, nccl_->get(), stream_),
                    "ncclAllReduce (bf16)");
      widen_from_bf16(w, p, b.count, stream_);
    }
  }

  // One step's timing events (ReducerStats, on the device): `started` on the communication
  // stream where its first bucket may start, `reduced` there after its last bucket, `produced`
  // on the producer's stream where finish() makes it wait (its backward done).
  struct StepTiming {
    cudaEvent_t started = nullptr, reduced = nullptr, produced = nullptr;
    bool timed = false;  // started is recorded for the step in this slot, not yet read
  };

  // The figures of the step in timing_[parity], once its reduction is done (`started` and
  // `reduced` precede `done` on the communication stream: complete). `produced` may not be:
  // the producer had not reached it when the reduction ended, so the step waited for nothing
  // (a hidden reduction; reading the time would fail). A time that cannot be read otherwise is
  // left out, never an error: the figures must not stop a training.
  void take_timing(int parity) {
    StepTiming& t = timing_[static_cast<std::size_t>(parity)];
    if (!t.timed) return;
    t.timed = false;
    float comm_ms = 0, exposed_ms = 0;
    bool read = cudaEventElapsedTime(&comm_ms, t.started, t.reduced) == cudaSuccess;
    if (read) {
      const cudaError_t produced = cudaEventQuery(t.produced);
      if (produced == cudaSuccess) {
        read = cudaEventElapsedTime(&exposed_ms, t.produced, t.reduced) == cudaSuccess;
      } else {
        read = produced == cudaErrorNotReady;  // after `reduced`: nothing waited
      }
    }
    if (!read) {
      cudaGetLastError();  // a failed read's own error, not sticky: clear it
      return;
    }
    const double comm = std::max(0.0, static_cast<double>(comm_ms) * 1e-3);
    const double exposed = std::clamp(static_cast<double>(exposed_ms) * 1e-3, 0.0, comm);
    stats_.last.comm_s = comm;
    stats_.last.blocked_s = exposed;
    stats_.total.comm_s += comm;
    stats_.total.blocked_s += exposed;
  }

  // The stream and events (the communicator is closed first). Never throws.
  void release() noexcept {
    if (stream_ != nullptr) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
      stream_ = nullptr;
    }
    if (wire_ != nullptr) cudaFree(wire_);
    wire_ = nullptr;
    if (produced_ != nullptr) cudaEventDestroy(produced_);
    for (auto& e : done_) {
      if (e != nullptr) cudaEventDestroy(e);
      e = nullptr;
    }
    for (auto& t : timing_) {
      for (cudaEvent_t* e : {&t.started, &t.reduced, &t.produced}) {
        if (*e != nullptr) cudaEventDestroy(*e);
        *e = nullptr;
      }
    }
    produced_ = nullptr;
  }

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
    step_host_s_ = 0;
  }

  void add_host_time(Clock::time_point since) {
    const double s = std::chrono::duration<double>(Clock::now() - since).count();
    step_host_s_ += s;
    stats_.total.progress_s += s;
  }

  mpi::Comm comm_;
  float* data_;
  std::size_t size_;
  cudaStream_t producer_;
  ReducerOptions options_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t produced_ = nullptr;
  std::array<cudaEvent_t, 2> done_{};
  std::array<StepTiming, 2> timing_{};  // by step parity, as done_
  std::uint16_t* wire_ = nullptr;  // bf16 sums: the buffer's bf16 copy (else null)
  int step_parity_ = 0;
  std::optional<NcclComm> nccl_;  // closed in the destructor, before the stream goes
  std::vector<Bucket> buckets_;
  std::size_t next_ = 0;
  bool in_step_ = false;
  double step_host_s_ = 0;  // the host's time in this step's ready_from() and finish() calls
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
