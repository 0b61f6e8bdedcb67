// The loader's HDF5 side (private): opens the file through MPI-IO on the loader's own
// communicator, finds the row count (committed_rows, else the extent) and reads row ranges,
// collectively for the initial load and independently afterwards. Every call holds
// hdf5_mutex(): Debian's parallel HDF5 is not thread-safe.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/h5.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train::detail {

struct StagedCopy;  // stage_copy.hpp

class Source {
 public:
  // Collective over comm. Missing/unreadable file, missing or malformed datasets and a labels
  // length mismatch are DataErrors naming them, agreed on every rank (the file is closed on
  // every rank before the error leaves).
  // With `staged`, the node's staged copy is read instead, over staged->topo.node(): rows()
  // is still the source's row count and reads take source row numbers.
  Source(const mpi::Comm& comm, const LoaderOptions& opts, const StagedCopy* staged = nullptr);
  // Leaves a still-open file open (closing is collective; call close() or abandon()).
  ~Source();
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;

  std::uint64_t rows() const { return rows_; }
  std::uint64_t cols() const { return cols_; }
  bool has_labels() const { return static_cast<bool>(labels_); }
  const std::string& path() const { return path_; }

  // Collective over comm: each rank reads its own `range` (count may be 0) into x (range.count
  // × cols) and, with labels, y (range.count).
  void read_range(h5::RowRange range, float* x, std::int32_t* y);
  // Independent (no other rank takes part): the rows of `runs` (ascending, disjoint), in that
  // order, as one hyperslab union per piece below MPI-IO's 2 GiB limit.
  void read_runs(std::span<const h5::RowRange> runs, float* x, std::int32_t* y);

  // Collective over comm: closes the datasets and the file; throws on an HDF5 error.
  void close();
  // Gives up the handles without closing (while a one-rank error unwinds, when a collective
  // close would wait forever); HDF5 closes the file at MPI_Finalize.
  void abandon() noexcept;

 private:
  void inspect(const LoaderOptions& opts);
  // Source rows to rows of the opened file (the same without a staged copy).
  h5::RowRange local(h5::RowRange r) const;

  const StagedCopy* staged_;
  const mpi::Comm& comm_;
  std::string path_;
  h5::Id file_, features_, labels_;
  std::uint64_t rows_ = 0, cols_ = 0;
};

}  // namespace locus::train::detail
