// Parallel pread of byte ranges: shares cut from the ranges' concatenation, one per thread.
#include "read_pool.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "locus/comm/error.hpp"

namespace locus::io::detail {

namespace {

void pread_all(int fd, std::byte* dst, std::uint64_t bytes, std::uint64_t offset,
               const std::string& path) {
  for (std::uint64_t got = 0; got < bytes;) {
    const ssize_t r = ::pread(fd, dst + got, bytes - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      throw DataError(fmt::format("cannot read {} bytes at offset {} of '{}': {}", bytes - got,
                                  offset + got, path, std::strerror(errno)));
    }
    if (r == 0) {
      throw DataError(fmt::format("'{}' ends before byte {} (a read of {} bytes at offset {}): "
                                  "the file is truncated; re-create it",
                                  path, offset + got, bytes, offset));
    }
    got += static_cast<std::uint64_t>(r);
  }
}

}  // namespace

ReadPool::ReadPool(int threads) {
  const int n = std::max(threads, 1);
  errors_.resize(static_cast<std::size_t>(n));
  workers_.reserve(static_cast<std::size_t>(n - 1));
  for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { work(i); });
}

ReadPool::~ReadPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ReadPool::read(int fd, std::span<const ReadRange> ranges, const std::string& path) {
  std::uint64_t total = 0;
  for (const ReadRange& r : ranges) total += r.bytes;
  if (total == 0) return;
  const auto wanted = std::max<std::uint64_t>(1, total / kMinShareBytes);
  const int parts = static_cast<int>(std::min<std::uint64_t>(wanted, workers_.size() + 1));
  {
    std::lock_guard lock(mu_);
    fd_ = fd;
    path_ = &path;
    ranges_ = ranges;
    total_ = total;
    parts_ = parts;
    active_ = parts - 1;
    std::fill(errors_.begin(), errors_.end(), nullptr);
    ++generation_;
  }
  if (parts > 1) wake_.notify_all();
  try {
    read_share(0);
  } catch (...) {
    errors_[0] = std::current_exception();
  }
  std::unique_lock lock(mu_);
  done_.wait(lock, [&] { return active_ == 0; });
  for (const std::exception_ptr& e : errors_)
    if (e) std::rethrow_exception(e);
}

void ReadPool::work(int index) {
  std::uint64_t seen = 0;
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    if (index >= parts_) continue;  // this read is too small to need every thread
    lock.unlock();
    std::exception_ptr error;
    try {
      read_share(index);
    } catch (...) {
      error = std::current_exception();
    }
    lock.lock();
    errors_[static_cast<std::size_t>(index)] = error;
    if (--active_ == 0) done_.notify_one();
  }
}

// Share i: bytes [i * total / parts, (i + 1) * total / parts) of the ranges' concatenation.
// Only read() writes the generation's fields, and only while no share runs.
void ReadPool::read_share(int index) {
  const auto i = static_cast<std::uint64_t>(index), n = static_cast<std::uint64_t>(parts_);
  const std::uint64_t lo = total_ * i / n, hi = total_ * (i + 1) / n;
  std::uint64_t at = 0;  // where the current range starts in the concatenation
  for (const ReadRange& r : ranges_) {
    const std::uint64_t a = std::max(lo, at), b = std::min(hi, at + r.bytes);
    if (a < b) pread_all(fd_, r.dst + (a - at), b - a, r.offset + (a - at), *path_);
    at += r.bytes;
    if (at >= hi) break;
  }
}

}  // namespace locus::io::detail
