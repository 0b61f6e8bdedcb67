// Helpers of the loader tests: small HDF5 datasets whose values encode the row, and epoch
// recording / cross-rank gathering.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "locus/io/attribute.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::test {

inline float feature_at(std::uint64_t row, std::uint64_t col) {
  return static_cast<float>(row) * 16.0f + static_cast<float>(col);  // exact below 2^20 rows
}
inline std::int32_t label_at(std::uint64_t row) {
  return static_cast<std::int32_t>((row * 7 + 3) % 11);
}

struct FileSpec {
  std::uint64_t rows = 53;                  // features extent
  std::uint64_t cols = 5;
  std::optional<std::int64_t> committed;    // committed_rows attribute
  std::optional<std::uint64_t> label_rows;  // labels extent (none: no labels)
  std::string features = "/features";
  std::string labels = "/labels";
  bool features_1d = false;
  std::uint64_t chunk_rows = 8;
};

// Collective over comm: writes the file of `spec` (every rank its share of the rows).
inline void write_file(const mpi::Comm& comm, const std::string& path, const FileSpec& spec) {
  h5::File f = h5::File::create(comm, path);
  if (spec.features.rfind("/data/", 0) == 0) h5::create_group(f.id(), "/data");
  {
    const std::uint64_t cols = spec.features_1d ? 0 : spec.cols;
    h5::Dataset d = h5::Dataset::create(
        f, {.name = spec.features, .dtype = h5::Dtype::f32, .rows = spec.rows, .cols = cols,
            .chunk_rows = spec.chunk_rows});
    const h5::RowRange r = h5::partition_rows(spec.rows, comm.rank(), comm.size());
    const std::uint64_t w = d.row_width();
    std::vector<float> x(r.count * w);
    for (std::uint64_t i = 0; i < r.count; ++i)
      for (std::uint64_t c = 0; c < w; ++c) x[i * w + c] = feature_at(r.begin + i, c);
    d.write_rows<float>(r.begin, x);
  }
  if (spec.label_rows) {
    h5::Dataset d = h5::Dataset::create(
        f, {.name = spec.labels, .dtype = h5::Dtype::i32, .rows = *spec.label_rows,
            .chunk_rows = spec.chunk_rows});
    const h5::RowRange r = h5::partition_rows(*spec.label_rows, comm.rank(), comm.size());
    std::vector<std::int32_t> y(r.count);
    for (std::uint64_t i = 0; i < r.count; ++i) y[i] = label_at(r.begin + i);
    d.write_rows<std::int32_t>(r.begin, y);
  }
  if (spec.committed) h5::write_attr(f.id(), "committed_rows", *spec.committed);
  f.close();
}

// What one rank saw in one epoch, batch by batch.
struct Epoch {
  std::vector<std::vector<std::uint64_t>> ids;
  std::vector<int> global_rows;
  std::vector<std::vector<float>> x;
};

// Runs (the rest of) an epoch, checking each batch's step, shape and contents against the file.
inline Epoch record(train::Loader& l, std::int64_t epoch, std::int64_t first_step = 0) {
  Epoch e;
  l.start_epoch(epoch, first_step);
  std::int64_t step = first_step;
  const auto cols = static_cast<std::uint64_t>(l.cols());
  while (const train::LoadedBatch* b = l.next()) {
    EXPECT_EQ(b->epoch, epoch);
    EXPECT_EQ(b->step, step++);
    const auto n = static_cast<std::uint64_t>(b->rows);
    EXPECT_EQ(b->sample_ids.size(), n);
    EXPECT_EQ(b->x.size(), n * cols);
    EXPECT_EQ(b->y.size(), l.has_labels() ? n : 0u);
    for (std::uint64_t i = 0; i < n; ++i) {
      const std::uint64_t id = b->sample_ids[i];
      EXPECT_LT(id, static_cast<std::uint64_t>(l.rows()));
      for (std::uint64_t c = 0; c < cols; ++c) {
        EXPECT_EQ(b->x[i * cols + c], feature_at(id, c));
      }
      if (l.has_labels()) {
        EXPECT_EQ(b->y[i], label_at(id)) << "row " << id;
      }
    }
    // In memory each row also names its row of resident(), which holds the same features.
    const train::ResidentData res = l.resident();
    EXPECT_EQ(b->resident_rows.size(), res.x.empty() ? 0u : n);
    for (std::uint64_t i = 0; i < b->resident_rows.size(); ++i) {
      const std::int64_t r = b->resident_rows[i];
      if (r < 0 || r >= res.rows) {
        ADD_FAILURE() << "resident row " << r << " outside [0, " << res.rows << ")";
        continue;
      }
      const auto at = static_cast<std::uint64_t>(r) * cols;
      EXPECT_TRUE(std::equal(res.x.begin() + static_cast<std::ptrdiff_t>(at),
                             res.x.begin() + static_cast<std::ptrdiff_t>(at + cols),
                             b->x.begin() + static_cast<std::ptrdiff_t>(i * cols)));
    }
    e.ids.emplace_back(b->sample_ids.begin(), b->sample_ids.end());
    e.global_rows.push_back(b->global_rows);
    e.x.emplace_back(b->x.begin(), b->x.end());
  }
  EXPECT_EQ(l.next(), nullptr) << "next() after the end must stay nullptr";
  return e;
}

// Collective over comm: every rank's `local` concatenated in rank order.
inline std::vector<std::uint64_t> gather_concat(const mpi::Comm& comm,
                                                const std::vector<std::uint64_t>& local) {
  const auto counts = comm.allgather(static_cast<int>(local.size()));
  std::vector<int> displs(counts.size(), 0);
  for (std::size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + counts[r - 1];
  std::vector<std::uint64_t> all(static_cast<std::size_t>(displs.back() + counts.back()));
  MPI_Allgatherv(local.data(), static_cast<int>(local.size()), MPI_UINT64_T, all.data(),
                 counts.data(), displs.data(), MPI_UINT64_T, comm.get());
  return all;
}

template <class E, class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<wrong exception type> ") + e.what();
  }
  return "<no exception>";
}

}  // namespace locus::test
