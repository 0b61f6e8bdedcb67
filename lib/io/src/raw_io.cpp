// Raw pwrite/pread of one rank's byte range with CRC-32s, early write-back and read-ahead;
// where HDF5 datasets can be moved as raw bytes (see raw_io.hpp).
#include "locus/io/raw_io.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "locus/io/h5.hpp"

namespace locus::io {

namespace {

// File systems whose files live on one node: every process writing such a file shares that
// node's page cache, so one fsync makes every writer's bytes durable.
bool is_node_local(int fd) {
  struct statfs s {};
  if (::fstatfs(fd, &s) != 0) return false;
  constexpr long kF2fs = 0xF2F52010, kOverlay = 0x794c7630;
  switch (static_cast<long>(s.f_type)) {
    case EXT4_SUPER_MAGIC:  // ext2, ext3 and ext4 share it
    case XFS_SUPER_MAGIC:
    case BTRFS_SUPER_MAGIC:
    case TMPFS_MAGIC:
    case kF2fs:
    case kOverlay:
      return true;
    default:
      return false;
  }
}

}  // namespace

void FdTraits::close(int fd) noexcept { ::close(fd); }

RawFile RawFile::open(const std::string& path, Mode mode) {
  const int fd = ::open(path.c_str(), (mode == Mode::write ? O_WRONLY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) {
    const std::string msg = fmt::format("cannot open '{}' for {}: {}", path,
                                        mode == Mode::write ? "writing" : "reading",
                                        std::strerror(errno));
    if (mode == Mode::write) throw IoError(msg);
    throw DataError(msg);
  }
  Fd owned(fd);
  // Reads go front to back: a larger read-ahead window, and the disk reads ahead while a
  // piece is checksummed. (Explicit WILLNEED hints per piece measured slower.)
  if (mode == Mode::read) ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  return RawFile(path, std::move(owned), mode, is_node_local(fd));
}

std::uint32_t RawFile::write_at(std::uint64_t offset, std::span<const std::byte> bytes,
                                std::uint32_t crc) {
  LOCUS_ASSERT(mode_ == Mode::write, fmt::format("'{}' was opened for reading", path_));
  wrote_ = true;
  std::uint64_t flushed = 0;
  for (std::uint64_t done = 0; done < bytes.size();) {
    const std::uint64_t n = std::min<std::uint64_t>(kPieceBytes, bytes.size() - done);
    for (std::uint64_t put = 0; put < n;) {
      const ssize_t w = ::pwrite(fd_.get(), bytes.data() + done + put, n - put,
                                 static_cast<off_t>(offset + done + put));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        throw IoError(fmt::format("cannot write {} bytes at offset {} of '{}': {}", n - put,
                                  offset + done + put, path_,
                                  w < 0 ? std::strerror(errno) : "nothing written"));
      }
      put += static_cast<std::uint64_t>(w);
    }
    crc = crc32_bytes(bytes.subspan(done, n), crc);
    done += n;
    // Start the write-back of the last few MiB now (asynchronously) instead of leaving all of
    // it to the final fsync: the disk then writes while the next pieces are copied. Batched,
    // so the file system allocates large extents. Where unsupported: only a lost head start.
    if (done - flushed >= kWritebackBytes || done == bytes.size()) {
      ::sync_file_range(fd_.get(), static_cast<off_t>(offset + flushed),
                        static_cast<off_t>(done - flushed), SYNC_FILE_RANGE_WRITE);
      flushed = done;
    }
  }
  return crc;
}

std::uint32_t RawFile::read_at(std::uint64_t offset, std::span<std::byte> out, std::uint32_t crc) {
  for (std::uint64_t done = 0; done < out.size();) {
    const std::uint64_t n = std::min<std::uint64_t>(kPieceBytes, out.size() - done);
    for (std::uint64_t got = 0; got < n;) {
      const ssize_t r = ::pread(fd_.get(), out.data() + done + got, n - got,
                                static_cast<off_t>(offset + done + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) {
        throw DataError(fmt::format("cannot read {} bytes at offset {} of '{}': {}", n - got,
                                    offset + done + got, path_, std::strerror(errno)));
      }
      if (r == 0) {
        throw DataError(fmt::format("'{}' ends before byte {} (a read of {} bytes at offset "
                                    "{}): the file is truncated",
                                    path_, offset + done + got, out.size(), offset));
      }
      got += static_cast<std::uint64_t>(r);
    }
    crc = crc32_bytes(out.subspan(done, n), crc);
    done += n;
  }
  return crc;
}

void RawFile::sync_shared() {
  if (!wrote_ || node_local_) return;
  if (::fdatasync(fd_.get()) != 0) {
    throw IoError(fmt::format("cannot flush '{}' to storage (fdatasync): {}", path_,
                              std::strerror(errno)));
  }
  wrote_ = false;
}

void RawFile::close() {
  if (!fd_) return;
  sync_shared();
  const int fd = fd_.release();
  if (::close(fd) != 0 && mode_ == Mode::write) {
    throw IoError(fmt::format("cannot close '{}': {}", path_, std::strerror(errno)));
  }
}

}  // namespace locus::io

namespace locus::h5 {

std::optional<std::uint64_t> raw_offset(hid_t dataset, hid_t memtype) {
  Id dcpl(LOCUS_H5_CHECK(H5Dget_create_plist(dataset)));
  if (H5Pget_layout(dcpl.get()) != H5D_CONTIGUOUS) return std::nullopt;
  if (LOCUS_H5_CHECK(H5Pget_external_count(dcpl.get())) > 0) return std::nullopt;
  if (LOCUS_H5_CHECK(H5Pget_nfilters(dcpl.get())) > 0) return std::nullopt;
  Id type(LOCUS_H5_CHECK(H5Dget_type(dataset)));
  if (LOCUS_H5_CHECK(H5Tequal(type.get(), memtype)) <= 0) return std::nullopt;
  const haddr_t at = H5Dget_offset(dataset);  // HADDR_UNDEF (no error stack) when unallocated
  if (at == HADDR_UNDEF) {
    H5Eclear2(H5E_DEFAULT);
    return std::nullopt;
  }
  return static_cast<std::uint64_t>(at);
}

std::string file_name(hid_t object) {
  const ssize_t n = LOCUS_H5_CHECK(H5Fget_name(object, nullptr, 0));
  std::vector<char> name(static_cast<std::size_t>(n) + 1);
  LOCUS_H5_CHECK(H5Fget_name(object, name.data(), name.size()));
  return std::string(name.data(), static_cast<std::size_t>(n));
}

}  // namespace locus::h5
