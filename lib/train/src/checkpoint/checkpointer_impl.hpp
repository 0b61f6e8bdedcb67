// Private to lib/train: the Checkpointer's state, shared by its triggers and saves
// (checkpointer.cpp) and its resume logic (checkpoint_resume.cpp).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint_detail.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"

namespace locus::train {

using CheckpointClock = std::chrono::steady_clock;

// Collective over comm: a fresh run id from rank 0.
std::string new_run_id(const mpi::Comm& comm);

struct Checkpointer::Impl {
  Impl(Trainer& t, CheckpointOptions o, std::string cfg, Log l)
      : trainer(t),
        opts(std::move(o)),
        config(std::move(cfg)),
        log(std::move(l)),
        comm(t.grid().world().dup()),
        writer_comm(t.grid().world().dup()) {}

  Trainer& trainer;
  CheckpointOptions opts;
  std::string config, config_hash;
  std::string compute_description;  // rank 0's backend, written into every checkpoint
  Log log;
  mpi::Comm comm;         // agreed flags and synchronous saves (main thread)
  mpi::Comm writer_comm;  // background saves (writer thread only)
  DatasetIdentity dataset;
  std::string run_id;
  std::vector<SaveResult> saves;
  std::int64_t last_step = -1;  // step of the last committed (or in-flight) checkpoint
  CheckpointClock::time_point last_time = CheckpointClock::now();  // rank 0's clock decides every_seconds
  int stopped_signal = 0;
  std::vector<std::string> retire;  // checkpoints past the resumed step, gone at the next save
  // The background save.
  std::thread worker;
  std::atomic<bool> done{false};
  std::unique_ptr<Snapshot> snapshot;
  SaveResult async_result;
  std::exception_ptr async_error;

  bool enabled() const { return !opts.dir.empty(); }
  bool in_flight() const { return worker.joinable(); }
  void say(const std::string& line) const {
    if (log && comm.is_root()) log(line);
  }

  CheckpointMeta meta_now();
  CheckpointData live_data(const CheckpointMeta& m);
  void record(SaveResult r);
  SaveResult save_sync(const std::string& reason);
  void start_async(const std::string& reason);
  void harvest();
  // Collective: {max signal over ranks, rank 0's time trigger, any background save running}.
  std::array<int, 3> agree_flags();
};

}  // namespace locus::train
