// Private helpers shared by the input sources (checksum, IDX, CSV): an owned read-only file
// descriptor whose errors name the file, exact positional reads, and the balanced partition.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/handle.hpp"

namespace locus::io::detail {

struct FdTraits {
  using value_type = int;
  static constexpr int invalid() noexcept { return -1; }
  static void close(int fd) noexcept;
};

// A regular file opened read-only, with its size taken once at open time.
class InputFile {
 public:
  // Throws DataError ("cannot open 'x': <reason>; check the path in [ingest] ...") when the
  // file is missing, unreadable or not a regular file.
  explicit InputFile(std::string path);

  const std::string& path() const noexcept { return path_; }
  int fd() const noexcept { return fd_.get(); }
  std::uint64_t size() const noexcept { return size_; }

  // Reads up to n bytes at offset; returns fewer only at end of file. Throws DataError on an
  // I/O error. Never moves a shared file position, so ranks and readers never interfere.
  std::size_t read_at(void* dst, std::size_t n, std::uint64_t offset) const;

 private:
  std::string path_;
  Handle<FdTraits> fd_;
  std::uint64_t size_ = 0;
};

// Reads a file's lines forward from a byte offset up to a limit, through a buffer that grows
// when one line is longer than it (no per-line allocation).
class LineReader {
 public:
  LineReader(const InputFile& file, std::uint64_t start, std::uint64_t limit);
  // The next line without its '\n' (a '\r' before it is kept) and the file offset where it
  // starts; the last line may lack a '\n'. Returns false at the limit. The view is valid
  // until the next call.
  bool next(std::string_view& line, std::uint64_t& start);

 private:
  bool refill();

  const InputFile& file_;
  std::vector<char> buf_;
  std::size_t head_ = 0;         // start of the unread data in buf_
  std::size_t scanned_ = 0;      // bytes after head_ already searched for '\n'
  std::size_t tail_ = 0;         // end of the valid data in buf_
  std::uint64_t buf_offset_ = 0; // file offset of buf_[0]
  std::uint64_t limit_ = 0;
};

// The "cannot open" message used by every source (also for gzopen failures).
std::string cannot_open_message(const std::string& path, int err);

// Balanced partition of n items over size parts: the first n % size parts get one extra.
struct Range {
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t count() const noexcept { return end - begin; }
};
Range partition(std::uint64_t n, int size, int rank);

}  // namespace locus::io::detail
