// The trainer's side of the device input path, checked on the CPU: a compute backend that
// wraps the cpu backend and takes its inputs as a device backend does (cuda/cuda_compute.cpp).
// prefetch_inputs() starts a "copy" of a batch that the next forward_backward() uses when it
// gets the same memory (same first array, same rows) -- and then computes on the copy, as the
// device would, not on the host batch. A real copy reads the host memory asynchronously until
// the step that uses it, or until drop_prefetched(); so the model checks, at each of those
// points and whenever a copy is replaced, that the memory still holds what it held when the
// copy began. A change means the loader reused memory a device could still be reading (a
// torn copy); a copy replaced or left unused means wasted bandwidth. It also keeps a device
// cache (cache_dataset: a copy of the block) and a mapped block (map_dataset: the loader's,
// read in place), from which it gathers the rows of batches that come as row indices. Batches
// come from the model's own HostMemory, as from a device backend's page-locked memory, so the
// trainer runs its device configuration: a paced producer and copies ahead of each step. With
// defers_step_values, it also defers the anomaly detector's step values as the cuda backend
// does (compute.hpp): the sum of squares taken at request_step_values(), an update gated on
// its finiteness (skipped, its step still counted, as on the device), the values handed over
// after the update was issued -- so the trainer's deferred order (deferred_step()) runs here.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "locus/train/compute.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train::test {

// What the model saw (shared with the test, which may outlive the backend).
struct InputLog {
  std::int64_t steps = 0;           // forward_backward() calls
  std::int64_t prefetched = 0;      // prefetch_inputs() calls that started a copy
  std::int64_t used = 0;            // steps that found their inputs copied ahead
  std::vector<std::uint64_t> used_at;  // the step numbers of those
  std::int64_t dropped = 0;         // copies drop_prefetched() forgot unused
  std::int64_t wasted = 0;          // copies replaced, or not the batch of the next step
  std::int64_t index_batches = 0;   // steps whose batch came as row indices (rows gathered)
  std::vector<std::string> torn;    // memory changed while a copy could read it
  std::atomic<std::int64_t> live_blocks{0};  // HostMemory blocks not yet returned (any thread)
};

struct AsyncInputOptions {
  // Each forward_backward() takes at least this long, so the paced producer is ahead of the
  // step (as it is of a device's step when the producer keeps up).
  std::chrono::microseconds step_delay{0};
  bool defers_step_values = false;
};

class AsyncInputCompute final : public Compute {
 public:
  AsyncInputCompute(std::unique_ptr<Compute> inner, TrainState& state,
                    std::shared_ptr<InputLog> log, AsyncInputOptions options)
      : inner_(std::move(inner)), state_(state), log_(std::move(log)), options_(options) {}

  std::string_view name() const noexcept override { return "cpu+async-inputs"; }
  std::string describe() const override { return inner_->describe() + ", inputs copied ahead"; }
  comm::GradientBuffer grads() noexcept override { return inner_->grads(); }

  void prefetch_inputs(const Batch& b) override {
    if (b.rows <= 0) return;
    if (copy_) {
      ++log_->wasted;  // a second copy before the step: a device overwrites the first
      finish("replaced by another copy");
    }
    copy_ = std::make_unique<Copy>(b);
    ++log_->prefetched;
  }

  void drop_prefetched() override {
    if (!copy_) return;
    ++log_->dropped;
    finish("dropped");
  }

  void forward_backward(const Batch& batch, std::uint64_t step, double grad_divisor,
                        const GradsReadyFn& on_grads_ready) override {
    ++log_->steps;
    std::this_thread::sleep_for(options_.step_delay);
    std::unique_ptr<Copy> mine;
    if (copy_ && copy_->identity == identity(batch) && copy_->rows == batch.rows) {
      if (!copy_->unchanged()) {
        log_->torn.push_back(fmt::format("step {}: the batch changed after its copy began", step));
      }
      ++log_->used;
      log_->used_at.push_back(step);
      mine = std::move(copy_);
    } else if (copy_) {
      ++log_->wasted;
      finish(fmt::format("not the batch of step {}", step));
    }
    // The device computes on what it copied; the host batch otherwise; its rows gathered from
    // the cached or mapped block when the batch names them.
    const Batch& in = mine ? mine->batch_ : batch;
    inner_->forward_backward(gathered(in), step, grad_divisor, on_grads_ready);
  }

  void cache_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols) override {
    cached_.assign(x.begin(), x.end());
    block_ = cached_;
    block_rows_ = rows, cols_ = cols;
  }
  void map_dataset(std::span<const float> x, std::int64_t rows, std::int64_t cols) override {
    block_ = x;  // the loader's resident block, which outlives the backend and never moves
    block_rows_ = rows, cols_ = cols;
  }
  HeldSamples held_samples() const override {
    if (block_.empty()) return {};
    return {cached_.empty() ? "mapped by the model" : "cached by the model",
            cached_.size() * sizeof(float), ""};
  }

  void optimizer_step(double lr, double clip) override {
    if (gate_ && !std::isfinite(squares_)) {
      state_.optimizer->finish_step();  // the device skips the update; the host counts it
      return;
    }
    inner_->optimizer_step(lr, clip);
  }
  double last_grad_norm() override { return inner_->last_grad_norm(); }
  double grad_squares() override { return inner_->grad_squares(); }
  void drain_stats(std::vector<LossStats>& out) override { inner_->drain_stats(out); }

  bool defers_step_values() const noexcept override { return options_.defers_step_values; }
  void gate_updates(bool on) override { gate_ = on; }
  void request_step_values() override { squares_ = inner_->grad_squares(); }
  double take_step_values(std::vector<LossStats>& out) override {
    inner_->drain_stats(out);
    return squares_;
  }
  LossStats evaluate(const Batch& batch) override { return inner_->evaluate(batch); }
  std::shared_ptr<HostMemory> host_memory() override {
    return std::make_shared<CountedMemory>(log_);
  }

 private:
  static const void* identity(const Batch& b) noexcept {  // as the cuda backend's
    return b.x.empty() ? static_cast<const void*>(b.resident_rows.data()) : b.x.data();
  }

  // `b` with its rows gathered from the block where it names them (x empty).
  Batch gathered(const Batch& b) {
    if (!b.x.empty() || b.resident_rows.empty()) return b;
    ++log_->index_batches;
    gather_.resize(b.resident_rows.size() * static_cast<std::size_t>(cols_));
    auto out = gather_.begin();
    for (const std::int64_t r : b.resident_rows) {
      if (r < 0 || r >= block_rows_) {
        log_->torn.push_back(fmt::format("row {} is outside the block's {}", r, block_rows_));
        return b;
      }
      const auto at = block_.begin() + r * cols_;
      out = std::copy(at, at + cols_, out);
    }
    Batch g = b;
    g.x = gather_;
    g.resident_rows = {};
    return g;
  }

  // A copy in flight: the host spans it reads and what they held when it began.
  struct Copy {
    explicit Copy(const Batch& b)
        : source(b),
          identity(AsyncInputCompute::identity(b)),
          rows(b.rows),
          x(b.x.begin(), b.x.end()),
          labels(b.labels.begin(), b.labels.end()),
          targets(b.targets.begin(), b.targets.end()),
          ids(b.sample_ids.begin(), b.sample_ids.end()),
          resident(b.resident_rows.begin(), b.resident_rows.end()) {}
    template <class T>
    static bool same(std::span<const T> now, const std::vector<T>& then) {
      return now.size() == then.size() &&
             (then.empty() || std::memcmp(now.data(), then.data(), now.size_bytes()) == 0);
    }
    bool unchanged() const {
      return same(source.x, x) && same(source.labels, labels) && same(source.targets, targets) &&
             same(source.sample_ids, ids) && same(source.resident_rows, resident);
    }
    Batch source;
    const void* identity;
    int rows;
    std::vector<float> x;
    std::vector<std::int32_t> labels;
    std::vector<float> targets;
    std::vector<std::uint64_t> ids;
    std::vector<std::int64_t> resident;
    Batch batch_{x, rows, labels, targets, ids, resident};  // the copy, as the device holds it
  };

  // The copy ends (a device would have finished reading by now): was the memory left alone?
  void finish(const std::string& how) {
    if (!copy_->unchanged()) {
      log_->torn.push_back(fmt::format("a copy {}: its batch changed while it could be read", how));
    }
    copy_.reset();
  }

  // The ring's batch buffers, counted (the loader must return each before it ends).
  struct CountedMemory final : HostMemory {
    explicit CountedMemory(std::shared_ptr<InputLog> l) : log(std::move(l)) {}
    void* allocate(std::size_t bytes) override {
      void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
      if (p == nullptr) throw std::bad_alloc();
      ++log->live_blocks;
      return p;
    }
    void deallocate(void* p, std::size_t) noexcept override {
      std::free(p);
      --log->live_blocks;
    }
    std::shared_ptr<InputLog> log;
  };

  std::unique_ptr<Compute> inner_;
  TrainState& state_;
  std::shared_ptr<InputLog> log_;
  AsyncInputOptions options_;
  std::unique_ptr<Copy> copy_;
  bool gate_ = false;
  double squares_ = 0.0;  // of request_step_values()
  std::vector<float> cached_;     // cache_dataset()'s copy
  std::span<const float> block_;  // the samples batches' row indices point into
  std::int64_t block_rows_ = 0, cols_ = 0;
  std::vector<float> gather_;     // a batch's gathered rows
};

// ComputeOptions::factory for the model around the cpu backend.
inline std::function<std::unique_ptr<Compute>(TrainState&, Loss)> async_input_factory(
    const mpi::Comm& world, std::shared_ptr<InputLog> log, AsyncInputOptions options) {
  return [&world, log, options](TrainState& state, Loss loss) -> std::unique_ptr<Compute> {
    ComputeOptions cpu;  // no factory: the cpu backend by name
    return std::make_unique<AsyncInputCompute>(make_compute(cpu, world, state, loss), state, log,
                                               options);
  };
}

}  // namespace locus::train::test
