// The device-side gather of `loader.gather = device` (lib/train/src/cuda/kernels.cu
// gather_rows): a batch of random rows read by a kernel straight from page-locked, mapped host
// memory into device memory, on the copy stream, while the compute stream runs the step. Its
// grid is capped (CudaCompute::upload_inputs: a quarter of the SMs) so that it leaves the step's
// kernels most of the GPU; this measures what the cap costs and saves, by batch size:
//   link     pinned cudaMemcpy of a batch's bytes, host to device (the PCIe bound);
//   device   the same gather from device memory (the device cache's gather);
//   alone    the mapped gather by grid cap (blocks; 0 = one row block per row), GB/s of rows;
//   beside   the same cap while a loop of the first layer's forward GEMMs (fp32, 256 x batch x
//            cols, the trainer's Matmul) runs on the compute stream: the GEMM loop's slowdown
//            against the loop alone, and the gather's GB/s over its own loop (1.2x as long as
//            the GEMM loop, so it ends alone); "prio" gives the compute stream the
//            device's greatest stream priority (the copy stream keeps the default, the lowest);
//   bf16     the mapped gather alone of the block's bf16 copy (train.precision = bf16: the
//            trainer converts the samples once on the host), GB/s of its rows (2 bytes a value),
//            and its rows per second over the fp32 gather's ("rows x").
// Medians of --iters timed runs after --warmup (the short ones -- link, device, alone, bf16 --
// as graphs of 10 back to back, so that launch latency is not counted); each row copied is
// checked once per cap.
//   locus_gather_bench [--rows 262144] [--cols 784] [--batches 1024,8192] [--caps 8,16,32]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include "../common/bench_cli.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/host_bf16.hpp"
#include "cuda/kernels.hpp"
#include "cuda/matmul.hpp"
#include "cuda/memory.hpp"
#include "locus/comm/app.hpp"
#include "locus/comm/error.hpp"

namespace po = boost::program_options;
using namespace locus;
using namespace locus::train::cuda;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

std::vector<int> parse_ints(const std::string& text, const char* option) {
  std::vector<int> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      std::size_t used = 0;
      const int v = std::stoi(item, &used);
      if (used != item.size() || v < 0) throw std::invalid_argument(item);
      out.push_back(v);
    } catch (const std::exception&) {
      throw ConfigError(fmt::format("--{} '{}': expected non-negative integers separated by "
                                    "commas", option, text));
    }
  }
  if (out.empty()) throw ConfigError(fmt::format("--{} is empty", option));
  return out;
}

// enqueue's work on stream s, captured once as a graph.
template <class F>
GraphExec capture(cudaStream_t s, F&& enqueue) {
  LOCUS_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  enqueue();
  cudaGraph_t raw = nullptr;
  LOCUS_CUDA_CHECK(cudaStreamEndCapture(s, &raw));
  const Graph graph(raw);
  cudaGraphExec_t exec = nullptr;
  LOCUS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph.get(), 0));
  return GraphExec(exec);
}

// Milliseconds between two events recorded around `enqueue` on stream s, once per iteration
// (for work that runs milliseconds: one launch's latency is noise there).
template <class F>
double timed(cudaStream_t s, int warmup, int iters, F&& enqueue) {
  const Event a = make_timing_event(), b = make_timing_event();
  std::vector<double> ms;
  for (int i = 0; i < warmup + iters; ++i) {
    LOCUS_CUDA_CHECK(cudaEventRecord(a.get(), s));
    enqueue();
    LOCUS_CUDA_CHECK(cudaEventRecord(b.get(), s));
    LOCUS_CUDA_CHECK(cudaEventSynchronize(b.get()));
    float t = 0;
    LOCUS_CUDA_CHECK(cudaEventElapsedTime(&t, a.get(), b.get()));
    if (i >= warmup) ms.push_back(t);
  }
  return median(ms);
}

// Milliseconds one `enqueue` takes on stream s, for work of microseconds: kReps of them back
// to back in one graph, timed as above and divided by kReps, so that the host's launch latency
// (an event is stamped as soon as an idle stream reaches it) is not counted as the work's.
// enqueue runs once first outside the capture (a GEMM picks its algorithm on its first call).
constexpr int kReps = 10;
template <class F>
double timed_short(cudaStream_t s, int warmup, int iters, F&& enqueue) {
  enqueue();
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(s));
  const GraphExec reps = capture(s, [&] {
    for (int r = 0; r < kReps; ++r) enqueue();
  });
  return timed(s, warmup, iters, [&] { LOCUS_CUDA_CHECK(cudaGraphLaunch(reps.get(), s)); }) /
         kReps;
}

Stream make_stream_with(int priority) {
  cudaStream_t s = nullptr;
  LOCUS_CUDA_CHECK(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  return Stream(s);
}

// Every gathered row equals its host row (batch rows of `width` values of T in dst).
template <class T>
void check_rows(const T* host, const T* dst, const std::vector<std::int64_t>& idx,
                std::size_t width, int batch, int cap, const char* what) {
  std::vector<T> got(idx.size() * width);
  LOCUS_CUDA_CHECK(cudaMemcpy(got.data(), dst, got.size() * sizeof(T), cudaMemcpyDeviceToHost));
  for (std::size_t r = 0; r < idx.size(); ++r) {
    const T* want = host + static_cast<std::size_t>(idx[r]) * width;
    if (std::memcmp(got.data() + r * width, want, width * sizeof(T)) != 0) {
      throw InternalError(fmt::format("batch {} cap {}: {} row {} differs from host row {}",
                                      batch, cap, what, r, idx[r]));
    }
  }
}

struct Beside {
  double gather_gbs = 0, gemm_slowdown = 0;
};

}  // namespace

int main(int argc, char** argv) {
  // Each row as it is measured, even where a time limit ends the run.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    std::int64_t rows = 262144;
    int cols = 784, iters = 20, warmup = 3, gemm_out = 256;
    double window_ms = 5.0;
    std::string batches_text = "1024,8192", caps_text = "8,16,32";
    po::options_description desc("locus_gather_bench options");
    desc.add_options()("help", "this text")
        ("rows", po::value(&rows)->default_value(rows), "rows of the host block")
        ("cols", po::value(&cols)->default_value(cols), "floats per row")
        ("batches", po::value(&batches_text)->default_value(batches_text), "batch sizes")
        ("caps", po::value(&caps_text)->default_value(caps_text),
         "grid caps in blocks (a quarter and half the SMs, and 0, uncapped, are always added)")
        ("gemm-out", po::value(&gemm_out)->default_value(gemm_out), "GEMM output width")
        ("window-ms", po::value(&window_ms)->default_value(window_ms),
         "length of the GEMM loop the gathers run beside")
        ("iters", po::value(&iters)->default_value(iters), "timed runs")
        ("warmup", po::value(&warmup)->default_value(warmup), "untimed runs first");
    po::variables_map vm;
    if (bench::parse_command_line(desc, argc, argv, "locus_gather_bench", vm)) return 0;
    if (rows < 1 || cols < 1 || iters < 1 || warmup < 0 || gemm_out < 1 || window_ms <= 0) {
      throw ConfigError("--rows, --cols, --iters, --gemm-out and --window-ms must be positive");
    }
    const std::vector<int> batches = parse_ints(batches_text, "batches");
    const int max_batch = *std::max_element(batches.begin(), batches.end());
    if (std::ranges::find(batches, 0) != batches.end() || max_batch > rows) {
      throw ConfigError(fmt::format("--batches '{}': a batch has at least one row and at most "
                                    "--rows ({})", batches_text, rows));
    }
    std::vector<int> caps = parse_ints(caps_text, "caps");

    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
      throw ConfigError("no CUDA device is visible: this benchmark needs one");
    }
    LOCUS_CUDA_CHECK(cudaSetDevice(0));
    cudaDeviceProp prop{};
    LOCUS_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    caps.push_back(std::max(8, prop.multiProcessorCount / 4));  // CudaCompute::upload_inputs' cap
    caps.push_back(std::max(8, prop.multiProcessorCount / 2));  // its cap until run 8
    caps.push_back(0);
    std::sort(caps.begin(), caps.end(), [](int a, int b) {
      return (a == 0 ? INT32_MAX : a) < (b == 0 ? INT32_MAX : b);
    });
    caps.erase(std::unique(caps.begin(), caps.end()), caps.end());
    int least = 0, greatest = 0;
    LOCUS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));

    const std::size_t width = static_cast<std::size_t>(cols);
    const std::size_t block_floats = static_cast<std::size_t>(rows) * width;
    std::vector<float> host(block_floats);
    std::mt19937_64 gen(1);
    std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
    for (float& v : host) v = uni(gen);
    LOCUS_CUDA_CHECK(cudaHostRegister(host.data(), block_floats * sizeof(float),
                                      cudaHostRegisterMapped));
    void* mapped_raw = nullptr;
    LOCUS_CUDA_CHECK(cudaHostGetDevicePointer(&mapped_raw, host.data(), 0));
    const auto* mapped = static_cast<const float*>(mapped_raw);
    // The block's bf16 copy, page-locked and mapped, as CudaCompute::map_dataset makes it.
    MappedBuffer<__nv_bfloat16> host_bf16(block_floats);
    to_bf16_host(host.data(), reinterpret_cast<std::uint16_t*>(host_bf16.data()), block_floats);
    void* mapped_bf16_raw = nullptr;
    LOCUS_CUDA_CHECK(cudaHostGetDevicePointer(&mapped_bf16_raw, host_bf16.data(), 0));
    const auto* mapped_bf16 = static_cast<const __nv_bfloat16*>(mapped_bf16_raw);
    // The device copy of the block (the device cache's source) only where it fits beside the
    // rest with room to spare.
    std::size_t free_bytes = 0, total_bytes = 0;
    LOCUS_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    const bool device_copy = block_floats * sizeof(float) < free_bytes / 2;
    DeviceBuffer<float> resident(device_copy ? block_floats : 0);
    if (device_copy) {
      LOCUS_CUDA_CHECK(cudaMemcpy(resident.data(), host.data(), block_floats * sizeof(float),
                                  cudaMemcpyHostToDevice));
    }
    DeviceBuffer<float> dst(static_cast<std::size_t>(max_batch) * width);
    DeviceBuffer<__nv_bfloat16> dst_bf16(static_cast<std::size_t>(max_batch) * width);
    DeviceBuffer<std::int64_t> index(static_cast<std::size_t>(max_batch));
    PinnedBuffer<float> pinned(static_cast<std::size_t>(max_batch) * width);
    std::memcpy(pinned.data(), host.data(), pinned.bytes());
    // The GEMM the gather runs beside: the first layer's forward pass, Z^T = W X^T.
    DeviceBuffer<float> weights(static_cast<std::size_t>(gemm_out) * width);
    DeviceBuffer<float> gemm_x(static_cast<std::size_t>(max_batch) * width);
    LOCUS_CUDA_CHECK(cudaMemset(gemm_x.data(), 0, gemm_x.bytes()));
    DeviceBuffer<float> z(static_cast<std::size_t>(gemm_out) * static_cast<std::size_t>(max_batch));
    LOCUS_CUDA_CHECK(cudaMemset(weights.data(), 0, weights.bytes()));
    Matmul matmul(train::Precision::fp32);
    matmul.set_measure(false);

    fmt::print("# locus_gather_bench: device {}; host block {} rows x {} floats ({:.0f} MB, "
               "page-locked, mapped); stream priorities {} (least) to {} (greatest)\n",
               fmt::format("0 {} ({} SMs)", prop.name, prop.multiProcessorCount), rows, cols,
               static_cast<double>(block_floats) * 4e-6, least, greatest);
    fmt::print("# GB/s of batch rows; GEMM loop: fp32 {} x batch x {} forward GEMMs, about "
               "{:.1f} ms; slowdown = the loop's time beside the gathers / alone - 1\n",
               gemm_out, cols, window_ms);
    fmt::print("{:>6} {:>6} {:>8} {:>8} {:>8} | {:>9} {:>9} | {:>9} {:>9} | {:>8} {:>7}\n",
               "batch", "cap", "link", "device", "alone", "beside", "slowdown", "prio",
               "slowdown", "bf16", "rows x");

    std::uniform_int_distribution<std::int64_t> pick(0, rows - 1);
    for (const int batch : batches) {
      std::vector<std::int64_t> idx(static_cast<std::size_t>(batch));
      for (auto& i : idx) i = pick(gen);
      LOCUS_CUDA_CHECK(cudaMemcpy(index.data(), idx.data(), idx.size() * sizeof(std::int64_t),
                                  cudaMemcpyHostToDevice));
      const double bytes = static_cast<double>(batch) * static_cast<double>(width) * 4.0;
      const auto gbs = [&](double ms) { return ms > 0 ? bytes / (ms * 1e6) : 0.0; };
      const Stream base = make_stream_with(least);
      const double link_ms = timed_short(base.get(), warmup, iters, [&] {
        LOCUS_CUDA_CHECK(cudaMemcpyAsync(dst.data(), pinned.data(), static_cast<std::size_t>(bytes),
                                         cudaMemcpyHostToDevice, base.get()));
      });
      const double device_ms = !device_copy ? 0.0 : timed_short(base.get(), warmup, iters, [&] {
        gather_rows(resident.data(), index.data(), dst.data(), batch, cols, nullptr, nullptr,
                    base.get());
      });
      const GemmShape shape{.m = gemm_out, .n = batch, .k = cols, .trans_a = true, .lda = cols,
                            .ldb = cols, .ldd = gemm_out};
      const auto gemm = [&](cudaStream_t s) {
        matmul.run(shape, weights.data(), gemm_x.data(), z.data(), s);
      };
      const double one_gemm_ms = timed_short(base.get(), warmup, iters, [&] { gemm(base.get()); });
      const int loop = std::max(1, static_cast<int>(window_ms / std::max(one_gemm_ms, 1e-3)));

      for (const int cap : caps) {
        const double alone_ms = timed_short(base.get(), warmup, iters, [&] {
          gather_rows(mapped, index.data(), dst.data(), batch, cols, nullptr, nullptr, base.get(),
                      cap);
        });
        // Every row arrived (the last run's output).
        LOCUS_CUDA_CHECK(cudaStreamSynchronize(base.get()));
        check_rows(host.data(), dst.data(), idx, width, batch, cap, "fp32");
        const double bf16_ms = timed_short(base.get(), warmup, iters, [&] {
          gather_bf16_rows(mapped_bf16, index.data(), dst_bf16.data(), batch, cols, base.get(),
                           cap);
        });
        LOCUS_CUDA_CHECK(cudaStreamSynchronize(base.get()));
        check_rows(reinterpret_cast<const std::uint16_t*>(host_bf16.data()),
                   reinterpret_cast<const std::uint16_t*>(dst_bf16.data()), idx, width, batch,
                   cap, "bf16");
        // Gathers for about 1.2 windows: the whole GEMM loop runs beside them.
        const int gathers =
            std::max(1, static_cast<int>(1.2 * window_ms / std::max(alone_ms, 1e-3)));
        // Both loops as graphs, one launch each, so that they start together and the host's
        // launch rate does not pace either.
        const GraphExec gemm_loop = capture(base.get(), [&] {
          for (int i = 0; i < loop; ++i) gemm(base.get());
        });
        const GraphExec gather_loop = capture(base.get(), [&] {
          for (int i = 0; i < gathers; ++i) {
            gather_rows(mapped, index.data(), dst.data(), batch, cols, nullptr, nullptr,
                        base.get(), cap);
          }
        });
        const auto beside = [&](int compute_priority) {
          // A graph's kernels run at the priority of the stream it is launched into.
          const Stream compute = make_stream_with(compute_priority), copy = make_stream_with(least);
          const Event start = make_event(), g0 = make_timing_event(), g1 = make_timing_event(),
                      c0 = make_timing_event(), c1 = make_timing_event();
          const double alone_loop = timed(compute.get(), warmup, iters, [&] {
            LOCUS_CUDA_CHECK(cudaGraphLaunch(gemm_loop.get(), compute.get()));
          });
          std::vector<double> gather_ms, loop_ms;
          for (int it = 0; it < warmup + iters; ++it) {
            LOCUS_CUDA_CHECK(cudaEventRecord(start.get(), compute.get()));
            LOCUS_CUDA_CHECK(cudaStreamWaitEvent(copy.get(), start.get(), 0));
            LOCUS_CUDA_CHECK(cudaEventRecord(g0.get(), copy.get()));
            LOCUS_CUDA_CHECK(cudaGraphLaunch(gather_loop.get(), copy.get()));
            LOCUS_CUDA_CHECK(cudaEventRecord(g1.get(), copy.get()));
            LOCUS_CUDA_CHECK(cudaEventRecord(c0.get(), compute.get()));
            LOCUS_CUDA_CHECK(cudaGraphLaunch(gemm_loop.get(), compute.get()));
            LOCUS_CUDA_CHECK(cudaEventRecord(c1.get(), compute.get()));
            LOCUS_CUDA_CHECK(cudaEventSynchronize(g1.get()));
            LOCUS_CUDA_CHECK(cudaEventSynchronize(c1.get()));
            float tg = 0, tc = 0;
            LOCUS_CUDA_CHECK(cudaEventElapsedTime(&tg, g0.get(), g1.get()));
            LOCUS_CUDA_CHECK(cudaEventElapsedTime(&tc, c0.get(), c1.get()));
            if (it >= warmup) {
              gather_ms.push_back(tg / gathers);
              loop_ms.push_back(tc);
            }
          }
          return Beside{gbs(median(gather_ms)), median(loop_ms) / alone_loop - 1.0};
        };
        const Beside same = beside(least), prio = beside(greatest);
        fmt::print("{:>6} {:>6} {:>8.1f} {:>8.1f} {:>8.1f} | {:>9.1f} {:>8.0f}% | {:>9.1f} "
                   "{:>8.0f}% | {:>8.1f} {:>7.2f}\n",
                   batch, cap == 0 ? std::string("none") : std::to_string(cap), gbs(link_ms),
                   gbs(device_ms), gbs(alone_ms), same.gather_gbs, same.gemm_slowdown * 100,
                   prio.gather_gbs, prio.gemm_slowdown * 100, gbs(bf16_ms) / 2,
                   bf16_ms > 0 ? alone_ms / bf16_ms : 0.0);
      }
    }
    LOCUS_CUDA_CHECK(cudaHostUnregister(host.data()));
    return 0;
  } catch (const Error& e) {
    fmt::print(stderr, "locus_gather_bench: {}\n", e.what());
    return exit_code_for(e.kind());
  } catch (const std::exception& e) {  // e.g. the host block's allocation
    fmt::print(stderr, "locus_gather_bench: {}\n", e.what());
    return 1;
  }
}
