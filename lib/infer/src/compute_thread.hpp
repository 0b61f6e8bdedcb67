// The compute thread of the scoring loop (private) and what it works on: the units this rank
// claimed, cut into stripes of rows that the main thread reads into a small ring of buffers.
//
// Why stripes: a unit is tens of MB of features. Read whole, it has left the caches by the time
// the forward passes reach its rows, and the compute thread cannot start before all of it has
// been read. Read a couple of MB at a time just ahead of the compute thread, the rows are still
// in cache when the GEMM packs them, and the first forward pass starts after the first stripe.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "engine.hpp"
#include "locus/infer/scorer.hpp"
#include "locus/io/dataset.hpp"

namespace locus::infer::detail {

struct SlowDown {
  double factor = 1.0;    // compute this many times slower
  std::int64_t ms = 0;    // sleep before each unit
};

// A unit claimed by this rank. The main thread fills it in and owns it, except for what the
// compute thread writes while the unit has stripes queued: logits or an engine's result
// buffers (each stripe its own rows) and completed; the main thread reads those once the unit
// is reported done.
struct UnitWork {
  int slot = 0;            // which of the loop's two units this is (an engine's buffers)
  std::int64_t unit = -1;  // -1: free
  bool speculative = false;
  h5::RowRange rows;
  std::uint64_t origin = 0;     // start of the unit's batch grid
  std::uint64_t next_read = 0;  // first row not yet in a stripe
  std::vector<std::int32_t> y;  // labels of the unit's rows (empty: none)
  std::vector<float> logits;    // [rows, outputs] (cpu engine)
  Scores scores;                // the main thread's post-processing of logits
  bool completed = true;        // every stripe's forward pass ran to the end
  std::atomic<bool> cancel{false};  // another rank finished the unit first (or unwinding)
};

// Rows [first_row, first_row + rows) of a unit, read into one buffer of the ring.
struct Stripe {
  UnitWork* unit = nullptr;  // nullptr: free
  std::uint64_t first_row = 0, rows = 0;
  bool first = false, last = false;  // the unit's first / last stripe
  std::span<float> x;                // [rows, inputs]; empty for a cancelled unit's remainder
};

// Runs the engine on submitted stripes in order; no MPI, no HDF5. It wakes the main
// thread once wake_after stripes are free (or a unit is done, or it runs out of stripes) rather
// than after every stripe: each wake-up costs both threads system calls, which on the project's
// VM added up to 1% of the compute time at one per stripe.
class ComputeThread {
 public:
  ComputeThread(Engine& engine, SlowDown slow, std::size_t wake_after);
  ComputeThread(const ComputeThread&) = delete;
  ComputeThread& operator=(const ComputeThread&) = delete;
  ~ComputeThread();  // finishes the stripe in hand (cancel units to make that quick), joins

  // Queues s behind the stripes already queued.
  void submit(Stripe& s);

  struct Events {
    std::vector<Stripe*> freed;   // stripes done with (their buffers may be reused)
    std::vector<UnitWork*> done;  // units whose last stripe is done, in order
  };
  // Waits up to d for stripes to be freed, appending what happened since the last call to ev;
  // false when nothing did. Rethrows the exception of a forward pass that threw.
  bool wait_for(std::chrono::milliseconds d, Events& ev);

  // Wall seconds spent on stripes, and the thread's CPU seconds, so far.
  double busy_seconds();
  double cpu_seconds();

 private:
  void loop();
  void run(Stripe& s);

  Engine& engine_;
  SlowDown slow_;
  std::size_t wake_after_;
  double busy_ = 0;  // under m_
  std::mutex m_;
  std::condition_variable work_, events_;
  std::deque<Stripe*> todo_;
  Events happened_;
  std::exception_ptr error_;
  bool quit_ = false;
  std::thread thread_;
};

}  // namespace locus::infer::detail
