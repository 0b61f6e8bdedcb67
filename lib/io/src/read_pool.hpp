// Parallel pread(2) of byte ranges into memory (private): the calling thread and threads - 1
// resident workers take the ranges' pieces from one queue while the caller is still adding
// ranges, so reading starts before the last range is known (finding a chunk's address takes
// HDF5 ~15 us, about what copying 200 KiB out of the page cache takes).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace locus::io::detail {

class ReadPool {
 public:
  // Ranges are cut into pieces of at most this many bytes, each read by one pread call of one
  // thread: small enough for the threads to share a 2-25 MiB stripe evenly, large enough that
  // a piece's system call and queue step are small beside its copy (~70 us a MiB here).
  static constexpr std::uint64_t kPieceBytes = std::uint64_t{1} << 20;

  explicit ReadPool(int threads);
  ~ReadPool();
  ReadPool(const ReadPool&) = delete;
  ReadPool& operator=(const ReadPool&) = delete;

  int threads() const noexcept { return static_cast<int>(workers_.size()) + 1; }

  // One read at a time, by one caller: begin(), add() for every range, finish().
  // fd stays open and path (named in errors) alive until finish() returns.
  void begin(int fd, const std::string& path);
  // bytes at `offset` of the file go to dst; the workers may start on them at once.
  void add(std::uint64_t offset, std::byte* dst, std::uint64_t bytes);
  // Reads what the workers have not taken, waits for every piece, and rethrows the first
  // failure: DataError for a read error or a file that ends early.
  void finish();
  // After a failure of the caller between begin() and finish(): drops the pieces no thread
  // has taken and waits for the others (they write into the caller's buffer).
  void abandon() noexcept;

 private:
  struct Piece {
    std::uint64_t offset = 0;
    std::byte* dst = nullptr;
    std::uint64_t bytes = 0;
  };
  void work();
  void stop() noexcept;  // ends and joins the threads
  // Reads piece i (taken under the lock), then counts it done.
  void read_piece(std::unique_lock<std::mutex>& lock, std::size_t i);

  std::mutex mu_;
  std::condition_variable wake_, done_;
  bool stop_ = false;
  int fd_ = -1;
  const std::string* path_ = nullptr;
  std::vector<Piece> pieces_;
  std::size_t next_ = 0;       // the next piece to take
  std::size_t completed_ = 0;  // pieces read (or failed)
  std::exception_ptr error_;   // the first failure of this read
  std::vector<std::thread> workers_;
};

}  // namespace locus::io::detail
