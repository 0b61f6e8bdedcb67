// The checkpoint benchmark on the world, side by side with dd in one process set: a synthetic
// training state (an MLP of one [width, width] layer, ~1 GiB at width 16384) is saved into DIR
// with the full commit (write, CRC-32s, fsync, rename, pointer), and rank 0 runs
// `dd if=<a checkpoint> of=DIR/dd.bin bs=1M conv=fsync` (the same bytes, from the page cache as
// locus copies from memory) while the other ranks wait idle; rank 0 also runs dd's loop itself
// (read 1 MiB, write it; fsync). Rounds alternate which goes first, and every timed write
// starts alike: all three sides' previous outputs deleted, nothing dirty, the disk idle for
// SETTLE seconds. Deleting all of them, not each side its own, matters on the benchmark VM:
// the guest hands free memory back to its host (free page reporting, 2 MiB blocks, after ~2 s)
// and the first touch of such a page costs ~2 s per GiB, so a write that reuses pages freed
// moments ago runs ~3x faster than one that gets reported ones. With each side deleting only
// its own file the sides' page pools drifted apart (locus/dd 0.48 in one run, 1.02-1.30 in
// another: bench/RESULTS.md, "Checkpoints"); from one shared pool, settled past the reporting
// delay, every side starts from the same state.
// Each round then times a resume: the metadata alone, the verified load cold (the file evicted
// from the page cache, as on a node that did not write it) and warm. At the end: the CRC-32 of
// this rank's share alone and the per-step agreed flag (one 3-int MPI_Allreduce). Rank 0
// prints one JSON line per round and one with the rest (run_ckpt_bench.sh takes the medians).
//   mpirun -n P locus_ckpt_bench DIR [width] [sgd|adamw] [rounds] [settle seconds]
#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "../common/bench_cli.hpp"
#include "../io/raw_baseline.hpp"
#include "locus/comm/app.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/raw_io.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"

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

// Collective: rank 0 deletes `paths`, flushes everything and leaves the disk idle (the file
// system here is mounted with `discard`: a deletion keeps the disk busy for a while).
void settle(const mpi::Comm& world, const std::vector<std::string>& paths, double seconds) {
  bench::on_root(world, [&] {
    std::error_code ec;
    for (const auto& p : paths) std::filesystem::remove_all(p, ec);
    ::sync();
    ::usleep(static_cast<useconds_t>(seconds * 1e6));
  });
}

// `dd if=src of=dst bs=1M conv=fsync` done by this process.
void copy_fsync(const std::string& src, const std::string& dst) {
  io::RawFile in = io::RawFile::open(src, io::RawFile::Mode::read);
  const int fd = ::open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw IoError("cannot create " + dst);
  std::vector<std::byte> buf(1u << 20);
  const auto size = std::filesystem::file_size(src);
  for (std::uint64_t at = 0; at < size; at += buf.size()) {
    const std::size_t n = std::min<std::uint64_t>(buf.size(), size - at);
    in.read_at(at, std::span(buf).first(n));
    if (::write(fd, buf.data(), n) != static_cast<ssize_t>(n)) throw IoError("cannot write " + dst);
  }
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) throw IoError("cannot fsync " + dst);
}

struct Round {
  double write_s = 0, dd_s = 0, dd_rank_s = 0, meta_s = 0, cold_s = 0, load_s = 0, cached = 0;
};

int run_bench(mpi::Comm& world, int argc, char** argv) {
  if (argc < 2) {
    throw ConfigError("usage: locus_ckpt_bench DIR [width] [sgd|adamw] [rounds] [settle s]");
  }
  const std::string dir = argv[1];
  const int width = argc > 2 ? std::atoi(argv[2]) : 16384;
  train::ModelSpec spec;
  spec.widths = {width, width};
  train::OptimizerOptions o;
  o.kind = argc > 3 ? train::parse_optimizer_kind(argv[3]) : train::OptimizerKind::sgd;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 3;
  const double settle_s = argc > 5 ? std::atof(argv[5]) : 2.0;
  train::TrainState state(spec, o);
  state.step = 1;
  state.optimizer->set_steps(1);
  train::CheckpointData data;
  data.model = &state.model;
  for (const auto& b : std::as_const(*state.optimizer).state()) data.optimizer_state.push_back(b);
  data.meta = meta_of(state, world);
  train::TrainState loaded(spec, o);
  const std::string ckdir = dir + "/ck", dd_out = dir + "/dd.bin", dd_src = dir + "/dd-src.h5";
  const std::string ckpt = ckdir + "/" + train::checkpoint_file_name(1);

  // Every side alike: each timed write first deletes every side's previous output (as
  // retention frees an old checkpoint), then everything is flushed and the disk left idle.
  std::uint64_t bytes = 0;
  const std::string dd2_out = dir + "/dd-in-rank.bin";
  const std::vector<std::string> outputs = {ckdir, dd_out, dd2_out};
  auto save = [&] {
    settle(world, outputs, settle_s);
    train::SaveResult saved;
    const double s = timed(world, [&] {
      saved = train::save_checkpoint(world, ckdir, data, {}, {.keep_last = 0});
    });
    bytes = saved.bytes;  // known on rank 0
    world.bcast(std::span<std::uint64_t>(&bytes, 1));
    return s;
  };
  auto dd = [&] {
    settle(world, outputs, settle_s);
    double s = 0;
    bench::on_root(world, [&] {
      const auto t0 = Clock::now();
      bench::run_shell(fmt::format("dd if='{}' of='{}' bs=1M conv=fsync status=none", dd_src,
                                   dd_out));
      s = since(t0);
    });
    return world.allreduce(s, MPI_MAX);
  };
  // dd's loop run by rank 0 itself (read 1 MiB, write it, fsync at the end): the same copy
  // from a process with the footprint of a training rank.
  auto dd_in_rank = [&] {
    settle(world, outputs, settle_s);
    double s = 0;
    bench::on_root(world, [&] {
      const auto t0 = Clock::now();
      copy_fsync(dd_src, dd2_out);
      s = since(t0);
    });
    return world.allreduce(s, MPI_MAX);
  };
  // Untimed: the source of dd (a checkpoint, in the page cache like locus's source is in
  // memory) and a first output of each side.
  save();
  bench::on_root(world, [&] { std::filesystem::rename(ckpt, dd_src); });
  dd();
  save();
  for (int r = 0; r < rounds; ++r) {
    Round t;
    const bool locus_first = r % 2 == 0;
    if (locus_first) {
      t.write_s = save();
      t.dd_s = dd();
      t.dd_rank_s = dd_in_rank();
    } else {
      t.dd_rank_s = dd_in_rank();
      t.dd_s = dd();
      t.write_s = save();
    }
    if (locus_first) save();  // untimed: the dd sides deleted the checkpoint to resume from
    bench::on_root(world, [&] { bench::evict_from_page_cache(ckpt); });
    bench::on_root(world, [&] { t.cached = bench::resident_fraction(ckpt); });
    t.cold_s = timed(world, [&] { train::load_checkpoint(world, ckpt, loaded); });
    t.meta_s = timed(world, [&] { train::read_checkpoint_meta(world, ckpt); });
    t.load_s = timed(world, [&] { train::load_checkpoint(world, ckpt, loaded); });
    if (!std::equal(loaded.model.params().begin(), loaded.model.params().end(),
                    state.model.params().begin())) {
      throw DataError("the loaded parameters differ from the saved ones");
    }
    if (world.is_root()) {
      const double gb = static_cast<double>(bytes) / 1e9;
      std::printf("{\"round\":%d,\"first\":\"%s\",\"ranks\":%d,\"width\":%d,\"optimizer\":\"%s\","
                  "\"bytes\":%llu,\"write_s\":%.4f,\"write_GBps\":%.4f,\"dd_s\":%.4f,"
                  "\"dd_GBps\":%.4f,\"ratio\":%.4f,\"dd_in_rank_s\":%.4f,\"ratio_in_rank\":%.4f,"
                  "\"meta_s\":%.5f,\"cold_load_s\":%.4f,"
                  "\"cold_load_GBps\":%.4f,\"cached_before_cold\":%.3f,\"load_s\":%.4f,"
                  "\"load_GBps\":%.4f,\"loadavg\":%.2f}\n",
                  r, locus_first ? "locus" : "dd", world.size(), width,
                  data.meta.optimizer.c_str(), static_cast<unsigned long long>(bytes), t.write_s,
                  gb / t.write_s, t.dd_s, gb / t.dd_s, t.dd_s / t.write_s, t.dd_rank_s,
                  t.dd_rank_s / t.write_s, t.meta_s, t.cold_s,
                  gb / t.cold_s, t.cached, t.load_s, gb / t.load_s, bench::loadavg());
      std::fflush(stdout);
    }
  }
  settle(world, {ckdir, dd_out, dd2_out, dd_src}, 0);

  // The CRC-32 of this rank's share of the parameters alone (what verification adds).
  const h5::RowRange mine = h5::partition_rows(static_cast<std::uint64_t>(width), world.rank(),
                                               world.size());
  const auto share = state.model.params().subspan(mine.begin * static_cast<std::uint64_t>(width),
                                                  mine.count * static_cast<std::uint64_t>(width));
  volatile std::uint32_t sink = 0;
  const double crc_s = timed(world, [&] { sink = io::crc32_bytes(std::as_bytes(share)); });
  // The agreed stop flag of every step boundary: one 3-int all-reduce.
  constexpr int kReps = 2000;
  std::array<int, 3> flags{0, 0, 0};
  const double flag_s = timed(world, [&] {
    for (int i = 0; i < kReps; ++i) world.allreduce_inplace(std::span<int>(flags), MPI_MAX);
  }) / kReps;
  if (world.is_root()) {
    std::printf("{\"crc_GBps_per_rank\":%.3f,\"flag_us\":%.2f}\n",
                static_cast<double>(share.size_bytes()) / 1e9 / crc_s, flag_s * 1e6);
    std::fflush(stdout);
  }
  return exit_code::ok;
}

}  // namespace

int main(int argc, char** argv) {
  return locus::run_app(argc, argv, [&](locus::mpi::Comm& world) {
    return run_bench(world, argc, argv);
  }, MPI_THREAD_MULTIPLE);
}
