// CopyPool: helpers wait on a generation counter; run() publishes the work, copies its own
// piece (the first) and waits until every helper has finished its piece.
#include "data/copy_pool.hpp"

namespace locus::train::detail {

namespace {

// Piece k of [0, n) cut into `pieces` contiguous, nearly equal parts.
std::uint64_t cut(std::uint64_t n, int pieces, int k) {
  return n * static_cast<std::uint64_t>(k) / static_cast<std::uint64_t>(pieces);
}

}  // namespace

CopyPool::CopyPool(int helpers) : helpers_(helpers > 0 ? helpers : 0) {
  threads_.reserve(static_cast<std::size_t>(helpers_));
  try {
    for (int i = 0; i < helpers_; ++i) threads_.emplace_back([this, i] { work(i + 1); });
  } catch (...) {  // no thread for a helper: stop those started (no run() can happen now)
    stop();
    throw;
  }
}

CopyPool::~CopyPool() { stop(); }

void CopyPool::stop() noexcept {
  {
    const std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
  threads_.clear();
}

void CopyPool::run(std::uint64_t n,
                   const std::function<void(std::uint64_t, std::uint64_t)>& part) {
  std::unique_lock busy(run_mutex_, std::try_to_lock);
  if (threads_.empty() || !busy.owns_lock() || n < 2) {
    part(0, n);
    return;
  }
  const int pieces = helpers() + 1;
  {
    const std::lock_guard lock(mutex_);
    part_ = &part;
    n_ = n;
    pending_ = helpers();
    ++generation_;
  }
  wake_.notify_all();
  part(0, cut(n, pieces, 1));
  std::unique_lock lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
  part_ = nullptr;
}

void CopyPool::work(int index) {
  std::uint64_t seen = 0;
  const int pieces = helpers() + 1;
  for (;;) {
    std::unique_lock lock(mutex_);
    wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
    if (stop_) return;
    seen = generation_;
    const auto* part = part_;
    const std::uint64_t n = n_;
    lock.unlock();
    (*part)(cut(n, pieces, index), cut(n, pieces, index + 1));
    lock.lock();
    if (--pending_ == 0) done_.notify_one();
  }
}

}  // namespace locus::train::detail
