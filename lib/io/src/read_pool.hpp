// Parallel pread(2) of a list of byte ranges into memory (private): the calling thread and
// threads - 1 resident workers each take an equal share of the bytes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace locus::io::detail {

// bytes at `offset` of the file go to dst.
struct ReadRange {
  std::uint64_t offset = 0;
  std::byte* dst = nullptr;
  std::uint64_t bytes = 0;
};

class ReadPool {
 public:
  // Each thread takes at least this many bytes of a read: below it, waking a thread costs
  // more than the copy it would take over (~10 us against ~100 us per MiB).
  static constexpr std::uint64_t kMinShareBytes = std::uint64_t{1} << 20;

  explicit ReadPool(int threads);
  ~ReadPool();
  ReadPool(const ReadPool&) = delete;
  ReadPool& operator=(const ReadPool&) = delete;

  int threads() const noexcept { return static_cast<int>(workers_.size()) + 1; }

  // Reads every range from fd (path names it in errors) and returns once all are in memory.
  // One caller at a time. DataError for a read error or a file that ends early; when several
  // threads fail, the first share's error.
  void read(int fd, std::span<const ReadRange> ranges, const std::string& path);

 private:
  void work(int index);
  void read_share(int index);

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::uint64_t generation_ = 0;  // one per read(); workers run each generation once
  bool stop_ = false;
  int active_ = 0;                // shares of this generation still reading (not the caller's)
  int parts_ = 1;                 // threads taking part in this generation
  int fd_ = -1;
  const std::string* path_ = nullptr;
  std::span<const ReadRange> ranges_;
  std::uint64_t total_ = 0;
  std::vector<std::exception_ptr> errors_;  // by share
  std::vector<std::thread> workers_;
};

}  // namespace locus::io::detail
