// locus_monitor_bench: the cost of the training monitors (lib/train/src/monitor/) per step, two
// ways. (1) Side by side: the Fashion-MNIST MLP trained for --steps steps with the detectors
// off, the anomaly detector only, the straggler detector only, and both (locus-train's
// default), the variants alternating round by round (the machine is shared and noisy); the
// figure is the median over rounds of the slowest rank's loop seconds per step. (2) In
// isolation, repeated many times: what the monitors add to a step -- the gradient's sum of
// squares, the agreeing all-reduce over the world, the verdict, the step timing -- and to an
// interval (the gather, the judgement), against the measured step.
//   mpirun -n 2 locus_monitor_bench --data out/fashion-mnist-train.h5 [--steps 400]
//                                   [--rounds 5] [--batch 256] [--log-every 100]
//                                   [--backend cpu|cuda] [--precision fp32] [--cache-mb 0]
// On the cuda backend the anomaly detector waits for the device once per step (the step's loss
// and gradient norm come back to be agreed): run (1) there to see what that wait costs.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "../common/bench_cli.hpp"
#include "locus/comm/app.hpp"
#include "locus/train/grid.hpp"
#include "locus/train/model/precision.hpp"
#include "locus/train/monitor/anomaly.hpp"
#include "locus/train/monitor/straggler.hpp"
#include "locus/train/optim/clip.hpp"
#include "locus/train/trainer.hpp"

namespace {

using namespace locus;
using namespace locus::train;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string data;
  std::int64_t steps = 400, rounds = 5, batch = 256, log_every = 100, cache_mb = 0;
  std::string backend = "cpu", precision = "fp32";
};

struct Variant {
  const char* name;
  bool anomaly, straggler;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Collective over world: seconds per step of one run (the slowest rank's training loop).
double run(const Grid& grid, const Args& a, const Variant& v) {
  TrainOptions o;
  o.model.widths = {784, 256, 128, 10};
  o.schedule.base_lr = 0.05;
  o.schedule.warmup_steps = 0;
  o.data.path = a.data;
  o.data.global_batch = a.batch;
  o.data.shuffle = Shuffle::global;
  o.max_steps = a.steps;
  o.epochs = 100;
  o.log_every = a.log_every;
  o.compute.backend = a.backend;
  o.compute.precision = parse_precision(a.precision);
  o.device_cache_bytes = static_cast<std::uint64_t>(a.cache_mb) << 20;
  o.anomaly.enabled = v.anomaly;
  o.straggler.pct = v.straggler ? 50 : 0;
  Trainer t(grid, o);
  const TrainSummary s = t.train();
  double per_step = s.seconds / static_cast<double>(s.steps);
  grid.world().allreduce_inplace(std::span<double>(&per_step, 1), MPI_MAX);
  return per_step;
}

template <class F>
double seconds_per_call(const mpi::Comm& world, int calls, F&& f) {
  world.barrier();
  const auto t0 = Clock::now();
  for (int i = 0; i < calls; ++i) f(i);
  double s = std::chrono::duration<double>(Clock::now() - t0).count() / calls;
  world.allreduce_inplace(std::span<double>(&s, 1), MPI_MAX);
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  return run_app(argc, argv, [&](mpi::Comm& world) -> int {
    namespace po = boost::program_options;
    Args a;
    po::options_description desc("locus_monitor_bench options");
    desc.add_options()("help", "this help")(
        "data", po::value(&a.data)->required(), "a locus dataset of 784 features, 10 classes")(
        "steps", po::value(&a.steps)->default_value(a.steps), "steps per run")(
        "rounds", po::value(&a.rounds)->default_value(a.rounds), "rounds of every variant")(
        "batch", po::value(&a.batch)->default_value(a.batch), "global batch")(
        "log-every", po::value(&a.log_every)->default_value(a.log_every), "log interval")(
        "backend", po::value(&a.backend)->default_value(a.backend), "compute backend (cpu, cuda)")(
        "precision", po::value(&a.precision)->default_value(a.precision),
        "cuda: fp32, tf32 or bf16")(
        "cache-mb", po::value(&a.cache_mb)->default_value(a.cache_mb),
        "cuda: loader.device_cache_mb (0: batches streamed from pinned host memory)");
    po::variables_map vm;
    if (bench::parse_command_line(desc, argc, argv, "locus_monitor_bench", vm)) return 0;
    const Grid grid(world, 1);
    const std::vector<Variant> variants = {
        {"off", false, false}, {"anomaly", true, false}, {"straggler", false, true},
        {"both (default)", true, true}};
    std::vector<std::vector<double>> times(variants.size());
    const double load0 = bench::loadavg();
    for (std::int64_t r = 0; r < a.rounds; ++r) {
      for (std::size_t i = 0; i < variants.size(); ++i) {
        // Rotate the order so no variant always runs first in a round.
        const std::size_t k = (i + static_cast<std::size_t>(r)) % variants.size();
        times[k].push_back(run(grid, a, variants[k]));
      }
    }
    const double off = median(times[0]);
    if (world.is_root()) {
      fmt::print("{} ranks, {} {}{}, global batch {}, {} steps x {} rounds, log_every {}; load "
                 "{:.1f} -> {:.1f}\n", world.size(), a.backend, a.precision,
                 a.cache_mb > 0 ? fmt::format(", device cache {} MiB", a.cache_mb) : "",
                 a.batch, a.steps, a.rounds, a.log_every, load0, bench::loadavg());
      fmt::print("| variant | ms per step (median) | per round | vs off |\n|---|---:|---|---:|\n");
      for (std::size_t i = 0; i < variants.size(); ++i) {
        std::string rounds;
        for (double t : times[i]) {
          rounds += fmt::format("{}{:.3f}", rounds.empty() ? "" : " ", t * 1e3);
        }
        fmt::print("| {} | {:.3f} | {} | {:+.1f}% |\n", variants[i].name, median(times[i]) * 1e3,
                   rounds, (median(times[i]) / off - 1) * 100);
      }
    }
    // (2) The pieces, alone.
    const std::size_t params = ParamLayout(std::vector<int>{784, 256, 128, 10}).size();
    std::vector<float> grads(params);
    for (std::size_t i = 0; i < params; ++i) grads[i] = 1e-3f * static_cast<float>(i % 97);
    double sink = 0;
    const int n = 2000;
    const double sumsq = seconds_per_call(world, n, [&](int) { sink += sum_of_squares(grads); });
    LossStats local{1.25 * a.batch / world.size(), 0, a.batch / world.size()};
    const double agree = seconds_per_call(world, n, [&](int) {
      sink += agree_step_values(grid, local, 2.0).loss;
    });
    AnomalyOptions ao;
    AnomalyDetector d(ao);
    const double judge = seconds_per_call(world, n, [&](int i) {
      MonitorEvent e;
      const StepValues v{1.0 + 0.01 * (i % 7), 2.0, true, true, 256};
      sink += static_cast<double>(d.judge(i, v, e).action == StepAction::apply);
    });
    StepTimes times_local;
    const double timing = seconds_per_call(world, n, [&](int i) {
      const auto t = Clock::now();
      const double s = std::chrono::duration<double>(Clock::now() - t).count();
      times_local.add({1e-3 * (i % 5), 1e-5, 1e-4, 0}, s);
      if (i % a.log_every == a.log_every - 1) times_local.take();
    });
    StragglerOptions so;
    so.pct = 50;
    StragglerDetector sd(so, gather_places(world));
    const double interval = seconds_per_call(world, 200, [&](int i) {
      RankSummary mine;
      mine.steps = 100;
      mine.compute_p50 = 1e-3;
      const auto all = gather_summaries(world, mine);
      if (world.is_root()) sink += static_cast<double>(sd.judge(i, all).size());
    });
    if (world.is_root()) {
      const double step = median(times[0]);
      const double per_step =
          sumsq + agree + judge + timing + interval / static_cast<double>(a.log_every);
      fmt::print("\nin isolation (us, slowest rank): sum of squares of {} floats {:.1f}, agreeing "
                 "all-reduce {:.1f}, verdict {:.2f}, step timing {:.2f}; per interval gather + "
                 "judgement {:.1f} ({:.2f} per step at log_every {})\n",
                 params, sumsq * 1e6, agree * 1e6, judge * 1e6, timing * 1e6, interval * 1e6,
                 interval * 1e6 / static_cast<double>(a.log_every), a.log_every);
      fmt::print("anomaly detector {:.1f} us = {:.2f}% of a {:.3f} ms step; straggler detector "
                 "{:.2f} us = {:.3f}%; together {:.2f}% (sink {})\n",
                 (sumsq + agree + judge) * 1e6, (sumsq + agree + judge) / step * 100, step * 1e3,
                 (timing + interval / static_cast<double>(a.log_every)) * 1e6,
                 (timing + interval / static_cast<double>(a.log_every)) / step * 100,
                 per_step / step * 100, sink > 0 ? "ok" : "0");
    }
    return 0;
  });
}
