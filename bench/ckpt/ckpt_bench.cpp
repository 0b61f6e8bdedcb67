// One round of the checkpoint benchmark on the world: saves a synthetic training state (an MLP
// of one [width, width] layer, ~1 GiB at width 16384) into DIR with the full commit (write,
// CRC-32s, fsync, rename, pointer), then times a resume: the metadata alone and the verified
// load. Also the CRC-32 of this rank's share alone and the per-step agreed flag (one 3-int
// MPI_Allreduce). Prints one JSON line (rank 0); run_ckpt_bench.sh alternates rounds with dd.
//   mpirun -n P locus_ckpt_bench DIR [width] [optimizer: sgd|adamw]
#include <zlib.h>

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "locus/comm/app.hpp"
#include "locus/io/dataset.hpp"
#include "locus/train/checkpoint.hpp"

namespace {

using namespace locus;
using Clock = std::chrono::steady_clock;

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Collective: the slowest rank's time of fn (barrier first).
template <class Fn>
double timed(const mpi::Comm& world, Fn&& fn) {
  world.barrier();
  const auto t0 = Clock::now();
  fn();
  return world.allreduce(since(t0), MPI_MAX);
}

train::CheckpointMeta meta_of(const train::TrainState& s, const mpi::Comm& world) {
  train::CheckpointMeta m;
  m.run_id = "bench";
  m.step = s.step;
  m.optimizer_steps = s.optimizer->steps();
  m.optimizer = std::string(train::to_string(s.optimizer->options().kind));
  m.schedule = "constant";
  m.global_batch = 128;
  m.shuffle = "global";
  m.dataset = {"synthetic", 1, 1, "0"};
  m.world_size = world.size();
  m.data_parallel = world.size();
  m.pipeline_stages = 1;
  m.model = s.model.spec();
  m.loss = train::Loss::mse;
  return m;
}

int bench(mpi::Comm& world, int argc, char** argv) {
  if (argc < 2) throw ConfigError("usage: locus_ckpt_bench DIR [width] [sgd|adamw]");
  const std::string dir = argv[1];
  const int width = argc > 2 ? std::atoi(argv[2]) : 16384;
  train::ModelSpec spec;
  spec.widths = {width, width};
  train::OptimizerOptions o;
  o.kind = argc > 3 ? train::parse_optimizer_kind(argv[3]) : train::OptimizerKind::sgd;
  train::TrainState state(spec, o);
  state.step = 1;
  state.optimizer->set_steps(1);
  train::CheckpointData data;
  data.model = &state.model;
  for (const auto& b : std::as_const(*state.optimizer).state()) data.optimizer_state.push_back(b);
  data.meta = meta_of(state, world);

  train::SaveResult saved;
  const double write_s = timed(world, [&] {
    saved = train::save_checkpoint(world, dir, data, {}, {.keep_last = 0});
  });
  std::uint64_t bytes = saved.bytes;  // known on rank 0
  world.bcast(std::span<std::uint64_t>(&bytes, 1));
  const double meta_s = timed(world, [&] { train::read_checkpoint_meta(world, saved.path); });
  train::TrainState loaded(spec, o);
  const double load_s = timed(world, [&] { train::load_checkpoint(world, saved.path, loaded); });
  // The CRC-32 of this rank's share of the parameters alone (what verification adds).
  const h5::RowRange mine = h5::partition_rows(static_cast<std::uint64_t>(width), world.rank(),
                                               world.size());
  const auto share = state.model.params().subspan(mine.begin * static_cast<std::uint64_t>(width),
                                                  mine.count * static_cast<std::uint64_t>(width));
  volatile uLong sink = 0;
  const double crc_s = timed(world, [&] {
    const auto b = std::as_bytes(share);
    sink = crc32_z(0L, reinterpret_cast<const Bytef*>(b.data()), b.size());
  });
  // The agreed stop flag of every step boundary: one 3-int all-reduce.
  constexpr int kReps = 2000;
  std::array<int, 3> flags{0, 0, 0};
  const double flag_s = timed(world, [&] {
    for (int i = 0; i < kReps; ++i) world.allreduce_inplace(std::span<int>(flags), MPI_MAX);
  }) / kReps;
  if (world.is_root()) {
    const double gb = static_cast<double>(bytes) / 1e9;
    std::printf("{\"ranks\":%d,\"width\":%d,\"optimizer\":\"%s\",\"bytes\":%llu,\"write_s\":%.4f,"
                "\"write_GBps\":%.4f,\"meta_s\":%.5f,\"load_s\":%.4f,\"load_GBps\":%.4f,"
                "\"crc_GBps_per_rank\":%.3f,\"flag_us\":%.2f}\n",
                world.size(), width, data.meta.optimizer.c_str(),
                static_cast<unsigned long long>(bytes), write_s, gb / write_s, meta_s, load_s,
                gb / load_s, static_cast<double>(share.size_bytes()) / 1e9 / crc_s, flag_s * 1e6);
    std::fflush(stdout);
  }
  return exit_code::ok;
}

}  // namespace

int main(int argc, char** argv) {
  return locus::run_app(argc, argv, [&](locus::mpi::Comm& world) {
    return bench(world, argc, argv);
  }, MPI_THREAD_MULTIPLE);
}
