// stage_bench: node-local staging (data.stage_dir) against reading the source, side by side in
// one run. The source is put on a "slow path" by evicting it from the page cache
// (posix_fadvise POSIX_FADV_DONTNEED, by every rank, then a barrier) before the loader is made
// and before every epoch, so each epoch's reads of the source go to the disk; the staged copy
// lives in stage_dir (tmpfs /dev/shm here) and is not evicted. The loader runs out of core
// (memory_budget below the partition), so every epoch reads its rows again: from the source
// (direct) or from the staged copy (staged). Each repeat runs direct then staged (alternating
// the order every repeat); per mode it reports the loader's start-up time (for staged: the
// staging itself), and samples/s per epoch (loader only, no compute). Rank 0 prints one line
// per run and the medians.
//   mpirun -n 2 stage_bench FILE STAGE_DIR [--shuffle local|global] [--budget-mb 8]
//          [--batch 256 (per rank)] [--epochs 3] [--repeats 3] [--evict 1]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/app.hpp"
#include "locus/comm/error.hpp"
#include "locus/train/data/loader.hpp"
#include "locus/train/data/stage.hpp"

namespace {

using namespace locus;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string path, stage_dir, shuffle = "local";
  long budget_mb = 8, batch = 256, epochs = 3, repeats = 3, evict = 1;
};

Args parse(int argc, char** argv) {
  if (argc < 3) throw ConfigError("usage: stage_bench FILE STAGE_DIR [--key value ...]: see the header");
  Args a;
  a.path = argv[1];
  a.stage_dir = argv[2];
  for (int i = 3; i + 1 < argc; i += 2) {
    const std::string_view k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--shuffle") a.shuffle = v;
    else if (k == "--budget-mb") a.budget_mb = std::atol(v);
    else if (k == "--batch") a.batch = std::atol(v);
    else if (k == "--epochs") a.epochs = std::atol(v);
    else if (k == "--repeats") a.repeats = std::atol(v);
    else if (k == "--evict") a.evict = std::atol(v);
    else throw ConfigError("unknown option " + std::string(k) + ": see the file header");
  }
  return a;
}

// Drops the source's pages from the page cache (all ranks, then a barrier).
void evict(const mpi::Comm& world, const std::string& path, bool on) {
  if (on) {
    const int fd = ::open(path.c_str(), O_RDONLY);
    if (fd >= 0) {
      ::fdatasync(fd);
      ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
    }
  }
  world.barrier();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct Result {
  double startup = 0;
  std::vector<double> rates;  // samples/s per epoch
};

Result run_mode(mpi::Comm& world, const Args& a, bool staged) {
  train::LoaderOptions o;
  o.path = a.path;
  o.global_batch = a.batch * world.size();
  o.shuffle = train::parse_shuffle(a.shuffle);
  o.memory_budget = static_cast<std::uint64_t>(a.budget_mb) << 20;
  if (staged) o.stage_dir = a.stage_dir;
  Result r;
  evict(world, a.path, a.evict != 0);
  const auto t0 = Clock::now();
  {
    train::Loader loader(world, o);
    world.barrier();
    r.startup = std::chrono::duration<double>(Clock::now() - t0).count();
    volatile float sink = 0;
    for (long e = 0; e < a.epochs; ++e) {
      evict(world, a.path, a.evict != 0);
      const auto s0 = Clock::now();
      loader.start_epoch(e);
      std::int64_t samples = 0;
      while (const train::LoadedBatch* b = loader.next()) {
        if (b->rows > 0) sink = sink + b->x[0];
        samples += b->global_rows;
      }
      world.barrier();
      const double s = std::chrono::duration<double>(Clock::now() - s0).count();
      r.rates.push_back(static_cast<double>(samples) / s);  // global samples per second
    }
    if (world.is_root()) {
      std::printf("  %-6s residency %-9s start-up %.3f s%s, epochs:", staged ? "staged" : "direct",
                  train::to_string(loader.residency()), r.startup,
                  staged ? (" (" + loader.stage_report().describe() + ")").c_str() : "");
      for (const double x : r.rates) std::printf(" %.0f", x);
      std::printf(" samples/s\n");
      std::fflush(stdout);
    }
  }
  if (staged) train::remove_staged_copy(world, o);
  return r;
}

int run(mpi::Comm& world, int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (world.is_root()) {
    std::printf("stage_bench %s -> %s: %d ranks, shuffle %s, budget %ld MiB, batch %ld/rank, "
                "%ld epochs, evict %ld\n", a.path.c_str(), a.stage_dir.c_str(), world.size(),
                a.shuffle.c_str(), a.budget_mb, a.batch, a.epochs, a.evict);
  }
  std::vector<double> startup[2], rate[2];
  for (long rep = 0; rep < a.repeats; ++rep) {
    for (int k = 0; k < 2; ++k) {
      const bool staged = (k + rep) % 2 == 1;  // direct first on even repeats
      const Result r = run_mode(world, a, staged);
      startup[staged].push_back(r.startup);
      // The first epoch of a staged run reads what staging just wrote; all epochs count.
      for (const double x : r.rates) rate[staged].push_back(x);
    }
  }
  if (world.is_root()) {
    const double d = median(rate[0]), s = median(rate[1]);
    std::printf("median: direct start-up %.3f s, %.0f samples/s | staged start-up (staging) "
                "%.3f s, %.0f samples/s | staged/direct throughput %.2fx\n",
                median(startup[0]), d, median(startup[1]), s, d > 0 ? s / d : 0.0);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return locus::run_app(argc, argv, [&](locus::mpi::Comm& world) { return run(world, argc, argv); },
                        MPI_THREAD_MULTIPLE);
}
