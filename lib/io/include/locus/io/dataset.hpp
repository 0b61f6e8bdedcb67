// Row-partitioned 1-D/2-D HDF5 datasets with collective hyperslab I/O: every rank reads or
// writes its own contiguous row range in one collective transfer (or several ranges in rounds).
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/io/file.hpp"

namespace locus::h5 {

// A contiguous range of rows [begin, begin + count).
struct RowRange {
  std::uint64_t begin = 0;
  std::uint64_t count = 0;
  std::uint64_t end() const { return begin + count; }
};

// Balanced partition of n rows over `size` ranks: the first n % size ranks get one more row.
// With align > 1, boundaries fall on multiples of align (chunk-aligned) except the last.
RowRange partition_rows(std::uint64_t n, int rank, int size, std::uint64_t align = 1);

enum class Dtype { f32, f64, i32, i64, u8 };
template <class T> constexpr Dtype dtype_of();
template <> constexpr Dtype dtype_of<float>() { return Dtype::f32; }
template <> constexpr Dtype dtype_of<double>() { return Dtype::f64; }
template <> constexpr Dtype dtype_of<std::int32_t>() { return Dtype::i32; }
template <> constexpr Dtype dtype_of<std::int64_t>() { return Dtype::i64; }
template <> constexpr Dtype dtype_of<std::uint8_t>() { return Dtype::u8; }
const char* dtype_name(Dtype t);

struct DatasetSpec {
  std::string name;               // path inside the file, e.g. "/features"
  Dtype dtype = Dtype::f32;
  std::uint64_t rows = 0;
  std::uint64_t cols = 0;         // 0 → a 1-D dataset of `rows` elements
  std::uint64_t chunk_rows = 0;   // 0 → about 1 MiB per chunk
  bool extendible = false;        // unlimited maximum rows (for --append)
  bool fletcher32 = false;        // per-chunk checksum filter, verified on every read
  // 0: no compression; 1-9: the shuffle filter then deflate at this zlib level. Chunks are
  // then allocated as they are written (not early), and every write must be collective
  // (write_rows and write_row_ranges are).
  int deflate_level = 0;
};

// How HDF5 performed the last transfer (from H5Pget_mpio_actual_io_mode and
// H5Pget_mpio_no_collective_cause), so tests can assert "collective" really was.
struct TransferReport {
  H5D_mpio_actual_io_mode_t mode = H5D_MPIO_NO_COLLECTIVE;
  std::uint32_t local_no_collective_cause = 0;
  std::uint32_t global_no_collective_cause = 0;
  bool collective() const { return mode != H5D_MPIO_NO_COLLECTIVE; }
};

// Rows [0, rows) of the 1-D or 2-D dataset `dset` (named `name` in file `file`, for the
// message) are stored in the file, not merely declared: a contiguous dataset has storage for
// them, a chunked one has at least as many chunks allocated as cover them. A dataset declared
// far larger than the data written (h5py's lazily allocated chunks, a wrong shape) would
// otherwise read as fill values. Throws DataError naming the file, the dataset and both sizes.
// Local; reads only metadata.
void check_stored(hid_t dset, std::uint64_t rows, const std::string& file,
                  const std::string& name);

class Dataset {
 public:
  // Collective over the file's communicator.
  static Dataset create(File& file, const DatasetSpec& spec);
  static Dataset open(File& file, const std::string& name);

  std::uint64_t rows() const noexcept { return rows_; }
  std::uint64_t cols() const noexcept { return cols_; }
  // Elements per row (cols, or 1 for a 1-D dataset).
  std::uint64_t row_width() const noexcept { return cols_ == 0 ? 1 : cols_; }
  Dtype dtype() const noexcept { return dtype_; }
  hid_t id() const noexcept { return id_.get(); }
  const std::string& name() const noexcept { return name_; }

  // Collective over the file's communicator: each rank writes/reads its own `rows` rows
  // starting at `first_row` (rows may be 0 on some ranks). data.size() must be
  // rows × row_width(). Large transfers are cut into pieces below MPI-IO's 2 GiB limit; all
  // ranks take part in every piece.
  template <class T> void write_rows(std::uint64_t first_row, std::span<const T> data) {
    transfer(true, first_row, data.size(), dtype_of<T>(), const_cast<T*>(data.data()));
  }
  template <class T> void read_rows(std::uint64_t first_row, std::span<T> out) {
    transfer(false, first_row, out.size(), dtype_of<T>(), out.data());
  }
  // Collective over the file's communicator: each rank writes its rows as several ranges, in
  // rounds of collective transfers, one contiguous range per rank per round (ranks with fewer
  // ranges join the later rounds with an empty selection; a range beyond MPI-IO's limit takes
  // several). `ranges` must be ascending and disjoint (across ranks every row is written by one
  // rank), and `data` holds their rows back to back in that order: data.size() = total rows ×
  // row_width().
  template <class T> void write_row_ranges(std::span<const RowRange> ranges,
                                           std::span<const T> data) {
    transfer(true, ranges, data.size(), dtype_of<T>(), const_cast<T*>(data.data()));
  }

  // Collective: grows (or shrinks) an extendible dataset to new_rows.
  void resize(std::uint64_t new_rows);

  const TransferReport& last_transfer() const noexcept { return last_; }

  // For tests and benchmarks: the largest piece one transfer call hands to MPI-IO.
  static void set_max_piece_bytes(std::uint64_t bytes);

 private:
  Dataset(const mpi::Comm& comm, Id id, std::string name);
  void transfer(bool write, std::uint64_t first_row, std::size_t elements, Dtype memtype,
                void* data);
  void transfer(bool write, std::span<const RowRange> ranges, std::size_t elements,
                Dtype memtype, void* data);

  mpi::Comm comm_;  // borrowed view of the owning File's communicator
  Id id_;
  std::string name_;
  Dtype dtype_ = Dtype::f32;
  std::uint64_t rows_ = 0;
  std::uint64_t cols_ = 0;
  TransferReport last_;
};

}  // namespace locus::h5
