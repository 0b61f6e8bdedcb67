// The prediction file (docs/FORMATS.md, "Prediction files"): scores, argmax class and top-k
// per input row, written by units with independent MPI-IO into datasets created collectively
// up front, and a committed_rows watermark advanced only once the rows are durable.
// Independent unit writes on the shared file are verified with Open MPI 4.1's default io
// component (ompio) and with ROMIO (OMPI_MCA_io=romio321) by the tests.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "locus/infer/scorer.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "locus/io/raw_io.hpp"

namespace locus::infer {

inline constexpr const char* kPredictionFormat = "locus-predictions";
inline constexpr std::int64_t kPredictionSchemaVersion = 1;

// What the datasets hold and how rows were cut (an incremental run must cut them the same way).
struct PredictionLayout {
  OutputKind kind = OutputKind::probabilities;
  int outputs = 0;               // C, the model's output width
  int top_k = 0;
  bool record_writer = false;    // /writer: the rank that wrote each row (debugging, tests)
  std::uint64_t unit_rows = 0;   // rows per work unit = rows per chunk of every dataset
  std::uint64_t batch_rows = 0;  // rows per forward pass (the batch grid)
};

// Provenance attributes, identical on every rank.
struct PredictionProvenance {
  std::string model;              // model file or checkpoint path
  std::string model_fingerprint;  // hash of the model's spec and parameters (hex)
  std::int64_t model_trained_steps = 0;
  std::string input;              // input file path
  std::string features;           // features dataset inside the input
  std::string config;             // effective config (INI)
};

class PredictionFile {
 public:
  // Collective over file.comm(): creates every dataset for `rows` rows (extendible, chunks of
  // unit_rows rows, allocated early and never filled, except /writer which is filled with -1
  // so unwritten rows show) and writes the layout and provenance attributes, committed_rows 0.
  static PredictionFile create(h5::File& file, const PredictionLayout& layout,
                               const PredictionProvenance& prov, std::uint64_t rows);
  // Collective over file.comm(): opens an existing prediction file (read_write for an incremental run).
  // DataError naming the file when it is not one, or of a newer schema version.
  static PredictionFile open(h5::File& file);

  const PredictionLayout& layout() const noexcept { return layout_; }
  const PredictionProvenance& provenance() const noexcept { return prov_; }
  std::uint64_t committed_rows() const noexcept { return committed_; }
  std::uint64_t rows() const noexcept { return values_.rows(); }

  // Collective over the file's communicator: grows every dataset to `rows` rows (new chunks are allocated at once).
  void resize(std::uint64_t rows);
  // Collective over the file's communicator: replaces the provenance attributes (an incremental run records its own).
  void write_provenance(const PredictionProvenance& prov);
  // Local, independent MPI-IO (no other rank takes part): writes rows [first_row, +n) of
  // every dataset from s (n = s.predicted/values rows). Needs only raw-data I/O: the chunks
  // exist since creation, so no metadata changes.
  void write(std::uint64_t first_row, const Scores& s, int writer_rank);
  // Local: asks the kernel to start writing what was written so far to disk, without waiting
  // (sync_file_range); does nothing where that is not available. The fsync that makes the rows
  // durable at the end then finds little left to write, instead of the whole file.
  void start_writeback() noexcept;
  // Collective over the file's communicator: makes every written row durable (H5Fflush, then
  // fsync of the file by rank 0), then advances committed_rows to `rows` and makes that durable
  // too. A crash before the attribute write leaves the old watermark: a rerun rewrites the same
  // rows. sync = false only writes the attribute: for a file under a temporary name whose
  // publication fsyncs it before the rename, so the watermark needs no fsync of its own.
  void commit_rows(std::uint64_t rows, bool sync, const char* hook_point = nullptr);

 private:
  PredictionFile(h5::File& file, PredictionLayout layout, h5::Dataset values);

  h5::File* file_;
  PredictionLayout layout_;
  PredictionProvenance prov_;
  std::uint64_t committed_ = 0;
  h5::Dataset values_;
  std::optional<h5::Dataset> predicted_, topk_index_, topk_value_, writer_;
  h5::Id dxpl_;  // independent transfers
  io::Fd writeback_fd_;  // read-only descriptor for start_writeback()
};

// Writes `rows` rows of `dset` starting at first_row from `data` with independent MPI-IO.
void write_rows_independent(const h5::Dataset& dset, std::uint64_t first_row,
                            std::uint64_t rows, hid_t mem_type, const void* data, hid_t dxpl);

}  // namespace locus::infer
