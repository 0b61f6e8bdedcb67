// Validation of inference inputs (private): the features dataset against the model, the row
// count (committed_rows for a locus dataset), chunking and optional labels.
#pragma once

#include <cstdint>
#include <string>

#include <span>

#include "locus/comm/mpi.hpp"
#include "locus/infer/infer.hpp"
#include "locus/io/h5.hpp"
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
// needs no MPI-IO at all (it also reads page-cached data several times faster). Only the main
// thread uses it.
class LocalInput {
 public:
  // labels may be empty (no labels read). Errors are H5Errors: the input was validated before.
  LocalInput(const std::string& path, const std::string& features, const std::string& labels);
  bool has_labels() const noexcept { return static_cast<bool>(labels_); }
  std::uint64_t cols() const noexcept { return cols_; }
  // Reads rows [first_row, first_row + rows) of the features (and labels when y is not empty).
  void read(std::uint64_t first_row, std::span<float> x, std::span<std::int32_t> y);
  // Reads the labels of rows [first_row, first_row + y.size()).
  void read_labels(std::uint64_t first_row, std::span<std::int32_t> y);

 private:
  h5::Id file_, features_, labels_;
  std::uint64_t cols_ = 0;
};

// A short stable hash (hex) of the model's widths, activation and parameters: an incremental
// run refuses to extend predictions made by another model.
std::string model_fingerprint(const train::Mlp& model);

}  // namespace locus::infer::detail
