// Flat against hierarchical gradient reduction (train.reduction), side by side in one run:
// the reducer's one-shot average with each engine, sizes doubling from 4 KiB to 64 MiB, the
// two contenders alternating every iteration, median of the slowest rank per iteration, every
// result checked and the two compared bit for bit. Then the latency-bandwidth model of each,
// t(n) = alpha + n / bw, fitted to the medians by least squares on relative error (so small
// and large sizes weigh alike) -- the figures a scaling model needs.
// Run: mpirun --oversubscribe --bind-to none -n 4 -x LOCUS_TEST_RANKS_PER_NODE=2
//      build/bench/comm/locus_hier_bench
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
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
  std::size_t min_bytes = std::size_t{4} << 10;
  std::size_t max_bytes = std::size_t{64} << 20;
  int iters = 20;
  int warmup = 3;
  comm::ReducerOptions reducer;
};

BenchOptions parse(int argc, char** argv) {
  BenchOptions o;
  po::options_description desc("locus_hier_bench options");
  desc.add_options()("help,h", "print this help")
      ("min-bytes,b", po::value(&o.min_bytes)->default_value(o.min_bytes), "smallest size")
      ("max-bytes,e", po::value(&o.max_bytes)->default_value(o.max_bytes), "largest size")
      ("iters,n", po::value(&o.iters)->default_value(o.iters), "timed iterations per size")
      ("warmup,w", po::value(&o.warmup)->default_value(o.warmup), "untimed iterations")
      ("chunk-bytes", po::value(&o.reducer.chunk_bytes)->default_value(o.reducer.chunk_bytes),
       "reducer chunk size")
      ("in-flight", po::value(&o.reducer.max_in_flight)
                        ->default_value(o.reducer.max_in_flight), "reducer chunks in flight");
  po::variables_map vm;
  if (bench::parse_command_line(desc, argc, argv, "locus_hier_bench", vm)) o.iters = 0;
  if (o.min_bytes < sizeof(float) || o.min_bytes > o.max_bytes || o.iters < 1 || o.warmup < 0)
    throw ConfigError(fmt::format("sizes {}..{} or iterations {}/{} make no sweep: give "
                                  "4 <= min-bytes <= max-bytes, iters >= 1, warmup >= 0",
                                  o.min_bytes, o.max_bytes, o.iters, o.warmup));
  return o;
}

// Rank- and index-dependent values whose float sum depends on the order: the bitwise
// comparison of the two engines means something.
float input_value(int rank, std::size_t i) {
  const std::uint64_t z = (i * 0x9e3779b97f4a7c15ULL) ^ (static_cast<std::uint64_t>(rank) << 48);
  return std::ldexp(static_cast<float>(z >> 40) / 16777216.0f - 0.5f,
                    static_cast<int>((z >> 8) % 17) - 8);
}

double median(std::vector<double> v) {
  auto mid = v.begin() + static_cast<long>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

// alpha + beta n fitted to (n, t) minimizing sum ((alpha + beta n - t) / t)^2.
struct Fit {
  double alpha_s = 0;
  double beta_s_per_byte = 0;
};
Fit fit(const std::vector<double>& n, const std::vector<double>& t) {
  double s00 = 0, s01 = 0, s11 = 0, r0 = 0, r1 = 0;
  for (std::size_t i = 0; i < n.size(); ++i) {
    const double w = 1.0 / (t[i] * t[i]);
    s00 += w;
    s01 += w * n[i];
    s11 += w * n[i] * n[i];
    r0 += w * t[i];
    r1 += w * n[i] * t[i];
  }
  const double det = s00 * s11 - s01 * s01;
  return Fit{(r0 * s11 - r1 * s01) / det, (s00 * r1 - s01 * r0) / det};
}

int run_bench(mpi::Comm& world, int argc, char** argv) {
  const BenchOptions o = parse(argc, argv);
  if (o.iters == 0) return 0;
  mpi::Comm comm = world.dup();
  std::vector<float> none;
  comm::ReducerOptions flat_opts = o.reducer;
  flat_opts.reduction = comm::Reduction::flat;
  comm::ReducerOptions hier_opts = o.reducer;
  hier_opts.reduction = comm::Reduction::hierarchical;
  auto flat = comm::make_gradient_reducer(comm, none, flat_opts);
  auto hier = comm::make_gradient_reducer(comm, none, hier_opts);
  const int n = comm.size();
  if (comm.is_root()) {
    std::printf("# locus_hier_bench: float average in place, %d ranks, %d warm-up + %d timed "
                "iterations (flat and hierarchical alternate), median of the slowest rank per "
                "iteration\n# reducer: chunk_bytes=%zu max_in_flight=%d\n# hierarchical: %s\n",
                n, o.warmup, o.iters, o.reducer.chunk_bytes, o.reducer.max_in_flight,
                hier->reduction().c_str());
    std::printf("#%11s | %10s %7s | %10s %7s | %7s %7s\n", "size(B)", "flat(us)", "GB/s",
                "hier(us)", "GB/s", "hier/fl", "#differ");
  }
  std::vector<double> sizes, flat_t, hier_t;
  long total_differ = 0;
  long total_wrong = 0;
  for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
    const std::size_t count = bytes / sizeof(float);
    std::vector<float> input(count);
    std::vector<float> expected(count);   // in rank order, as the flat engine sums
    for (std::size_t i = 0; i < count; ++i) {
      input[i] = input_value(comm.rank(), i);
      float sum = input_value(0, i);
      for (int r = 1; r < n; ++r) sum += input_value(r, i);
      expected[i] = sum / static_cast<float>(n);
    }
    std::vector<float> a(count), b(count);
    std::vector<double> ta, tb;
    long differ = 0;
    long wrong = 0;
    for (int it = 0; it < o.warmup + o.iters; ++it) {
      for (int which = 0; which < 2; ++which) {
        std::vector<float>& buf = which == 0 ? a : b;
        std::copy(input.begin(), input.end(), buf.begin());
        comm.barrier();
        const double t0 = MPI_Wtime();
        (which == 0 ? flat : hier)->allreduce_average(buf);
        const double t1 = MPI_Wtime();
        if (it >= o.warmup) (which == 0 ? ta : tb).push_back(t1 - t0);
      }
      wrong += std::memcmp(a.data(), expected.data(), bytes) != 0 ? 1 : 0;
      for (std::size_t i = 0; i < count; ++i)
        differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0 ? 1 : 0;
    }
    comm.allreduce_inplace(std::span<double>(ta), MPI_MAX);
    comm.allreduce_inplace(std::span<double>(tb), MPI_MAX);
    differ = comm.allreduce(differ, MPI_SUM);
    wrong = comm.allreduce(wrong, MPI_SUM);
    total_differ += differ;
    total_wrong += wrong;
    const double mf = median(ta);
    const double mh = median(tb);
    sizes.push_back(static_cast<double>(bytes));
    flat_t.push_back(mf);
    hier_t.push_back(mh);
    if (comm.is_root()) {
      std::printf(" %11zu | %10.1f %7.2f | %10.1f %7.2f | %7.2f %7ld\n", bytes, mf * 1e6,
                  static_cast<double>(bytes) / mf / 1e9, mh * 1e6,
                  static_cast<double>(bytes) / mh / 1e9, mh / mf, differ);
      std::fflush(stdout);
    }
  }
  if (comm.is_root()) {
    for (int which = 0; which < 2; ++which) {
      const Fit f = fit(sizes, which == 0 ? flat_t : hier_t);
      std::printf("# fit %-12s alpha = %8.1f us, beta = %.3g s/B (1/beta = %.2f GB/s)\n",
                  which == 0 ? "flat:" : "hierarchical:", f.alpha_s * 1e6, f.beta_s_per_byte,
                  f.beta_s_per_byte > 0 ? 1e-9 / f.beta_s_per_byte : 0.0);
    }
    std::printf("# flat results off the rank-order reference: %ld iterations (%s)\n",
                total_wrong, total_wrong == 0 ? "OK" : "FAILED");
    std::printf("# elements where hierarchical differs from flat: %ld (%s)\n", total_differ,
                total_differ == 0 ? "bitwise equal" : "not bitwise equal");
  }
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return run_app(argc, argv, [&](mpi::Comm& world) { return run_bench(world, argc, argv); });
}
