// The reducer factory (the only place that knows which backends this build has), option
// validation agreed across ranks, and the shared statistics helpers.
#include "locus/comm/reducer.hpp"

#include <algorithm>
#include <array>
#include <cstdint>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"
#include "locus/config.hpp"
#include "mpi_reducer.hpp"

namespace locus::comm {

std::span<float> GradientBuffer::host() const {
  LOCUS_ASSERT(space == MemorySpace::host,
               "a device gradient buffer was bound where host memory is needed");
  return {data, size};
}

namespace {

constexpr std::size_t min_chunk_bytes = 1024;
constexpr std::size_t max_chunk_bytes = std::size_t{1} << 30;   // counts must fit an int
constexpr int max_in_flight_limit = 64;

// Local checks; the caller agrees on the verdict across ranks.
void validate(const ReducerOptions& o) {
  if (o.bucket_bytes < sizeof(float))
    throw ConfigError(fmt::format("reducer bucket_bytes={} holds no float: set it to at least "
                                  "{} (a few MiB is typical)", o.bucket_bytes, sizeof(float)));
  if (o.chunk_bytes < min_chunk_bytes || o.chunk_bytes > max_chunk_bytes)
    throw ConfigError(fmt::format("reducer chunk_bytes={} is outside [{}, {}]: 1 MiB suits "
                                  "shared-memory MPI (see bench/comm/RESULTS.md)",
                                  o.chunk_bytes, min_chunk_bytes, max_chunk_bytes));
  if (o.small_bytes > max_chunk_bytes)
    throw ConfigError(fmt::format("reducer small_bytes={} is above {}: keep it at or below "
                                  "chunk_bytes", o.small_bytes, max_chunk_bytes));
  if (o.max_in_flight < 1 || o.max_in_flight > max_in_flight_limit)
    throw ConfigError(fmt::format("reducer max_in_flight={} is outside [1, {}]: 2 to 8 is "
                                  "typical", o.max_in_flight, max_in_flight_limit));
}

// Collective over comm. Mismatched buffers or options would deadlock or mis-reduce later, far
// from the cause: compare them now (max of v and of -v gives max and min in one call).
void check_same_everywhere(const mpi::Comm& comm, std::size_t grads, const ReducerOptions& o) {
  constexpr std::size_t n = 7;
  const std::array<std::int64_t, n> v = {
      static_cast<std::int64_t>(grads), static_cast<std::int64_t>(o.bucket_bytes),
      static_cast<std::int64_t>(o.chunk_bytes), static_cast<std::int64_t>(o.small_bytes),
      o.max_in_flight, static_cast<std::int64_t>(o.mode), static_cast<std::int64_t>(o.backend)};
  std::array<std::int64_t, 2 * n> mm{};
  for (std::size_t i = 0; i < n; ++i) {
    mm[i] = v[i];
    mm[n + i] = -v[i];
  }
  comm.allreduce_inplace(std::span<std::int64_t>(mm), MPI_MAX);
  static constexpr std::array<const char*, n> names = {
      "gradient buffer length", "bucket_bytes", "chunk_bytes", "small_bytes",
      "max_in_flight", "mode", "backend"};
  for (std::size_t i = 0; i < n; ++i) {
    if (mm[i] == -mm[n + i]) continue;
    ConfigError e(fmt::format("the gradient reducer's {} differs across the {} ranks (from {} "
                              "to {}): every rank must build the same model and pass the same "
                              "reducer options", names[i], comm.size(), -mm[n + i], mm[i]));
    e.mark_agreed();   // every rank saw the same min and max
    throw e;
  }
}

}  // namespace

double ReduceTimes::hidden_fraction() const noexcept {
  if (comm_s <= 0) return 0.0;
  return std::clamp(1.0 - blocked_s / comm_s, 0.0, 1.0);
}

std::unique_ptr<GradientReducer> make_gradient_reducer(const mpi::Comm& comm,
                                                       std::span<float> grads,
                                                       const ReducerOptions& options) {
  mpi::agree_on(comm, [&] {
    validate(options);
    if (options.backend == ReducerBackend::nccl) {
#if LOCUS_WITH_NCCL
      throw ConfigError("the NCCL gradient reducer is not implemented yet: use the mpi "
                        "reducer backend");
#else
      throw ConfigError("this build has no NCCL (LOCUS_WITH_NCCL=0): use the mpi reducer "
                        "backend, or rebuild with CUDA and NCCL installed");
#endif
    }
  });
  check_same_everywhere(comm, grads.size(), options);
  return std::make_unique<detail::MpiReducer>(comm.dup(), grads, options);
}

}  // namespace locus::comm
