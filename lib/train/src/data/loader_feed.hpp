// The loader's batch assembly (private): decides where the rows live (memory or file), loads
// them, and fills one batch buffer for any (epoch, step). Runs on the producer thread (or the
// calling thread in the synchronous fallback); after the constructor it makes no collective
// call, so ranks may run at different paces.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "data/loader_plan.hpp"
#include "data/loader_source.hpp"
#include "data/loader_stream.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train::detail {

// One slot of the ring: a batch and the storage its spans point into.
struct BatchBuffer {
  LoadedBatch batch;
  std::vector<float> x;
  std::vector<std::int32_t> y;
  std::vector<std::uint64_t> ids;
  std::uint64_t generation = 0;  // the start_epoch() call it was produced for
};

class Feeder {
 public:
  // Collective over comm: opens the file, checks the options against it (agreed errors) and
  // reads what stays in memory.
  Feeder(const mpi::Comm& comm, const LoaderOptions& opts);

  const Geometry& geometry() const { return geo_; }
  std::uint64_t cols() const { return source_.cols(); }
  bool has_labels() const { return source_.has_labels(); }
  Residency residency() const { return residency_; }

  // This rank's rows of (epoch, step); no other rank takes part.
  void fill(std::int64_t epoch, std::int64_t step, BatchBuffer& out);

  // Collective over comm (see Source).
  void close() { source_.close(); }
  void abandon() noexcept { source_.abandon(); }

 private:
  Residency choose_residency() const;
  void load();
  void prepare(std::int64_t epoch);
  void gather_memory(const StepSlice& s, BatchBuffer& out);
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

  std::int64_t prepared_epoch_ = -1;
  std::vector<std::uint64_t> perm_;  // global: of the dataset; local: of the partition

  std::vector<std::pair<std::uint64_t, std::uint64_t>> sorted_;  // (row id, batch index)
  std::vector<float> scratch_x_;
  std::vector<std::int32_t> scratch_y_;
};

}  // namespace locus::train::detail
