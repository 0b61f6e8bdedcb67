// How much of the gradient reduction the streaming reducer hides behind a (simulated) backward
// pass: per step, backward alone, backward then one-shot average, and backward with
// ready_from() after each layer + finish(), with the reducer's own comm/blocked/hidden stats.
// Run: mpirun --oversubscribe --bind-to none -n 2 locus_overlap_bench
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include "../common/bench_cli.hpp"
#include "locus/comm/app.hpp"
#include "locus/comm/reducer.hpp"

namespace po = boost::program_options;
using namespace locus;

namespace {

struct BenchOptions {
  std::size_t grad_bytes = std::size_t{32} << 20;
  int layers = 8;
  int work = 16;   // multiply-adds per gradient element: the compute intensity knob
  int steps = 20;
  int warmup = 3;
  comm::ReducerOptions reducer;
};

BenchOptions parse(int argc, char** argv) {
  BenchOptions o;
  po::options_description desc("locus_overlap_bench options");
  desc.add_options()("help,h", "print this help")
      ("grad-bytes", po::value(&o.grad_bytes)->default_value(o.grad_bytes), "gradient size")
      ("layers", po::value(&o.layers)->default_value(o.layers), "layers (equal sizes)")
      ("work", po::value(&o.work)->default_value(o.work), "multiply-adds per element")
      ("steps", po::value(&o.steps)->default_value(o.steps), "timed steps")
      ("warmup", po::value(&o.warmup)->default_value(o.warmup), "untimed steps")
      ("bucket-bytes", po::value(&o.reducer.bucket_bytes)
                           ->default_value(o.reducer.bucket_bytes), "reducer bucket size")
      ("chunk-bytes", po::value(&o.reducer.chunk_bytes)->default_value(o.reducer.chunk_bytes),
       "reducer chunk size")
      ("in-flight", po::value(&o.reducer.max_in_flight)
                        ->default_value(o.reducer.max_in_flight), "reducer chunks in flight");
  po::variables_map vm;
  if (bench::parse_command_line(desc, argc, argv, "locus_overlap_bench", vm)) o.steps = 0;
  if (o.layers < 1 || o.work < 1 || o.grad_bytes < sizeof(float) * o.layers)
    throw ConfigError(fmt::format("layers={} work={} grad-bytes={}: give at least one layer, "
                                  "work >= 1 and 4 bytes per layer", o.layers, o.work,
                                  o.grad_bytes));
  return o;
}

// The stand-in for a layer's backward: a dependent multiply-add chain per element, so the
// time scales with --work and the written values depend on rank and step.
void backward_layer(std::span<float> g, std::size_t first, int rank, int step, int work) {
  const float a = 0.999f;
  for (std::size_t i = 0; i < g.size(); ++i) {
    float x = static_cast<float>((first + i + static_cast<std::size_t>(rank) * 7 +
                                  static_cast<std::size_t>(step)) % 977) * 1e-3f;
    for (int k = 0; k < work; ++k) x = x * a + 1e-4f;
    g[i] = x;
  }
}

struct Times {
  std::vector<double> backward, serial, overlap, comm, blocked, progress;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<long>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

int run_bench(mpi::Comm& world, int argc, char** argv) {
  const BenchOptions o = parse(argc, argv);
  if (o.steps == 0) return 0;
  const std::size_t n = o.grad_bytes / sizeof(float);
  std::vector<float> grads(n);
  std::vector<float> oneshot(n);
  auto reducer = comm::make_gradient_reducer(world, grads, o.reducer);
  std::vector<std::size_t> starts(static_cast<std::size_t>(o.layers));
  for (int l = 0; l < o.layers; ++l) starts[static_cast<std::size_t>(l)] = n * l / o.layers;

  auto backward = [&](std::span<float> g, int step, bool stream) {
    std::size_t end = n;
    for (int l = o.layers - 1; l >= 0; --l) {
      const std::size_t s = starts[static_cast<std::size_t>(l)];
      backward_layer(g.subspan(s, end - s), s, world.rank(), step, o.work);
      if (stream) reducer->ready_from(s);
      end = s;
    }
  };
  Times t;
  long mismatches = 0;
  for (int step = 0; step < o.warmup + o.steps; ++step) {
    const bool timed = step >= o.warmup;
    world.barrier();
    double t0 = MPI_Wtime();
    backward(oneshot, step, false);
    const double t_back = MPI_Wtime() - t0;
    reducer->allreduce_average(oneshot);
    const double t_serial = MPI_Wtime() - t0;
    world.barrier();
    t0 = MPI_Wtime();
    backward(grads, step, true);
    reducer->finish();
    const double t_overlap = MPI_Wtime() - t0;
    mismatches += std::memcmp(grads.data(), oneshot.data(), n * sizeof(float)) != 0 ? 1 : 0;
    if (!timed) continue;
    const comm::ReduceTimes& r = reducer->stats().last;
    t.backward.push_back(world.allreduce(t_back, MPI_MAX));
    t.serial.push_back(world.allreduce(t_serial, MPI_MAX));
    t.overlap.push_back(world.allreduce(t_overlap, MPI_MAX));
    t.comm.push_back(world.allreduce(r.comm_s, MPI_MAX));
    t.blocked.push_back(world.allreduce(r.blocked_s, MPI_MAX));
    t.progress.push_back(world.allreduce(r.progress_s, MPI_MAX));
  }
  mismatches = world.allreduce(mismatches, MPI_SUM);
  if (world.is_root()) {
    const double comm_s = median(t.comm);
    const double blocked_s = median(t.blocked);
    std::printf("# locus_overlap_bench: %d ranks, %zu-byte gradient in %d layers, work=%d, "
                "bucket_bytes=%zu chunk_bytes=%zu max_in_flight=%d, median of %d steps (ms)\n",
                world.size(), o.grad_bytes, o.layers, o.work, o.reducer.bucket_bytes,
                o.reducer.chunk_bytes, o.reducer.max_in_flight, o.steps);
    std::printf("# %9s %9s %9s | %9s %9s %9s %7s | %7s\n", "backward", "+oneshot", "streamed",
                "comm", "blocked", "progress", "hidden", "saved");
    std::printf("  %9.2f %9.2f %9.2f | %9.2f %9.2f %9.2f %6.0f%% | %6.0f%%\n",
                median(t.backward) * 1e3, median(t.serial) * 1e3, median(t.overlap) * 1e3,
                comm_s * 1e3, blocked_s * 1e3, median(t.progress) * 1e3,
                comm_s > 0 ? 100.0 * std::clamp(1.0 - blocked_s / comm_s, 0.0, 1.0) : 0.0,
                100.0 * (1.0 - median(t.overlap) / median(t.serial)));
    std::printf("# streamed vs one-shot results: %ld mismatching steps (%s)\n", mismatches,
                mismatches == 0 ? "OK" : "FAILED");
  }
  return mismatches == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return run_app(argc, argv, [&](mpi::Comm& world) { return run_bench(world, argc, argv); });
}
