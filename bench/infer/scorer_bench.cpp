// locus_scorer_bench: rows/s of inference compute alone on in-memory rows, 1 thread: the bare
// forward pass (train::forward, what PyTorch's no_grad forward computes) and the full scorer
// (forward + softmax + argmax + top-k + metrics; locus-infer runs the forward passes on its
// compute thread and the rest on its main thread), by the wall clock and by CPU time (median
// of repeats). Compare with torch_infer_bench.py.
//   locus_scorer_bench [--widths 784,256,128,10] [--batch 256] [--rows 262144] [--top_k 3]
//                      [--repeats 5] [--threads 1]
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/error.hpp"
#include "locus/infer/scorer.hpp"
#include "locus/train/model/blas.hpp"
#include "locus/train/model/forward.hpp"

namespace {

using namespace locus;

struct Args {
  std::string widths = "784,256,128,10";
  int batch = 256;
  int rows = 262144;
  int top_k = 3;
  int repeats = 5;
  int threads = 1;
};

Args parse(int argc, char** argv) {
  Args a;
  if (argc % 2 == 0) throw ConfigError("options come in --key value pairs");
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view key = argv[i];
    const char* v = argv[i + 1];
    if (key == "--widths") a.widths = v;
    else if (key == "--batch") a.batch = std::atoi(v);
    else if (key == "--rows") a.rows = std::atoi(v);
    else if (key == "--top_k") a.top_k = std::atoi(v);
    else if (key == "--repeats") a.repeats = std::atoi(v);
    else if (key == "--threads") a.threads = std::atoi(v);
    else throw ConfigError("unknown option " + std::string(key) + ": see the file header");
  }
  if (a.batch < 1 || a.rows < a.batch || a.repeats < 1) {
    throw ConfigError("need batch >= 1, rows >= batch, repeats >= 1");
  }
  return a;
}

double cpu_now() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Median wall and CPU seconds of fn over repeats.
std::pair<double, double> time_it(int repeats, const std::function<void()>& fn) {
  std::vector<double> wall, cpu;
  fn();  // warm-up
  for (int r = 0; r < repeats; ++r) {
    const auto w0 = std::chrono::steady_clock::now();
    const double c0 = cpu_now();
    fn();
    cpu.push_back(cpu_now() - c0);
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count());
  }
  std::sort(wall.begin(), wall.end());
  std::sort(cpu.begin(), cpu.end());
  return {wall[wall.size() / 2], cpu[cpu.size() / 2]};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Args a = parse(argc, argv);
    train::set_blas_threads(a.threads);
    const train::Mlp model(train::ModelSpec{.widths = train::parse_widths(a.widths)});
    const int d = model.layout().input_width();
    const int rows = a.rows / a.batch * a.batch;
    std::vector<float> x(static_cast<std::size_t>(rows) * d);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 2654435761u) % 1000) / 1000.0f;
    std::vector<std::int32_t> labels(static_cast<std::size_t>(rows));
    for (int i = 0; i < rows; ++i) labels[static_cast<std::size_t>(i)] = i % model.layout().output_width();

    train::Workspace ws(model, a.batch, train::Mode::inference);
    const auto fwd = time_it(a.repeats, [&] {
      for (int r = 0; r < rows; r += a.batch)
        train::forward(model, std::span<const float>(x).subspan(static_cast<std::size_t>(r) * d,
                                                               static_cast<std::size_t>(a.batch) * d),
                       a.batch, ws);
    });
    infer::Scorer scorer(model, {.kind = infer::OutputKind::probabilities, .top_k = a.top_k,
                                 .batch_rows = a.batch});
    infer::Scores out;
    const auto full = time_it(a.repeats, [&] { scorer.score(0, 0, x, labels, out); });
    std::printf("widths %s batch %d rows %d threads %d\n", a.widths.c_str(), a.batch, rows, a.threads);
    std::printf("forward_wall_rows_per_s %.0f\nforward_cpu_rows_per_s %.0f\n", rows / fwd.first, rows / fwd.second);
    std::printf("scorer_wall_rows_per_s %.0f\nscorer_cpu_rows_per_s %.0f\n", rows / full.first, rows / full.second);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "locus_scorer_bench: %s\n", e.what());
    return 2;
  }
}
