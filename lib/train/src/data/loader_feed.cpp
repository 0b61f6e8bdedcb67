// Batch assembly: the residency decision, the initial load (collective), and filling a batch
// from memory, from scattered file rows, or from the streamed window groups.
#include "data/loader_feed.hpp"

#include <algorithm>
#include <climits>
#include <cstring>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"

namespace locus::train::detail {

Feeder::Feeder(const mpi::Comm& comm, const LoaderOptions& opts, const StagedCopy* staged)
    : comm_(comm), opts_(opts), source_(comm, opts, staged),
      geo_(source_.rows(), static_cast<std::uint64_t>(std::max<std::int64_t>(opts.global_batch, 1)),
           opts.drop_last, opts.shuffle, comm.rank(), comm.size()) {
  try {
    mpi::agree_on(comm_, [&] {
      if (static_cast<std::uint64_t>(opts_.global_batch) > source_.rows()) {
        throw ConfigError(fmt::format(
            "global_batch = {} is larger than the {} rows of '{}'; lower the batch size",
            opts_.global_batch, source_.rows(), source_.path()));
      }
      residency_ = choose_residency();
      check_gather_features();
      load();
    });
  } catch (const Error& e) {
    // Agreed: every rank is here, so the collective close is safe.
    if (!e.agreed()) {
      source_.abandon();
      throw;
    }
    try {
      source_.close();
    } catch (const Error&) {
      source_.abandon();  // report the first error, not the close's
    }
    throw;
  }
}

Residency Feeder::choose_residency() const {
  const std::uint64_t row_bytes = cols() * sizeof(float) + (has_labels() ? 4 : 0);
  const std::uint64_t budget_rows = opts_.memory_budget / row_bytes;
  if (opts_.shuffle == Shuffle::global) {
    // The all-gather counts rows in int.
    const bool fits = geo_.rows() <= budget_rows && geo_.rows() <= INT_MAX;
    return fits ? Residency::dataset : Residency::per_batch;
  }
  // Decided from the largest partition, so every rank decides alike (the load is collective).
  return geo_.max_partition_rows() <= budget_rows ? Residency::partition : Residency::streamed;
}

void Feeder::check_gather_features() const {
  if (opts_.gather_features || in_memory()) return;
  const std::uint64_t row_bytes = cols() * sizeof(float) + (has_labels() ? 4 : 0);
  const std::uint64_t need =
      (opts_.shuffle == Shuffle::global ? geo_.rows() : geo_.max_partition_rows()) * row_bytes;
  throw ConfigError(fmt::format(
      "the device cache (loader.device_cache_mb) and loader.gather = device gather batches "
      "from the samples held in memory, but '{}' ({} rows, shuffle {}) does not fit "
      "loader.memory_budget_mb ({} bytes; it needs {} per rank), so the loader would read it "
      "in {} mode: raise loader.memory_budget_mb above {} MiB, or set "
      "loader.device_cache_mb = 0 and loader.gather = host",
      source_.path(), geo_.rows(), to_string(opts_.shuffle), opts_.memory_budget, need,
      to_string(residency_), (need + (1u << 20) - 1) >> 20));
}

void Feeder::load() {
  const h5::RowRange part = geo_.partition();
  const std::uint64_t c = cols();
  switch (residency_) {
    case Residency::partition:
      mem_first_ = part.begin;
      mem_x_.resize(part.count * c);
      mem_y_.resize(has_labels() ? part.count : 0);
      source_.read_range(part, mem_x_.data(), mem_y_.data());
      break;
    case Residency::dataset: {
      mem_x_.resize(geo_.rows() * c);
      mem_y_.resize(has_labels() ? geo_.rows() : 0);
      source_.read_range(part, mem_x_.data() + part.begin * c,
                         has_labels() ? mem_y_.data() + part.begin : nullptr);
      // Every rank read its partition; the all-gather completes everybody's copy.
      std::vector<int> counts, displs;
      for (int r = 0; r < comm_.size(); ++r) {
        const h5::RowRange p = h5::partition_rows(geo_.rows(), r, comm_.size());
        counts.push_back(static_cast<int>(p.count));
        displs.push_back(static_cast<int>(p.begin));
      }
      MPI_Datatype row = MPI_DATATYPE_NULL;
      LOCUS_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(c), MPI_FLOAT, &row));
      LOCUS_MPI_CHECK(MPI_Type_commit(&row));
      const int rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, mem_x_.data(),
                                    counts.data(), displs.data(), row, comm_.get());
      MPI_Type_free(&row);
      LOCUS_MPI_CHECK(rc);
      if (has_labels()) {
        LOCUS_MPI_CHECK(MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, mem_y_.data(),
                                       counts.data(), displs.data(), MPI_INT32_T, comm_.get()));
      }
      break;
    }
    case Residency::streamed: {
      // Two groups live at once: the one being served and the next one being read.
      const std::uint64_t row_bytes = c * sizeof(float) + (has_labels() ? 4 : 0);
      const std::uint64_t group_rows =
          std::max<std::uint64_t>(1, opts_.memory_budget / row_bytes / 2);
      streamer_.emplace(source_, part, group_rows, opts_.shuffle == Shuffle::local);
      break;
    }
    case Residency::per_batch: break;
  }
}

Feeder::Order Feeder::order(std::int64_t epoch, bool producer) {
  if (opts_.shuffle == Shuffle::none) return nullptr;
  {
    std::lock_guard<std::mutex> lk(order_mutex_);
    for (int i = 0; i < 2; ++i) {
      if (order_epoch_[i] == epoch) return order_[i];
    }
  }
  // Computed outside the lock: the other thread may be gathering with the other slot.
  const bool resume = producer && pending_ && pending_->first == epoch;
  PermutationBuilder b = resume ? std::move(pending_->second) : order_builder(epoch);
  if (resume) pending_.reset();
  b.advance(UINT64_MAX);
  return keep_order(epoch, b.take());
}

bool Feeder::has_order(std::int64_t epoch) {
  if (opts_.shuffle == Shuffle::none) return true;
  std::lock_guard<std::mutex> lk(order_mutex_);
  return order_epoch_[0] == epoch || order_epoch_[1] == epoch;
}

PermutationBuilder Feeder::order_builder(std::int64_t epoch) const {
  const auto e = static_cast<std::uint64_t>(epoch);
  const h5::RowRange part = geo_.partition();
  return opts_.shuffle == Shuffle::global
             ? PermutationBuilder(geo_.rows(),
                                  keyed_engine(opts_.seed, e, kGlobalDomain, geo_.rows()))
             : PermutationBuilder(part.count, keyed_engine(opts_.seed, e, kLocalDomain,
                                                           part.begin, part.count));
}

// Caches `perm` as the order of `epoch` (in the older slot), unless another thread was first.
Feeder::Order Feeder::keep_order(std::int64_t epoch, std::vector<std::uint64_t> perm) {
  auto made = std::make_shared<const std::vector<std::uint64_t>>(std::move(perm));
  std::lock_guard<std::mutex> lk(order_mutex_);
  for (int i = 0; i < 2; ++i) {
    if (order_epoch_[i] == epoch) return order_[i];  // the other thread was first
  }
  order_epoch_[order_next_] = epoch;
  order_[order_next_] = made;
  order_next_ ^= 1;
  return made;
}

bool Feeder::prepare_order(std::int64_t epoch, std::uint64_t budget) {
  if (residency_ == Residency::streamed) return true;
  if (has_order(epoch)) {
    // None needed, or an order() came first: drop a half-built copy (n words) now.
    pending_.reset();
    return true;
  }
  if (!pending_ || pending_->first != epoch) pending_.emplace(epoch, order_builder(epoch));
  if (!pending_->second.advance(budget)) return false;
  std::vector<std::uint64_t> perm = pending_->second.take();
  pending_.reset();  // before keep_order() allocates: a builder once taken is never reused
  keep_order(epoch, std::move(perm));
  return true;
}

ResidentData Feeder::resident() const {
  if (!in_memory()) return {};
  const auto c = static_cast<std::int64_t>(cols());
  return {.rows = static_cast<std::int64_t>(mem_x_.size()) / std::max<std::int64_t>(c, 1),
          .cols = c, .x = mem_x_, .y = mem_y_};
}

void Feeder::reserve(BatchBuffer& out) const {
  const std::uint64_t n = geo_.max_step_rows();
  if (!in_memory() || opts_.gather_features) out.x.reserve(n * cols());
  if (has_labels()) out.y.reserve(n);
  out.ids.reserve(n);
  if (in_memory()) out.rows.reserve(n);
}

void Feeder::shape(BatchBuffer& out, std::uint64_t n, bool features, bool resident_rows) const {
  out.x.resize(features ? n * cols() : 0);
  out.y.resize(has_labels() ? n : 0);
  out.ids.resize(n);
  out.rows.resize(resident_rows ? n : 0);
}

// The sample ids of this rank's positions of the step (not for the streamed residency).
void Feeder::list_ids(const StepSlice& s, const std::vector<std::uint64_t>* perm,
                      BatchBuffer& out) const {
  const std::uint64_t base = geo_.partition().begin;
  for (std::uint64_t i = 0; i < s.count; ++i) {
    const std::uint64_t p = s.first + i;
    switch (opts_.shuffle) {
      case Shuffle::global: out.ids[i] = (*perm)[p]; break;
      case Shuffle::local: out.ids[i] = base + (*perm)[p]; break;
      case Shuffle::none: out.ids[i] = base + p; break;
    }
  }
}

void Feeder::finish(std::int64_t epoch, std::int64_t step, const StepSlice& s,
                    BatchBuffer& out) const {
  out.batch.epoch = epoch;
  out.batch.step = step;
  out.batch.rows = static_cast<int>(s.count);
  out.batch.global_rows = static_cast<int>(s.global_rows);
  out.batch.x = out.x.span();
  out.batch.y = out.y.span();
  out.batch.sample_ids = out.ids.span();
  out.batch.resident_rows = out.rows.span();
}

void Feeder::fill(std::int64_t epoch, std::int64_t step, BatchBuffer& out) {
  if (in_memory()) {
    gather(epoch, step, out);
    return;
  }
  const StepSlice s = geo_.slice(static_cast<std::uint64_t>(step));
  shape(out, s.count, true, false);
  if (residency_ == Residency::streamed) {
    if (epoch != streamed_epoch_) {
      streamer_->begin_epoch(opts_.seed, static_cast<std::uint64_t>(epoch));
      streamed_epoch_ = epoch;
    }
    streamer_->fill(s.first, s.count, out);
  } else {
    const Order perm = order(epoch, true);
    list_ids(s, perm.get(), out);
    read_scattered(out);
  }
  finish(epoch, step, s, out);
}

void Feeder::gather(std::int64_t epoch, std::int64_t step, BatchBuffer& out, bool producer) {
  LOCUS_ASSERT(in_memory(), "Feeder::gather() out of core");
  const StepSlice s = geo_.slice(static_cast<std::uint64_t>(step));
  const Order perm = order(epoch, producer);
  const bool features = opts_.gather_features;
  shape(out, s.count, features, true);
  list_ids(s, perm.get(), out);
  const std::uint64_t c = cols();
  // The rows are random: the first KiB of the row kAhead places on is asked for ahead, so its
  // memory latency overlaps this row's copy (the hardware prefetcher follows a row once it is
  // being read). On the 2-core VM: 1.3-1.5x the gather rate (bench/RESULTS.md).
  constexpr std::uint64_t kAhead = 4, kAheadBytes = 1024;
  const std::uint64_t ahead_bytes = std::min<std::uint64_t>(c * sizeof(float), kAheadBytes);
  auto copy = [&](std::uint64_t begin, std::uint64_t end) {
    for (std::uint64_t i = begin; i < end; ++i) {
      if (features && i + kAhead < end) {
        const char* next =
            reinterpret_cast<const char*>(mem_x_.data() + (out.ids[i + kAhead] - mem_first_) * c);
        for (std::uint64_t b = 0; b < ahead_bytes; b += 64) __builtin_prefetch(next + b);
      }
      const std::uint64_t row = out.ids[i] - mem_first_;
      out.rows[i] = static_cast<std::int64_t>(row);
      if (features) std::memcpy(out.x.data() + i * c, mem_x_.data() + row * c, c * sizeof(float));
      if (has_labels()) out.y[i] = mem_y_[row];
    }
  };
  constexpr std::uint64_t kParallelBytes = std::uint64_t{1} << 20;
  if (features && opts_.gather_threads > 1 && s.count * c * sizeof(float) >= kParallelBytes) {
    std::call_once(copy_pool_once_, [&] { copy_pool_.emplace(opts_.gather_threads - 1); });
    copy_pool_->run(s.count, copy);
  } else {
    copy(0, s.count);
  }
  finish(epoch, step, s, out);
}

void Feeder::copy_row(const float* x, const std::int32_t* y, std::uint64_t row,
                      BatchBuffer& out, std::uint64_t i) const {
  const std::uint64_t c = cols();
  std::memcpy(out.x.data() + i * c, x + row * c, c * sizeof(float));
  if (has_labels()) out.y[i] = y[row];
}

void Feeder::read_scattered(BatchBuffer& out) {
  const std::uint64_t n = out.ids.size();
  sorted_.resize(n);
  for (std::uint64_t i = 0; i < n; ++i) sorted_[i] = {out.ids[i], i};
  std::sort(sorted_.begin(), sorted_.end());
  std::vector<std::uint64_t> ids(n);
  for (std::uint64_t k = 0; k < n; ++k) ids[k] = sorted_[k].first;
  const std::vector<h5::RowRange> runs = coalesce(ids);
  scratch_x_.resize(n * cols());
  scratch_y_.resize(has_labels() ? n : 0);
  if (n > 0) source_.read_runs(runs, scratch_x_.data(), scratch_y_.data());
  // The read returns rows in file order; put each where the permutation wants it.
  for (std::uint64_t k = 0; k < n; ++k) {
    copy_row(scratch_x_.data(), scratch_y_.data(), k, out, sorted_[k].second);
  }
}

}  // namespace locus::train::detail
