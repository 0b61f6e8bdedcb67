// Read-only input files for the sources: open with a message that names the file and says what
// to do, positional reads that retry on EINTR, and the balanced partition of items over ranks.
#include "source_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include <fmt/format.h>

#include "locus/comm/error.hpp"

namespace locus::io::detail {

void FdTraits::close(int fd) noexcept { ::close(fd); }

std::string cannot_open_message(const std::string& path, int err) {
  std::error_code ec;
  const auto cwd = std::filesystem::current_path(ec);
  return fmt::format(
      "cannot open '{}': {}; check the path in [ingest] (relative paths are resolved against "
      "the working directory '{}') and that the file is readable by this job",
      path, std::strerror(err), ec ? std::string("?") : cwd.string());
}

InputFile::InputFile(std::string path) : path_(std::move(path)) {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(cannot_open_message(path_, errno));
  fd_ = Handle<FdTraits>(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw DataError(cannot_open_message(path_, errno));
  if (!S_ISREG(st.st_mode)) {
    throw DataError(fmt::format("cannot open '{}': it is not a regular file (a directory?); "
                                "check the path in [ingest]",
                                path_));
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
}

std::size_t InputFile::read_at(void* dst, std::size_t n, std::uint64_t offset) const {
  auto* out = static_cast<char*>(dst);
  std::size_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_.get(), out + done, n - done,
                                static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      throw DataError(fmt::format("reading '{}' at byte {} failed: {}; check the file system "
                                  "and re-run",
                                  path_, offset + done, std::strerror(errno)));
    }
    if (got == 0) break;  // end of file
    done += static_cast<std::size_t>(got);
  }
  return done;
}

LineReader::LineReader(const InputFile& file, std::uint64_t start, std::uint64_t limit)
    : file_(file), buf_(std::size_t{1} << 20), buf_offset_(start), limit_(limit) {}

bool LineReader::next(std::string_view& line, std::uint64_t& start) {
  for (;;) {
    const char* base = buf_.data();
    const void* nl = std::memchr(base + head_ + scanned_, '\n', tail_ - head_ - scanned_);
    if (nl != nullptr || !refill()) {
      const std::size_t end = nl != nullptr ? static_cast<std::size_t>(
                                                  static_cast<const char*>(nl) - base)
                                            : tail_;
      if (nl == nullptr && head_ == tail_) return false;  // nothing left
      line = std::string_view(buf_.data() + head_, end - head_);
      start = buf_offset_ + head_;
      head_ = nl != nullptr ? end + 1 : end;
      scanned_ = 0;
      return true;
    }
  }
}

// Moves the unread bytes to the front (growing the buffer when it is full of one line) and
// reads more. Returns false when the limit is reached.
bool LineReader::refill() {
  const std::uint64_t read_offset = buf_offset_ + tail_;
  if (read_offset >= limit_) return false;
  scanned_ = tail_ - head_;
  if (head_ > 0) {
    std::memmove(buf_.data(), buf_.data() + head_, tail_ - head_);
    buf_offset_ += head_;
    tail_ -= head_;
    head_ = 0;
  }
  if (tail_ == buf_.size()) buf_.resize(2 * buf_.size());
  const auto want =
      static_cast<std::size_t>(std::min<std::uint64_t>(buf_.size() - tail_, limit_ - read_offset));
  const std::size_t got = file_.read_at(buf_.data() + tail_, want, read_offset);
  if (got != want) {
    throw DataError(fmt::format("'{}' became shorter while it was being read; do not modify "
                                "input files during ingest",
                                file_.path()));
  }
  tail_ += got;
  return true;
}

Range partition(std::uint64_t n, int size, int rank) {
  const auto s = static_cast<std::uint64_t>(size);
  const auto r = static_cast<std::uint64_t>(rank);
  const std::uint64_t base = n / s, extra = n % s;
  const std::uint64_t begin = r * base + (r < extra ? r : extra);
  return Range{begin, begin + base + (r < extra ? 1 : 0)};
}

}  // namespace locus::io::detail
