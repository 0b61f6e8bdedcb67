// Validation of inference inputs (private): the features dataset against the model, the row
// count (committed_rows for a locus dataset), chunking and optional labels.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/infer/infer.hpp"
#include "locus/io/h5.hpp"
#include "locus/io/row_reader.hpp"
#include "locus/train/model/model.hpp"

namespace locus::infer::detail {

struct InputInfo {
  std::uint64_t rows = 0;        // rows to score (committed_rows of a locus dataset)
  std::uint64_t chunk_rows = 1;  // rows per chunk of the features dataset (1 if contiguous)
  bool has_labels = false;       // opts.labels exists (1-D integer, >= rows)
};

// Collective over comm. DataError (agreed) naming the file and dataset for a missing or
// malformed dataset and for a feature width that differs from the model's input width.
InputInfo inspect_input(const mpi::Comm& comm, const InferOptions& opts, const train::Mlp& model,
                        const std::string& model_path);

// This rank's own read-only handle on the input, through HDF5's POSIX (sec2) driver: units are
// assigned dynamically, so reads must never wait for other ranks, and a read-only local handle
// needs no MPI-IO at all (it also reads page-cached data several times faster). The features
// go through io::RowReader: by pread from read_threads threads where the file allows it.
// Only the main thread calls it.
class LocalInput {
 public:
  // labels may be empty (no labels read). Errors are H5Errors: the input was validated before.
  LocalInput(const std::string& path, const std::string& features, const std::string& labels,
             int read_threads = 1);
  bool has_labels() const noexcept { return static_cast<bool>(labels_); }
  std::uint64_t cols() const noexcept { return rows_->cols(); }
  // How the features are read ("pread, 4 threads (chunks of 4096 rows)", "H5Dread (...)").
  const std::string& read_method() const noexcept { return rows_->method(); }
  // Reads rows [first_row, first_row + rows) of the features (and labels when y is not empty).
  void read(std::uint64_t first_row, std::span<float> x, std::span<std::int32_t> y);
  // Reads the labels of rows [first_row, first_row + y.size()).
  void read_labels(std::uint64_t first_row, std::span<std::int32_t> y);

 private:
  h5::Id file_, features_, labels_;
  std::unique_ptr<io::RowReader> rows_;  // reads features_
};

// infer.read_threads = 0: 1 on the cpu (the forward passes are the bound and need the cores);
// on cuda, where reading is the bound, the rank's cpus (cpu_share) less two (the rank's compute
// and main threads), between 1 and 8 (a few threads already copy out of the page cache at the
// memory's speed).
int auto_read_threads(bool cuda, int rank_cpus);
// The cpus a rank may count as its own: those it may run on (its affinity mask), and no more
// than its share of all the node's ranks may run on (the union of their masks): unbound ranks
// each see the whole node, bound ones only their own cpus -- divided once either way.
int cpu_share(int own, int node_union, int ranks_on_node);

// A short stable hash (hex) of the model's widths, activation and parameters: an incremental
// run refuses to extend predictions made by another model.
std::string model_fingerprint(const train::Mlp& model);

}  // namespace locus::infer::detail
