// The loader's copy helpers (private): a few persistent threads that share the row copies of
// one in-memory batch with the thread that gathers it. A GPU consumes a batch of 1024
// Fashion-MNIST rows (3.2 MB) in well under a millisecond, faster than one thread copies
// random rows into page-locked memory (about 5 GB/s: measured, bench/RESULTS.md "GPU"). Which
// thread copies which rows changes nothing in the batch: every row goes to its own place.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace locus::train::detail {

class CopyPool {
 public:
  // helpers: threads besides the caller (0: run() copies on the calling thread alone).
  explicit CopyPool(int helpers);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  int helpers() const noexcept { return helpers_; }

  // Calls part(begin, end) over contiguous pieces covering [0, n), one per thread, the caller
  // included, and returns when all are done. One run at a time: a caller that finds the pool
  // busy (the loader's other gathering thread) does its whole range alone. part must not throw.
  void run(std::uint64_t n, const std::function<void(std::uint64_t, std::uint64_t)>& part);

 private:
  void work(int index);
  void stop() noexcept;

  std::mutex run_mutex_;  // held for a whole run()
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  const std::function<void(std::uint64_t, std::uint64_t)>* part_ = nullptr;
  std::uint64_t n_ = 0;
  std::uint64_t generation_ = 0;  // bumped per run; each helper takes part once per generation
  int pending_ = 0;               // helpers still copying in this generation
  bool stop_ = false;
  const int helpers_;  // set before the threads start (they read it)
  std::vector<std::thread> threads_;
};

}  // namespace locus::train::detail
