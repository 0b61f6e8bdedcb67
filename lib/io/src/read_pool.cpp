// Parallel pread of byte ranges: pieces of at most 1 MiB taken from one queue by the caller and
// the workers.
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
  try {
    workers_.reserve(static_cast<std::size_t>(n - 1));
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { work(); });
  } catch (...) {  // no thread to be had: those started are joined (no destructor runs)
    stop();
    throw;
  }
}

ReadPool::~ReadPool() { stop(); }

void ReadPool::stop() noexcept {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
  workers_.clear();
}

void ReadPool::begin(int fd, const std::string& path) {
  std::lock_guard lock(mu_);  // every piece of the last read is done (finish() waited)
  fd_ = fd;
  path_ = &path;
  pieces_.clear();
  next_ = completed_ = 0;
  error_ = nullptr;
}

void ReadPool::add(std::uint64_t offset, std::byte* dst, std::uint64_t bytes) {
  if (bytes == 0) return;
  bool several = false;
  {
    std::lock_guard lock(mu_);
    for (std::uint64_t at = 0; at < bytes; at += kPieceBytes)
      pieces_.push_back({offset + at, dst + at, std::min(kPieceBytes, bytes - at)});
    several = pieces_.size() > 1;
  }
  // A lone piece is left to the caller's finish(): waking a worker would cost more than it
  // takes over.
  if (!workers_.empty() && several) wake_.notify_all();
}

void ReadPool::finish() {
  std::unique_lock lock(mu_);
  while (next_ < pieces_.size()) read_piece(lock, next_++);
  done_.wait(lock, [&] { return completed_ == pieces_.size(); });
  if (error_) std::rethrow_exception(error_);
}

void ReadPool::abandon() noexcept {
  std::unique_lock lock(mu_);
  completed_ += pieces_.size() - next_;
  next_ = pieces_.size();
  done_.wait(lock, [&] { return completed_ == pieces_.size(); });
}

void ReadPool::work() {
  std::unique_lock lock(mu_);
  while (true) {
    wake_.wait(lock, [&] { return stop_ || next_ < pieces_.size(); });
    if (stop_) return;
    read_piece(lock, next_++);
  }
}

void ReadPool::read_piece(std::unique_lock<std::mutex>& lock, std::size_t i) {
  const Piece p = pieces_[i];
  const int fd = fd_;
  const std::string& path = *path_;
  lock.unlock();
  std::exception_ptr error;
  try {
    pread_all(fd, p.dst, p.bytes, p.offset, path);
  } catch (...) {
    error = std::current_exception();
  }
  lock.lock();
  if (error && !error_) error_ = error;
  if (++completed_ == pieces_.size()) done_.notify_all();
}

}  // namespace locus::io::detail
