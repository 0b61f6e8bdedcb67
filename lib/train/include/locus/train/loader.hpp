// The data loader: each data-parallel rank reads its own partition of a locus dataset (or any
// HDF5 float32 [N, D] dataset) and a background producer keeps a ring buffer of ready batches
// while the trainer computes. All HDF5 calls happen on the producer thread.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "locus/comm/mpi.hpp"

namespace locus::train {

enum class Shuffle {
  local,   // a per-epoch permutation inside the rank's partition; no data crosses ranks
  global,  // one permutation of the whole dataset per epoch; rank r takes its slice of every
           // global batch, so N ranks see exactly the batches of a 1-rank run
  none,    // file order (evaluation)
};
Shuffle parse_shuffle(const std::string& s);  // ConfigError naming the allowed values

struct LoaderOptions {
  std::string path;
  std::string features = "/features";
  std::string labels = "/labels";     // "" or absent dataset: no labels
  std::int64_t global_batch = 128;     // samples per step over all data-parallel ranks
  Shuffle shuffle = Shuffle::local;
  std::uint64_t seed = 0;
  int prefetch_depth = 4;              // batches in the ring buffer
  std::uint64_t memory_budget = 1ULL << 30;  // bytes of samples a rank may hold
  bool drop_last = false;              // drop the last partial global batch of an epoch
};

// One batch of this rank's rows (rows may be 0 on some ranks for the last partial batch).
struct LoadedBatch {
  std::int64_t epoch = 0, step = 0;    // step within the epoch
  int rows = 0;
  std::span<const float> x;            // rows × cols
  std::span<const std::int32_t> y;     // rows (empty without labels)
  std::span<const std::uint64_t> sample_ids;  // global row indices of the rows
  int global_rows = 0;                 // rows of the global batch (the gradient divisor)
};

class Loader {
 public:
  // Collective over comm (the data-parallel communicator).
  Loader(const mpi::Comm& comm, LoaderOptions opts);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  std::int64_t rows() const;           // global committed rows
  std::int64_t cols() const;
  bool has_labels() const;
  std::int64_t steps_per_epoch() const;

  // Starts producing the batches of `epoch` from step `first_step` (resume). A pure function
  // of (seed, epoch, step): no other state is needed to resume.
  void start_epoch(std::int64_t epoch, std::int64_t first_step = 0);
  // The next batch of the epoch, or nullptr after the last. Valid until the next call.
  // Blocks (and counts data-wait time) while the producer is behind.
  const LoadedBatch* next();

  double wait_seconds() const;         // total time next() waited since construction
  double last_wait_seconds() const;    // wait of the latest next()

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace locus::train
