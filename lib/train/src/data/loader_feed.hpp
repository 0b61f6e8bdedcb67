// The loader's batch assembly (private): decides where the rows live (memory or file), loads
// them, and fills one batch buffer for any (epoch, step). Runs on the producer thread (or the
// calling thread in the synchronous fallback); after the constructor it makes no collective
// call, so ranks may run at different paces.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "data/copy_pool.hpp"
#include "data/loader_plan.hpp"
#include "data/loader_source.hpp"
#include "data/loader_stream.hpp"
#include "locus/comm/error.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train::detail {

// An array from HostMemory (or the heap when it is null). resize() keeps the allocation when
// it is large enough and leaves the contents unspecified: a batch is overwritten whole.
template <class T>
class HostArray {
 public:
  explicit HostArray(HostMemory* memory) : memory_(memory) {}
  ~HostArray() { release(); }
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;

  // Room for n elements; a new allocation starts empty (size 0).
  void reserve(std::size_t n) {
    if (n <= capacity_) return;
    release();
    void* p = memory_ != nullptr ? memory_->allocate(n * sizeof(T)) : ::operator new(n * sizeof(T));
    LOCUS_ASSERT(p != nullptr && reinterpret_cast<std::uintptr_t>(p) % alignof(T) == 0,
                 "HostMemory::allocate returned a null or misaligned block");
    data_ = static_cast<T*>(p);
    capacity_ = n;
  }
  void resize(std::size_t n) {
    reserve(n);
    size_ = n;
  }
  T* data() { return data_; }
  std::size_t size() const { return size_; }
  T& operator[](std::size_t i) { return data_[i]; }
  std::span<const T> span() const { return {data_, size_}; }

 private:
  void release() noexcept {
    if (data_ == nullptr) return;
    if (memory_ != nullptr) {
      memory_->deallocate(data_, capacity_ * sizeof(T));
    } else {
      ::operator delete(data_);
    }
    data_ = nullptr;
    capacity_ = size_ = 0;
  }
  HostMemory* memory_;
  T* data_ = nullptr;
  std::size_t size_ = 0, capacity_ = 0;
};

// One slot of the ring: a batch and the storage its spans point into.
struct BatchBuffer {
  explicit BatchBuffer(HostMemory* memory) : x(memory), y(memory), ids(memory), rows(memory) {}
  LoadedBatch batch;
  HostArray<float> x;
  HostArray<std::int32_t> y;
  HostArray<std::uint64_t> ids;
  HostArray<std::int64_t> rows;  // resident_rows
  std::uint64_t generation = 0;  // the start_epoch() call it was produced for
};

class Feeder {
 public:
  // Collective over comm: opens the file, checks the options against it (agreed errors) and
  // reads what stays in memory.
  // With `staged`, rows are read from the node's staged copy (stage_copy.hpp).
  Feeder(const mpi::Comm& comm, const LoaderOptions& opts, const StagedCopy* staged = nullptr);

  const Geometry& geometry() const { return geo_; }
  std::uint64_t cols() const { return source_.cols(); }
  bool has_labels() const { return source_.has_labels(); }
  Residency residency() const { return residency_; }
  bool in_memory() const {
    return residency_ == Residency::partition || residency_ == Residency::dataset;
  }
  ResidentData resident() const;

  // Allocates out's arrays for the largest batch of this rank (on the calling thread).
  void reserve(BatchBuffer& out) const;
  // This rank's rows of (epoch, step); no other rank takes part. One thread at a time.
  void fill(std::int64_t epoch, std::int64_t step, BatchBuffer& out);
  // fill() for the in-memory residencies: touches no HDF5 and no state of fill(), so another
  // thread may call it while fill() runs (on another buffer): on that thread, `producer`
  // false.
  void gather(std::int64_t epoch, std::int64_t step, BatchBuffer& out, bool producer = true);
  // Whether the permutation of `epoch` is at hand (computed, or none needed). Any thread.
  bool has_order(std::int64_t epoch);

  // Computes the permutation of `epoch` ahead of its first batch, `budget` elements of work
  // a call (PermutationBuilder); true once it is done (at once for the streamed residency,
  // which plans its epochs itself, and for shuffle none). The producer thread only; gather()
  // may run meanwhile.
  bool prepare_order(std::int64_t epoch, std::uint64_t budget);

  // Collective over comm (see Source).
  void close() { source_.close(); }
  void abandon() noexcept { source_.abandon(); }

 private:
  using Order = std::shared_ptr<const std::vector<std::uint64_t>>;
  Residency choose_residency() const;
  void check_gather_features() const;
  void load();
  // The permutation of `epoch` (global: of the dataset; local: of the partition; none: null),
  // computed once for both threads that gather. `producer`: called on the thread of fill()
  // and prepare_order(), which finishes prepare_order()'s piece in progress if it is this one.
  Order order(std::int64_t epoch, bool producer);
  PermutationBuilder order_builder(std::int64_t epoch) const;
  Order keep_order(std::int64_t epoch, std::vector<std::uint64_t> perm);
  void shape(BatchBuffer& out, std::uint64_t n, bool features, bool resident_rows) const;
  void list_ids(const StepSlice& s, const std::vector<std::uint64_t>* perm,
                BatchBuffer& out) const;
  void finish(std::int64_t epoch, std::int64_t step, const StepSlice& s, BatchBuffer& out) const;
  void read_scattered(BatchBuffer& out);
  void copy_row(const float* x, const std::int32_t* y, std::uint64_t row, BatchBuffer& out,
                std::uint64_t i) const;

  const mpi::Comm& comm_;
  LoaderOptions opts_;
  Source source_;
  Geometry geo_;
  Residency residency_ = Residency::partition;

  // Rows held in memory: the partition or the whole dataset.
  std::vector<float> mem_x_;
  std::vector<std::int32_t> mem_y_;
  std::uint64_t mem_first_ = 0;  // file row of mem row 0 (partition residency)
  std::optional<Streamer> streamer_;  // streamed residency

  std::int64_t streamed_epoch_ = -1;  // the epoch the streamer was last begun for
  // The last two epochs' permutations: the producer may run an epoch ahead of next().
  std::mutex order_mutex_;
  std::int64_t order_epoch_[2] = {-1, -1};
  Order order_[2];
  int order_next_ = 0;
  // prepare_order()'s permutation in progress (the producer thread's), and its epoch.
  std::optional<std::pair<std::int64_t, PermutationBuilder>> pending_;

  // Helpers for large in-memory batches (opts_.gather_threads - 1 of them), made on first use.
  std::optional<CopyPool> copy_pool_;
  std::once_flag copy_pool_once_;

  std::vector<std::pair<std::uint64_t, std::uint64_t>> sorted_;  // (row id, batch index)
  std::vector<float> scratch_x_;
  std::vector<std::int32_t> scratch_y_;
};

}  // namespace locus::train::detail
