// loader_wait_bench: the loader's data wait in isolation. Each rank takes batches of a dataset
// from train::Loader and "computes" on each for a fixed time (a busy loop standing in for a
// training step), and reports how long next() waited: per-step median/p90/p99 and the share
// of the loop, and how many batches next() gathered itself (ring empty, data in memory).
// Background producer vs synchronous reads, any prefetch depth; --features 0 hands over only
// row indices and labels, as for a device-resident set (loader.device_cache_mb: the GPU
// gathers the rows), where a step may be tens of microseconds (--step-ms 0.08). As the trainer
// does on a device backend, each step then asks for the batch after it (Loader::peek(); in an
// epoch's last step the next epoch's first, Loader::peek_next_epoch()) and counts how often it
// was ready to be copied ahead: a miss is a step that would wait for its copy on a GPU.
//   mpirun -n 2 loader_wait_bench FILE [--batch 128 (per rank)] [--prefetch 4]
//          [--background 1] [--step-ms 1.4] [--epochs 2] [--shuffle global|local]
//          [--features 1] [--gather-threads 0] [--paced 0 (LoaderOptions::paced_producer)]
//          [--skip-epochs 0 (not counted: start-up)]
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

namespace {

using namespace locus;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string path;
  long batch = 128, prefetch = 4, background = 1, epochs = 2, features = 1, gather_threads = 0,
       skip_epochs = 0, paced = 0;
  double step_ms = 1.4;
  std::string shuffle = "global";
};

Args parse(int argc, char** argv) {
  if (argc < 2) throw ConfigError("usage: loader_wait_bench FILE [--key value ...]: see the header");
  Args a;
  a.path = argv[1];
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string_view k = argv[i];
    const char* v = argv[i + 1];
    if (k == "--batch") a.batch = std::atol(v);
    else if (k == "--prefetch") a.prefetch = std::atol(v);
    else if (k == "--background") a.background = std::atol(v);
    else if (k == "--epochs") a.epochs = std::atol(v);
    else if (k == "--step-ms") a.step_ms = std::atof(v);
    else if (k == "--shuffle") a.shuffle = v;
    else if (k == "--features") a.features = std::atol(v);
    else if (k == "--gather-threads") a.gather_threads = std::atol(v);
    else if (k == "--skip-epochs") a.skip_epochs = std::atol(v);
    else if (k == "--paced") a.paced = std::atol(v);
    else throw ConfigError("unknown option " + std::string(k) + ": see the file header");
  }
  return a;
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[static_cast<std::size_t>(q * static_cast<double>(v.size() - 1))];
}

int run(mpi::Comm& world, int argc, char** argv) {
  const Args a = parse(argc, argv);
  train::LoaderOptions o;
  o.path = a.path;
  o.global_batch = a.batch * world.size();
  o.shuffle = train::parse_shuffle(a.shuffle);
  o.prefetch_depth = static_cast<int>(a.prefetch);
  o.background = a.background != 0;
  o.gather_features = a.features != 0;
  o.gather_threads = static_cast<int>(a.gather_threads);
  o.paced_producer = a.paced != 0;
  train::Loader loader(world, o);
  std::vector<double> waits;
  volatile float sink = 0;
  // Steps that asked for the batch after them, and how many found it ready; of those, the
  // epochs' last steps asking for the next epoch's first.
  long asked = 0, ready = 0, asked_first = 0, ready_first = 0;
  auto t0 = Clock::now();
  const long steps = static_cast<long>(loader.steps_per_epoch());
  for (long e = 0; e < a.epochs; ++e) {
    if (e == a.skip_epochs) t0 = Clock::now();
    loader.start_epoch(e);
    long k = 0;
    while (const train::LoadedBatch* b = loader.next()) {
      const bool counted = e >= a.skip_epochs;
      if (counted) waits.push_back(loader.last_wait_seconds() * 1e3);
      const auto s0 = Clock::now();
      const bool last = ++k == steps;
      if (counted && (!last || e + 1 < a.epochs)) {
        const bool hit = (last ? loader.peek_next_epoch() : loader.peek()) != nullptr;
        ++asked;
        ready += hit ? 1 : 0;
        asked_first += last ? 1 : 0;
        ready_first += last && hit ? 1 : 0;
      }
      // Touch the batch like a step would (its first row or index), then spin for the step.
      if (b->rows > 0) {
        sink = sink + (b->x.empty() ? static_cast<float>(b->resident_rows[0]) : b->x[0]);
      }
      while (std::chrono::duration<double, std::milli>(Clock::now() - s0).count() < a.step_ms) {
      }
    }
  }
  const double total = std::chrono::duration<double>(Clock::now() - t0).count();
  double sum = 0;
  for (const double w : waits) sum += w;
  std::printf("rank %d: %zu steps, %s%s, %s, prefetch %ld, step %.3f ms: wait median %.4f p90 "
              "%.4f p99 %.4f ms, total %.1f ms = %.2f%% of the loop; %lld batches gathered by "
              "next(); the next batch ready during the step before: %ld of %ld (an epoch's "
              "first: %ld of %ld)\n",
              world.rank(), waits.size(),
              o.background && loader.threaded() ? "producer thread" : "synchronous",
              o.paced_producer ? " (paced)" : "", o.gather_features ? "features" : "indices only", a.prefetch, a.step_ms,
              quantile(waits, 0.5), quantile(waits, 0.9), quantile(waits, 0.99), sum,
              100.0 * sum / 1e3 / total, static_cast<long long>(loader.consumer_batches()),
              ready, asked, ready_first, asked_first);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return locus::run_app(argc, argv, [&](locus::mpi::Comm& w) { return run(w, argc, argv); },
                        MPI_THREAD_MULTIPLE);
}
