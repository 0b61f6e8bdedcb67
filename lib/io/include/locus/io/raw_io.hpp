// Raw byte movement between memory and one byte range of a file, by one rank alone: pwrite(2)
// and pread(2) in pieces, each piece CRC-32'd while it is in cache, the write-back of what was
// written started every few MiB (sync_file_range) so the disk works while the next pieces are
// copied, and reads declared sequential (a wider read-ahead while a piece is checksummed). For the
// contiguous datasets of an HDF5 file (h5::raw_offset) it bypasses HDF5 and MPI-IO, which copy
// every byte once more on the way (bench/RESULTS.md, "Checkpoints").
#pragma once

#include <hdf5.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "locus/comm/handle.hpp"

namespace locus::io {

// An owned POSIX file descriptor.
struct FdTraits {
  using value_type = int;
  static constexpr int invalid() noexcept { return -1; }
  static void close(int fd) noexcept;
};
using Fd = Handle<FdTraits>;

// zlib's CRC-32 of bytes, continuing `crc` (0 starts one): crc32(a + b) == crc32(b, crc32(a)).
// Several times zlib 1.2's speed where the CPU has carry-less multiplication (x86-64 PCLMULQDQ).
std::uint32_t crc32_bytes(std::span<const std::byte> bytes, std::uint32_t crc = 0);

class RawFile {
 public:
  enum class Mode { read, write };
  // Bytes per pwrite/pread call: below 2 MiB, because Linux (6.x, ext4 with large folios)
  // backs a write of an aligned 2 MiB range with 2 MiB page-cache folios, which cost ~10x the
  // copy where free memory is fragmented (0.4-0.8 GB/s against 4-6 GB/s for 1 MiB writes on
  // the benchmark VM; bench/RESULTS.md, "Checkpoints").
  static constexpr std::uint64_t kPieceBytes = std::uint64_t{1} << 20;
  // Bytes after which the write-back of what was written is started (sync_file_range).
  static constexpr std::uint64_t kWritebackBytes = std::uint64_t{16} << 20;

  // Local: opens an existing file (never created nor truncated). DataError (read) or IoError
  // (write) naming the path.
  static RawFile open(const std::string& path, Mode mode);

  // Local: writes `bytes` at `offset`; returns their CRC-32 continuing `crc`. A failed write
  // (a full disk, the file size limit) is an IoError naming the file, the offset and errno.
  std::uint32_t write_at(std::uint64_t offset, std::span<const std::byte> bytes,
                         std::uint32_t crc = 0);
  // Local: reads exactly out.size() bytes at `offset`; returns their CRC-32 continuing `crc`.
  // DataError naming the file when it ends before (a truncated file), or on a read error.
  std::uint32_t read_at(std::uint64_t offset, std::span<std::byte> out, std::uint32_t crc = 0);

  // Local: makes this rank's writes durable where no one else would: fdatasync, except on a
  // node-local file system (ext2/3/4, xfs, btrfs, f2fs, tmpfs, overlay), where every rank
  // writing the file shares one page cache, so one fsync of the whole file (as
  // io::Publication::commit does on rank 0) covers every rank's bytes. IoError naming the file.
  void sync_shared();
  // Local: sync_shared() after writes, then close. The destructor closes without syncing.
  void close();

  const std::string& path() const noexcept { return path_; }
  bool node_local() const noexcept { return node_local_; }

 private:
  RawFile(std::string path, Fd fd, Mode mode, bool node_local)
      : path_(std::move(path)), fd_(std::move(fd)), mode_(mode), node_local_(node_local) {}

  std::string path_;
  Fd fd_;
  Mode mode_ = Mode::read;
  bool node_local_ = false;
  bool wrote_ = false;
};

}  // namespace locus::io

namespace locus::h5 {

// Local: where a dataset's elements lie in its file when they can be moved as raw bytes: the
// absolute file offset of element 0 if the storage is contiguous, allocated, inside the file
// itself (not external) and stored exactly as `memtype` (no conversion); nullopt otherwise
// (chunked, compact, filtered, not yet allocated, another byte order): use H5Dread/H5Dwrite.
std::optional<std::uint64_t> raw_offset(hid_t dataset, hid_t memtype);

// Local: the name of the file an object belongs to, as it was opened.
std::string file_name(hid_t object);

}  // namespace locus::h5
