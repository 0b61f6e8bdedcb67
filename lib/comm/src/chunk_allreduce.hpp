// Private to lib/comm: the non-blocking chunked all-reduce engine behind the MPI reducer. A
// bounded number of chunks travel at once, each as a small state machine over
// MPI_Isend/Irecv that advances only when progress() is called (no hidden threads).
#pragma once

#include <mpi.h>

#include <cstddef>
#include <vector>

namespace locus::comm::detail {

struct ChunkEngineConfig {
  std::size_t chunk_elems = 0;   // largest chunk ever launched
  std::size_t small_elems = 0;   // chunks at most this long use the one-round exchange, and
                                 // messages at most this long travel as eager fragments
  // Under Open MPI's shared-memory eager limit (btl_vader_eager_limit, 4 KiB with header).
  std::size_t fragment_elems = 1000;
  int max_in_flight = 1;
  bool divide = true;            // divide the sum by the communicator size
};

// Sums in rank order into out: out[i] = ((src[0][i] + src[1][i]) + ...) [/ divisor]. out may
// alias any one source. This fixed order is what makes every rank (and every chunking) agree.
void reduce_in_rank_order(float* out, const float* const* src, int nsrc, std::size_t len,
                          float divisor);

// What the MPI reducer drives: a bounded number of chunks in flight, each reduced in place
// (sum over the ranks, optionally divided by their count), advanced only inside progress().
// The flat engine below and the hierarchical one (hier_allreduce.hpp) implement it.
class AllreduceEngine {
 public:
  AllreduceEngine() = default;
  AllreduceEngine(const AllreduceEngine&) = delete;
  AllreduceEngine& operator=(const AllreduceEngine&) = delete;
  virtual ~AllreduceEngine() = default;

  virtual bool has_free_slot() const noexcept = 0;
  virtual int active() const noexcept = 0;
  // Starts reducing data[0, count) (count <= chunk_elems). seq numbers the chunk within its
  // step: every rank must launch the same chunks in the same order.
  virtual void launch(float* data, std::size_t count, std::size_t seq) = 0;
  // Tests every chunk in flight once and advances those whose round completed. Returns how
  // many chunks completed.
  virtual int progress() = 0;
};

// The flat engine: every rank exchanges with every other rank of one communicator.
class ChunkEngine final : public AllreduceEngine {
 public:
  ChunkEngine(MPI_Comm comm, const ChunkEngineConfig& config);
  // Frees requests still in flight (only after an error: their peers are about to abort).
  ~ChunkEngine() override;

  bool has_free_slot() const noexcept override {
    return active_ < static_cast<int>(slots_.size());
  }
  int active() const noexcept override { return active_; }
  void launch(float* data, std::size_t count, std::size_t seq) override;
  int progress() override;

 private:
  enum class Phase { idle, exchange, scatter, gather };
  struct Slot {
    Phase phase = Phase::idle;
    float* data = nullptr;
    std::size_t count = 0;
    int tag = 0;
    float* scratch = nullptr;            // (size-1) contributions received from the peers
    std::vector<MPI_Request> requests;   // preallocated for the most fragments
    int posted = 0;                      // requests[0, posted): receives, then sends
    int receives = 0;                    // requests[0, receives) are receives
  };

  void segment(std::size_t count, int owner, std::size_t& off, std::size_t& len) const;
  void post(Slot& s, bool receive, float* buf, std::size_t len, int peer, int tag);
  float* contribution(Slot& s, int peer) const;
  void post_exchange(Slot& s);
  void post_scatter(Slot& s);
  void post_gather(Slot& s);
  void reduce_received(Slot& s, float* own, std::size_t len);
  bool advance(Slot& s);   // true when the chunk is complete

  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
  ChunkEngineConfig config_;
  std::size_t scratch_stride_ = 0;       // elements per peer contribution in a slot
  std::vector<float> scratch_;
  std::vector<Slot> slots_;
  std::vector<const float*> sources_;    // reused by reduce_received (no per-call allocation)
  int active_ = 0;
};

}  // namespace locus::comm::detail
