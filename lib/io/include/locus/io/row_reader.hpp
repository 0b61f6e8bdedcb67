// Row reads of a 2-D float32 dataset by one rank, at the speed of the page cache: where the
// rows lie in the file as plain bytes (contiguous storage, or unfiltered chunks that span the
// full row width; stored as native float32; not external), they are read with pread(2) from
// several threads straight into the caller's buffer. HDF5 copies through one thread under its
// global lock, and one thread read 5.8 GB/s out of the page cache on the H200 host, whose
// host-to-device link takes 55 GB/s (bench/RESULTS.md, "GPU inference").
// Anywhere else (compression, type conversion, chunks never written; one thread on chunks below
// 4 MiB, where looking up each chunk's address costs more than H5Dread's own overhead) the rows
// go through H5Dread. The bytes are the same either way.
#pragma once

#include <hdf5.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace locus::io {

class RowReader {
 public:
  // Local. dataset: an open 2-D dataset of `file` (both borrowed: they must outlive the
  // reader), read through HDF5's default POSIX driver. threads >= 1 read at once, the
  // calling thread among them (threads - 1 are started here). H5Error when the dataset
  // cannot be inspected.
  RowReader(hid_t file, hid_t dataset, int threads);
  ~RowReader();
  RowReader(const RowReader&) = delete;
  RowReader& operator=(const RowReader&) = delete;

  std::uint64_t cols() const noexcept;

  // Local: rows [first_row, first_row + out.size() / cols()) into out, which holds whole
  // rows. Only one thread may call it at a time, and no other thread may use HDF5 meanwhile
  // (the chunk lookups and the H5Dread fallback are HDF5 calls). DataError naming the file
  // when it ends early (a truncated file) or a read fails; H5Error from H5Dread.
  void read(std::uint64_t first_row, std::span<float> out);

  // Whether reads bypass HDF5, and how: "pread, 4 threads (chunks of 4096 rows)" or
  // "H5Dread (the dataset is compressed)".
  bool direct() const noexcept;
  const std::string& method() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace locus::io
