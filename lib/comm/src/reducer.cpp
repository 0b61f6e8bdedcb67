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
#if LOCUS_WITH_NCCL
#include "nccl_entry.hpp"
#endif

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
  if (!(o.timeout_s >= 0))
    throw ConfigError(fmt::format("train.reducer_timeout_s = {} is invalid: use 0 (wait forever) "
                                  "or a positive number of seconds", o.timeout_s));
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
  constexpr std::size_t n = 9;
  const std::array<std::int64_t, n> v = {
      static_cast<std::int64_t>(grads), static_cast<std::int64_t>(o.bucket_bytes),
      static_cast<std::int64_t>(o.chunk_bytes), static_cast<std::int64_t>(o.small_bytes),
      o.max_in_flight, static_cast<std::int64_t>(o.mode), static_cast<std::int64_t>(o.backend),
      static_cast<std::int64_t>(o.reduction), static_cast<std::int64_t>(o.precision)};
  std::array<std::int64_t, 2 * n> mm{};
  for (std::size_t i = 0; i < n; ++i) {
    mm[i] = v[i];
    mm[n + i] = -v[i];
  }
  comm.allreduce_inplace(std::span<std::int64_t>(mm), MPI_MAX);
  static constexpr std::array<const char*, n> names = {
      "gradient buffer length", "bucket_bytes", "chunk_bytes", "small_bytes",
      "max_in_flight", "mode", "backend", "reduction", "precision"};
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

ReducerBackend parse_reducer_backend(std::string_view name) {
  if (name == "auto") return ReducerBackend::automatic;
  if (name == "mpi") return ReducerBackend::mpi;
  if (name == "nccl") return ReducerBackend::nccl;
  throw ConfigError(fmt::format("train.reducer = {} is not a reducer: use auto, mpi or nccl",
                                name));
}

std::string_view to_string(ReducerBackend b) noexcept {
  switch (b) {
    case ReducerBackend::mpi: return "mpi";
    case ReducerBackend::nccl: return "nccl";
    case ReducerBackend::automatic: return "auto";
  }
  return "?";
}

ReducePrecision parse_reduce_precision(std::string_view name) {
  if (name == "fp32") return ReducePrecision::fp32;
  if (name == "bf16") return ReducePrecision::bf16;
  throw ConfigError(fmt::format("train.reducer_precision = {} is not a precision the reducer "
                                "sums in: use fp32 or bf16",
                                name));
}

std::string_view to_string(ReducePrecision p) noexcept {
  switch (p) {
    case ReducePrecision::fp32: return "fp32";
    case ReducePrecision::bf16: return "bf16";
  }
  return "?";
}

std::string bf16_sum_refusal(std::string_view reducer) {
  return fmt::format("train.reducer_precision = bf16 sums in bf16 on the NCCL reducer only, and "
                     "this job's gradients go through {}: set train.reducer_precision = fp32",
                     reducer);
}

Reduction parse_reduction(std::string_view name) {
  if (name == "auto") return Reduction::automatic;
  if (name == "flat") return Reduction::flat;
  if (name == "hierarchical") return Reduction::hierarchical;
  throw ConfigError(fmt::format("train.reduction = {} is not a reduction: use auto, flat or "
                                "hierarchical", name));
}

std::string_view to_string(Reduction r) noexcept {
  switch (r) {
    case Reduction::automatic: return "auto";
    case Reduction::flat: return "flat";
    case Reduction::hierarchical: return "hierarchical";
  }
  return "?";
}

std::unique_ptr<GradientReducer> make_gradient_reducer(const mpi::Comm& comm,
                                                       std::span<float> grads,
                                                       const ReducerOptions& options) {
  mpi::agree_on(comm, [&] {
    validate(options);
    if (options.backend == ReducerBackend::nccl) {
      throw ConfigError(fmt::format(
          "train.reducer = nccl reduces GPU gradients, but these are in host memory: set "
          "train.reducer = auto or mpi, or train.backend = cuda ({})",
          LOCUS_WITH_NCCL ? "this build has NCCL" : "this build has no NCCL"));
    }
    if (options.precision != ReducePrecision::fp32) {
      throw ConfigError(bf16_sum_refusal("the MPI reducer (they are in host memory)"));
    }
  });
  check_same_everywhere(comm, grads.size(), options);
  return std::make_unique<detail::MpiReducer>(comm.dup(), grads, options);
}

std::string nccl_unusable_reason(const mpi::Comm& comm, const GradientBuffer& grads) {
  if (!LOCUS_WITH_NCCL) return "this build has no NCCL (LOCUS_WITH_NCCL=0)";
  // Every rank sees the same space (one backend for the job); the device check is collective.
  if (grads.space != MemorySpace::cuda) return "the gradients are in host memory";
#if LOCUS_WITH_NCCL
  return detail::duplicate_device_reason(comm, "data-parallel");
#else
  (void)comm;
  return "";
#endif
}

std::unique_ptr<GradientReducer> make_nccl_reducer(const mpi::Comm& comm,
                                                   const GradientBuffer& grads,
                                                   const ReducerOptions& options) {
  mpi::agree_on(comm, [&] {
    validate(options);
    if (options.reduction != Reduction::automatic) {
      throw ConfigError(fmt::format(
          "train.reduction = {} applies to the MPI reducer; NCCL chooses its own topology-aware "
          "algorithms (rings and trees within and across nodes): set train.reduction = auto "
          "with NCCL, or train.reducer = mpi to choose the reduction",
          to_string(options.reduction)));
    }
  });
  const std::string why = nccl_unusable_reason(comm, grads);
  mpi::agree_on(comm, [&] {
    if (!why.empty()) {
      throw ConfigError(fmt::format("train.reducer = nccl cannot be used: {}. Set "
                                    "train.reducer = auto (the host-staged MPI reducer where "
                                    "NCCL cannot run) or mpi, or give every rank a GPU of its "
                                    "own",
                                    why));
    }
  });
  check_same_everywhere(comm, grads.size, options);
#if LOCUS_WITH_NCCL
  LOCUS_ASSERT(grads.stream != nullptr, "a device gradient buffer needs its producer stream");
  return detail::make_nccl(comm.dup(), grads, options);
#else
  LOCUS_ASSERT(false, "unreachable: no NCCL in this build");
  return nullptr;
#endif
}

std::string nccl_version() {
#if LOCUS_WITH_NCCL
  return detail::nccl_version();
#else
  return "no NCCL in this build";
#endif
}

}  // namespace locus::comm
