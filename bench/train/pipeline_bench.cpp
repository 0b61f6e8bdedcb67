// locus_pipeline_bench: pipeline parallelism on a deep MLP, on 2 ranks: each rank's training
// state (parameters, gradient, AdamW state) at pp = 1 and pp = 2, measured from the trainer's
// own buffers and from the heap's growth while they are allocated; the step time and
// throughput of pp = 2 (GPipe and 1F1B, several micro-batch counts) against dp = 2 and one
// rank; the measured pipeline bubble against the theoretical (S-1)/(M+S-1); the peak activation
// memory of each stage under GPipe and 1F1B as M grows. Configurations alternate round by
// round (the machine is shared and noisy); every figure is a median over rounds x steps.
//   mpirun -n 2 locus_pipeline_bench [--widths 2048,...(9 x 2048)] [--batch 128]
//                                    [--micro 1,2,4,8,16] [--rounds 3] [--steps 2]
//                                    [--micro-rows 16] [--timing 1]
// --timing 0 prints the state memory only.
// The memory sweep at the end keeps the micro-batch at --micro-rows rows and grows the batch
// with M (the setting where GPipe's activations grow with M and 1F1B's stay bounded).
// A step is forward + loss + backward + gradient all-reduce (dp) + SGD update; its time is
// the slowest rank's. In the 1-rank rows the second rank sleeps (it does not poll MPI).
#include <fmt/format.h>
#include <malloc.h>
#include <mpi.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "locus/comm/app.hpp"
#include "locus/comm/mpi.hpp"
#include "locus/train/model/blas.hpp"
#include "locus/train/grid.hpp"
#include "locus/train/optim/optimizer.hpp"
#include "locus/train/pipeline/pipeline.hpp"
#include "locus/train/train_state.hpp"

namespace {

using namespace locus;
using namespace locus::train;
using Clock = std::chrono::steady_clock;

struct Args {
  std::vector<int> widths = std::vector<int>(9, 2048);
  int batch = 128;
  std::vector<int> micro{1, 2, 4, 8, 16};
  int rounds = 3;
  int steps = 2;
  int micro_rows = 16;
  bool timing = true;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view key = argv[i];
    const char* value = argv[i + 1];
    if (key == "--widths")
      a.widths = parse_widths(value);
    else if (key == "--batch")
      a.batch = std::atoi(value);
    else if (key == "--micro")
      a.micro = parse_stage_boundaries(value);
    else if (key == "--rounds")
      a.rounds = std::atoi(value);
    else if (key == "--steps")
      a.steps = std::atoi(value);
    else if (key == "--micro-rows")
      a.micro_rows = std::atoi(value);
    else if (key == "--timing")
      a.timing = std::atoi(value) != 0;
    else
      throw ConfigError("unknown option " + std::string(key) + ": see the file header");
  }
  if (argc % 2 == 0) throw ConfigError("options come in --key value pairs");
  if (a.batch < 1 || a.rounds < 1 || a.steps < 1 || a.micro_rows < 1 || a.micro.empty()) {
    throw ConfigError("batch, rounds, steps, micro-rows must be >= 1 and --micro non-empty");
  }
  return a;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Waits for every rank of comm without spinning a core (an idle rank must not steal the CPU
// the 1-rank baseline computes on).
void sleep_until_all(const mpi::Comm& comm) {
  MPI_Request r = MPI_REQUEST_NULL;
  LOCUS_MPI_CHECK(MPI_Ibarrier(comm.get(), &r));
  for (int done = 0;;) {
    LOCUS_MPI_CHECK(MPI_Test(&r, &done, MPI_STATUS_IGNORE));
    if (done) return;
    const timespec ts{0, 1000000};
    nanosleep(&ts, nullptr);
  }
}

// Bytes the process has allocated from the heap (small blocks and mmapped large ones).
std::uint64_t heap_bytes() {
  const struct mallinfo2 m = mallinfo2();
  return m.uordblks + m.hblkhd;
}

// One rank's training state as the trainer builds it on grid g (TrainState of the rank's
// layers -- its stage's with pp > 1 -- and the compute backend with its gradient buffer).
struct StateBytes {
  std::uint64_t params = 0, grads = 0, optimizer = 0;  // from the buffers
  std::uint64_t heap = 0;  // the heap's growth while the state and backend were built
};

// Collective over g.world().
StateBytes measure_state(const Grid& g, const ModelSpec& spec) {
  OptimizerOptions adamw;
  adamw.kind = OptimizerKind::adamw;
  const StagePartition partition(ParamLayout(spec.widths), g.pipeline_stages());
  StateBytes b;
  const std::uint64_t before = heap_bytes();
  TrainState state(spec, adamw, partition.stage(g.stage()).held());
  PipelineCompute compute(g, state, Loss::softmax_cross_entropy, PipelineOptions{});
  b.heap = heap_bytes() - before;
  b.params = state.model.params().size_bytes();
  b.grads = compute.grads().size * sizeof(float);
  for (const auto& s : std::as_const(*state.optimizer).state()) {
    b.optimizer += s.data.size_bytes();
  }
  return b;
}

// Prints every rank's state at pp = 1 (dp = 2) and pp = 2 (on rank 0).
void print_state_memory(const mpi::Comm& world, const Grid& dp, const Grid& pp,
                        const ModelSpec& spec) {
  const auto mib = [](std::int64_t v) { return static_cast<double>(v) / 1048576.0; };
  std::vector<std::string> lines;
  for (const Grid* g : {&dp, &pp}) {
    const StateBytes b = measure_state(*g, spec);
    const auto params = world.allgather(static_cast<std::int64_t>(b.params));
    const auto grads = world.allgather(static_cast<std::int64_t>(b.grads));
    const auto opt = world.allgather(static_cast<std::int64_t>(b.optimizer));
    const auto heap = world.allgather(static_cast<std::int64_t>(b.heap));
    const std::string name = g == &dp ? "pp=1 (dp=2)" : "pp=2";
    for (std::size_t r = 0; r < params.size(); ++r) {
      lines.push_back(fmt::format("{:<12} | {:>4} | {:>10.1f} | {:>9.1f} | {:>13.1f} | {:>9.1f} "
                                  "| {:>15.1f}",
                                  name, r, mib(params[r]), mib(grads[r]), mib(opt[r]),
                                  mib(params[r] + grads[r] + opt[r]), mib(heap[r])));
    }
  }
  if (!world.is_root()) return;
  fmt::print("# per-rank training state, adamw (parameters + gradient + exp_avg + exp_avg_sq), "
             "widths {}\n",
             format_widths(spec.widths));
  fmt::print("{:<12} | {:>4} | {:>10} | {:>9} | {:>13} | {:>9} | {:>15}\n", "config", "rank",
             "params MiB", "grads MiB", "optimizer MiB", "total MiB", "heap growth MiB");
  for (const auto& l : lines) fmt::print("{}\n", l);
  fmt::print("\n");
}

// One configuration under test: an engine (on its own grid) and what it was measured at.
struct Config {
  std::string name;
  bool pipeline = false;  // pp = 2
  bool solo = false;      // runs on rank 0 alone
  int threads = 1;
  PipelineSchedule schedule = PipelineSchedule::gpipe;
  int micro = 1;
  std::unique_ptr<PipelineStage> engine;
  std::vector<double> step_s, bubble, busy;
  std::size_t peak[2] = {0, 0};
};

struct Bench {
  Args args;
  mpi::Comm world = mpi::Comm::world();
  Mlp model;
  std::vector<float> x;
  std::vector<std::int32_t> labels;
  std::vector<float> grads_full, grads_slice;
  std::unique_ptr<Optimizer> opt_full, opt_slice;

  explicit Bench(Args a)
      : args(std::move(a)), model(ModelSpec{args.widths, Activation::relu, Init::he, 0.0f, 1}) {
    const int in = model.layout().input_width();
    const int rows = std::max(
        args.batch, args.micro_rows * *std::max_element(args.micro.begin(), args.micro.end()));
    x.resize(static_cast<std::size_t>(rows) * static_cast<std::size_t>(in));
    labels.resize(static_cast<std::size_t>(rows));
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = static_cast<float>((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    for (std::size_t i = 0; i < labels.size(); ++i)
      labels[i] = static_cast<std::int32_t>(
          i * 7 % static_cast<std::size_t>(model.layout().output_width()));
    grads_full.resize(model.layout().size());
  }

  // One timed step of c on a global batch of `batch` rows; returns this rank's seconds.
  double step(Config& c, const Grid& g, std::uint64_t k, int batch) {
    PipelineStage& e = *c.engine;
    const StageRange& r = e.range();
    const std::span<float> params = model.params().subspan(r.begin, r.size());
    int begin = 0, end = batch;
    if (!c.pipeline && !c.solo) {  // dp = 2: this rank's half
      begin = g.dp_rank() * batch / g.data_parallel();
      end = (g.dp_rank() + 1) * batch / g.data_parallel();
    }
    const int in = model.layout().input_width();
    PipelineBatch b;
    if (e.first()) {
      b.x = std::span<const float>(x).subspan(static_cast<std::size_t>(begin) * in,
                                              static_cast<std::size_t>(end - begin) * in);
      b.rows = end - begin;
      b.labels = std::span<const std::int32_t>(labels).subspan(
          static_cast<std::size_t>(begin), static_cast<std::size_t>(end - begin));
    }
    const auto t0 = Clock::now();
    e.train_step(b, k, batch);
    Optimizer& opt = c.pipeline ? *opt_slice : *opt_full;
    opt.step(params,
             c.pipeline ? std::span<const float>(grads_slice) : std::span<const float>(grads_full),
             1e-4);
    return std::chrono::duration<double>(Clock::now() - t0).count();
  }
};

}  // namespace

int main(int argc, char** argv) {
  return run_app(argc, argv, [&](mpi::Comm& world) -> int {
    if (world.size() != 2) throw ConfigError("run on exactly 2 ranks: mpirun -n 2 ...");
    Bench bench(parse(argc, argv));
    const Args& a = bench.args;
    const mpi::Comm self = world.split(world.rank(), 0);
    const Grid solo(self, 1), dp(world, 1), pp(world, 2);
    print_state_memory(world, dp, pp, bench.model.spec());
    if (!a.timing) return 0;
    const StageRange mine = StagePartition(bench.model.layout(), 2).stage(pp.stage());
    bench.grads_slice.resize(mine.size());
    OptimizerOptions sgd;
    bench.opt_full = make_optimizer(sgd, bench.grads_full.size());
    bench.opt_slice = make_optimizer(sgd, mine.size());
    set_blas_threads(1);

    std::vector<Config> configs;
    const auto add = [&](std::string name, bool pipeline, bool alone, int threads,
                         PipelineSchedule sched, int micro) {
      Config c;
      c.name = std::move(name);
      c.pipeline = pipeline;
      c.solo = alone;
      c.threads = threads;
      c.schedule = sched;
      c.micro = micro;
      PipelineOptions o;
      o.micro_batches = micro;
      o.schedule = sched;
      const Grid& g = pipeline ? pp : alone ? solo : dp;
      const StageRange r =
          StagePartition(bench.model.layout(), g.pipeline_stages()).stage(g.stage());
      c.engine = std::make_unique<PipelineStage>(
          g, bench.model.spec(), Loss::softmax_cross_entropy, o,
          StageBuffers{
              bench.model.params().subspan(r.begin, r.size()),
              pipeline ? std::span<float>(bench.grads_slice) : std::span<float>(bench.grads_full)});
      configs.push_back(std::move(c));
    };
    add("1 rank, 1 thread", false, true, 1, PipelineSchedule::gpipe, 1);
    add("1 rank, 2 threads", false, true, 2, PipelineSchedule::gpipe, 1);
    add("dp=2", false, false, 1, PipelineSchedule::gpipe, 1);
    for (const auto sched : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
      for (const int m : a.micro) {
        add(fmt::format("pp=2 {} M={}", to_string(sched), m), true, false, 1, sched, m);
      }
    }
    if (world.is_root()) {
      fmt::print("{}\n", configs.back().engine->partition().describe());
    }

    std::uint64_t k = 0;
    for (int round = 0; round <= a.rounds; ++round) {  // round 0 warms up
      for (Config& c : configs) {
        const Grid& g = c.pipeline ? pp : c.solo ? solo : dp;
        for (int s = 0; s < a.steps; ++s) {
          double t = 0;
          if (c.solo && !world.is_root()) {
            sleep_until_all(world);
          } else {
            set_blas_threads(c.threads);
            t = bench.step(c, g, k, a.batch);
            set_blas_threads(1);
            if (c.solo) sleep_until_all(world);
          }
          ++k;
          const double slowest = world.allreduce(t, MPI_MAX);
          if (!c.pipeline) {
            if (round > 0) c.step_s.push_back(slowest);
            continue;
          }
          const PipelineStepStats& st = c.engine->last_step();
          const double span = world.allreduce(st.pipeline_s, MPI_MAX);
          const double busy = world.allreduce(st.busy_s, MPI_SUM) / 2.0;
          const auto peaks = world.allgather(static_cast<std::int64_t>(st.peak_activation_bytes));
          c.peak[0] = static_cast<std::size_t>(peaks[0]);
          c.peak[1] = static_cast<std::size_t>(peaks[1]);
          if (round > 0) {
            c.step_s.push_back(slowest);
            c.bubble.push_back(1.0 - busy / span);
            c.busy.push_back(busy);
          }
        }
      }
    }

    // Memory sweep: micro-batches of a fixed size, the batch growing with M.
    struct Peak {
      int micro = 0;
      std::vector<std::int64_t> bytes[2], live[2];  // [schedule][stage]
    };
    std::vector<Peak> peaks;
    for (const int m : a.micro) {
      Peak p;
      p.micro = m;
      for (int si = 0; si < 2; ++si) {
        add("sweep", true, false, 1,
            si == 0 ? PipelineSchedule::gpipe : PipelineSchedule::one_f_one_b, m);
        Config& c = configs.back();
        bench.step(c, pp, k++, a.micro_rows * m);
        p.bytes[si] = world.allgather(static_cast<std::int64_t>(c.engine->peak_activation_bytes()));
        p.live[si] =
            world.allgather(static_cast<std::int64_t>(c.engine->peak_live_micro_batches()));
        configs.pop_back();
      }
      peaks.push_back(std::move(p));
    }

    if (!world.is_root()) return 0;
    const double base = median(configs.front().step_s);
    fmt::print(
        "# widths {} ({} layers, {:.1f}M params), global batch {}, sgd; {} rounds x {} "
        "steps, median\n",
        format_widths(a.widths), bench.model.num_layers(),
        static_cast<double>(bench.model.layout().size()) / 1e6, a.batch, a.rounds, a.steps);
    fmt::print("{:<22} | {:>8} | {:>9} | {:>9} | {:>7} | {:>7} {:>7} | {:>10} {:>10}\n", "config",
               "step ms", "samples/s", "vs 1 rank", "busy ms", "bubble", "theory", "act s0 MiB",
               "act s1 MiB");
    for (const Config& c : configs) {
      const double t = median(c.step_s);
      std::string extra;
      if (c.pipeline) {
        const double theory = 1.0 / (c.micro + 1);  // (S-1)/(M+S-1), S = 2
        extra = fmt::format(" | {:>7.1f} | {:>6.1f}% {:>6.1f}% | {:>10.1f} {:>10.1f}",
                            1e3 * median(c.busy), 100.0 * median(c.bubble), 100.0 * theory,
                            static_cast<double>(c.peak[0]) / 1048576.0,
                            static_cast<double>(c.peak[1]) / 1048576.0);
      }
      fmt::print("{:<22} | {:>8.1f} | {:>9.1f} | {:>8.2f}x{}\n", c.name, 1e3 * t, a.batch / t,
                 base / t, extra);
    }
    fmt::print("\n# peak activation memory per stage, micro-batches of {} rows (batch = {} x M)\n",
               a.micro_rows, a.micro_rows);
    fmt::print("{:>4} {:>6} | {:>17} {:>17} | {:>17} {:>17}\n", "M", "batch", "gpipe s0 MiB (mb)",
               "gpipe s1 MiB (mb)", "1f1b s0 MiB (mb)", "1f1b s1 MiB (mb)");
    for (const Peak& p : peaks) {
      std::string line = fmt::format("{:>4} {:>6} |", p.micro, p.micro * a.micro_rows);
      for (int si = 0; si < 2; ++si) {
        for (int st = 0; st < 2; ++st) {
          line += fmt::format(" {:>11.2f} ({:>3})",
                              static_cast<double>(p.bytes[si][st]) / 1048576.0, p.live[si][st]);
        }
        if (si == 0) line += " |";
      }
      fmt::print("{}\n", line);
    }
    return 0;
  });
}
