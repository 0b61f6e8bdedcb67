// nccl-tests-style all-reduce benchmark: the library's gradient reducer (one-shot average)
// beside plain MPI_Allreduce(SUM) + scale, sizes doubling from 4 KiB to 64 MiB, median time
// over timed iterations after warm-up, algbw/busbw, every iteration checked, errors summed
// over ranks. Run: mpirun --oversubscribe --bind-to none -n 2 locus_allreduce_bench
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
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
  int iters = 30;
  int warmup = 5;
  comm::ReducerOptions reducer;
};

BenchOptions parse(int argc, char** argv) {
  BenchOptions o;
  po::options_description desc("locus_allreduce_bench options");
  desc.add_options()("help,h", "print this help")
      ("min-bytes,b", po::value(&o.min_bytes)->default_value(o.min_bytes), "smallest size")
      ("max-bytes,e", po::value(&o.max_bytes)->default_value(o.max_bytes), "largest size")
      ("iters,n", po::value(&o.iters)->default_value(o.iters), "timed iterations per size")
      ("warmup,w", po::value(&o.warmup)->default_value(o.warmup), "untimed iterations")
      ("chunk-bytes", po::value(&o.reducer.chunk_bytes)->default_value(o.reducer.chunk_bytes),
       "reducer chunk size")
      ("small-bytes", po::value(&o.reducer.small_bytes)->default_value(o.reducer.small_bytes),
       "reducer one-round exchange threshold")
      ("in-flight", po::value(&o.reducer.max_in_flight)
                        ->default_value(o.reducer.max_in_flight), "reducer chunks in flight");
  po::variables_map vm;
  if (bench::parse_command_line(desc, argc, argv, "locus_allreduce_bench", vm)) o.iters = 0;
  if (o.min_bytes < sizeof(float) || o.min_bytes > o.max_bytes || o.iters < 0 || o.warmup < 0)
    throw ConfigError(fmt::format("sizes {}..{} or iterations {}/{} make no sweep: give "
                                  "4 <= min-bytes <= max-bytes and non-negative counts",
                                  o.min_bytes, o.max_bytes, o.iters, o.warmup));
  return o;
}

// Values k/64 with small integers k: every partial sum is exact in float, so the average is
// the same bits whatever order an implementation sums in, and the check can be exact.
float input_value(int rank, std::size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 13) %
                                             1024) - 512) / 64.0f;
}

struct Result {
  double median_s = 0;
  long wrong = 0;
};

// One implementation under test: the operation and its per-iteration record.
struct Contender {
  std::function<void()> op;
  std::vector<double> times;
  long wrong = 0;
};

// Collective over comm: warm-up + timed iterations; each iteration runs every contender once,
// in turn, so a noisy neighbour on a shared machine hits them alike. The input is refilled
// and the output checked around every run, outside the timed region. An iteration's time is
// the slowest rank's; the result is the median.
std::vector<Result> run(const mpi::Comm& comm, const BenchOptions& o, std::vector<float>& buf,
                        const std::vector<float>& input, const std::vector<float>& expected,
                        std::vector<Contender>& contenders) {
  for (int it = 0; it < o.warmup + o.iters; ++it) {
    for (Contender& c : contenders) {
      std::copy(input.begin(), input.end(), buf.begin());
      comm.barrier();
      const double t0 = MPI_Wtime();
      c.op();
      const double t1 = MPI_Wtime();
      if (it >= o.warmup) c.times.push_back(t1 - t0);
      for (std::size_t i = 0; i < buf.size(); ++i) c.wrong += buf[i] != expected[i] ? 1 : 0;
    }
  }
  std::vector<Result> results;
  for (Contender& c : contenders) {
    comm.allreduce_inplace(std::span<double>(c.times), MPI_MAX);
    Result r;
    r.wrong = comm.allreduce(c.wrong, MPI_SUM);
    if (!c.times.empty()) {
      auto mid = c.times.begin() + static_cast<long>(c.times.size() / 2);
      std::nth_element(c.times.begin(), mid, c.times.end());
      r.median_s = *mid;
    }
    results.push_back(r);
  }
  return results;
}

std::string columns(std::size_t bytes, int ranks, const Result& r) {
  const double algbw = r.median_s > 0 ? static_cast<double>(bytes) / r.median_s / 1e9 : 0;
  const double busbw = algbw * 2.0 * (ranks - 1) / ranks;
  return fmt::format("{:>10.1f} {:>7.2f} {:>7.2f} {:>6}", r.median_s * 1e6, algbw, busbw,
                     r.wrong);
}

int run_bench(mpi::Comm& world, int argc, char** argv) {
  const BenchOptions o = parse(argc, argv);
  if (o.iters == 0) return 0;
  mpi::Comm comm = world.dup();
  std::vector<float> none;
  auto reducer = comm::make_gradient_reducer(comm, none, o.reducer);
  const int n = comm.size();
  if (comm.is_root()) {
    std::printf("# locus_allreduce_bench: float average in place, %d ranks, %d warm-up + %d "
                "timed iterations (the two contenders alternate), median of the slowest rank "
                "per iteration\n",
                n, o.warmup, o.iters);
    std::printf("# reducer: chunk_bytes=%zu small_bytes=%zu max_in_flight=%d\n",
                o.reducer.chunk_bytes, o.reducer.small_bytes, o.reducer.max_in_flight);
    std::printf("# mpi: MPI_Allreduce(MPI_IN_PLACE, MPI_SUM) then scale by 1/%d (a multiply "
                "when that is exact)\n", n);
    std::printf("#%12s %10s | %10s %7s %7s %6s | %10s %7s %7s %6s | %7s\n", "", "", "mpi", "",
                "", "", "reducer", "", "", "", "");
    std::printf("#%12s %10s | %10s %7s %7s %6s | %10s %7s %7s %6s | %7s\n", "size(B)",
                "count", "time(us)", "algbw", "busbw", "#wrong", "time(us)", "algbw", "busbw",
                "#wrong", "speedup");
  }
  long total_wrong = 0;
  double worst_speedup = 0;
  std::size_t worst_bytes = 0;
  for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
    const std::size_t count = bytes / sizeof(float);
    std::vector<float> input(count);
    std::vector<float> expected(count);
    for (std::size_t i = 0; i < count; ++i) {
      input[i] = input_value(comm.rank(), i);
      float sum = 0;
      for (int r = 0; r < n; ++r) sum += input_value(r, i);
      expected[i] = sum / static_cast<float>(n);
    }
    std::vector<float> buf(count);
    const auto fn = static_cast<float>(n);
    const float inv = 1.0f / fn;
    const bool exact_inverse = (n & (n - 1)) == 0;   // then x * inv == x / n, bit for bit
    std::vector<Contender> contenders(2);
    contenders[0].op = [&] {
      LOCUS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, buf.data(), static_cast<int>(count),
                                    MPI_FLOAT, MPI_SUM, comm.get()));
      if (exact_inverse) {
        for (float& x : buf) x *= inv;
      } else {
        for (float& x : buf) x /= fn;
      }
    };
    contenders[1].op = [&] { reducer->allreduce_average(buf); };
    const std::vector<Result> r = run(comm, o, buf, input, expected, contenders);
    const Result& mpi = r[0];
    const Result& red = r[1];
    total_wrong += mpi.wrong + red.wrong;
    const double speedup = red.median_s > 0 ? mpi.median_s / red.median_s : 0.0;
    if (worst_bytes == 0 || speedup < worst_speedup) {
      worst_speedup = speedup;
      worst_bytes = bytes;
    }
    if (comm.is_root()) {
      std::printf(" %12zu %10zu | %s | %s | %7.2f\n", bytes, count,
                  columns(bytes, n, mpi).c_str(), columns(bytes, n, red).c_str(), speedup);
      std::fflush(stdout);
    }
  }
  if (comm.is_root()) {
    std::printf("# lowest speedup: %.2f at %zu bytes\n", worst_speedup, worst_bytes);
    std::printf("# wrong values: %ld (%s)\n", total_wrong, total_wrong == 0 ? "OK" : "FAILED");
  }
  return total_wrong == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  return run_app(argc, argv, [&](mpi::Comm& world) { return run_bench(world, argc, argv); });
}
