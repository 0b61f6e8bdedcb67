// nccl-tests-style benchmark of the NCCL gradient reducer (lib/comm/src/nccl_reducer.cpp) on one
// device per rank, sizes doubling from 4 KiB to 256 MiB, beside:
//   plain   one ncclAllReduce(sum) of the whole buffer on a stream, the floor of the reducer;
//   reducer the locus reducer's step (ready_from per bucket from the end, finish), timed from
//           the producer stream's point of view (events), the way the training step sees it;
//   bf16    the same step at train.reducer_precision = bf16 (each bucket rounded to bf16,
//           summed in bf16, widened back: half the bytes between GPUs, two more passes over
//           the buffer on the device); bf16_off counts results outside the bf16 band of the
//           plain fp32 sum (each input rounded once, each of the ring's n-1 partial sums once);
//   staged  device -> pinned host -> device copies of the buffer, what the host-staged MPI
//           reducer moves per step besides the MPI all-reduce itself (GB/s of the round trip);
//   host    the host's time to enqueue: one plain ncclAllReduce (a blocking communicator),
//           and the reducer's step (its communicator is non-blocking: from 2 ranks on, NCCL
//           enqueues each call on a thread it starts, and the reducer waits for that).
// Median over timed iterations after warm-up; algbw = bytes / time, busbw = algbw * 2(n-1)/n
// (of the fp32 reducer);
// the reducer's results are checked every iteration against the plain all-reduce's. At world
// size 1 NCCL copies nothing: the figures are the machinery's overhead (launches, events).
// Run: mpirun -n <GPUs> locus_nccl_reducer_bench   (one rank per GPU; ranks sharing a GPU
// are refused by NCCL, and the bench says so).
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
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

using Clock = std::chrono::steady_clock;

void cu(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) throw CudaError(fmt::format("{}: {}", what, cudaGetErrorString(rc)));
}
void nc(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess) throw NcclError(fmt::format("{}: {}", what, ncclGetErrorString(rc)));
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Milliseconds of `enqueue`'s work on stream s, by events, once per iteration.
template <class F>
std::vector<double> timed(cudaStream_t s, int warmup, int iters, F&& enqueue) {
  cudaEvent_t a, b;
  cu(cudaEventCreate(&a), "cudaEventCreate");
  cu(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<double> ms;
  for (int i = 0; i < warmup + iters; ++i) {
    cu(cudaEventRecord(a, s), "cudaEventRecord");
    enqueue();
    cu(cudaEventRecord(b, s), "cudaEventRecord");
    cu(cudaEventSynchronize(b), "cudaEventSynchronize");
    float t = 0;
    cu(cudaEventElapsedTime(&t, a, b), "cudaEventElapsedTime");
    if (i >= warmup) ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

int run_bench(mpi::Comm& world, int argc, char** argv) {
  std::size_t min_bytes = 4096, max_bytes = std::size_t{256} << 20, bucket = std::size_t{4} << 20;
  int iters = 20, warmup = 5;
  po::options_description desc("locus_nccl_reducer_bench options");
  desc.add_options()("help", "this help")(
      "min-bytes", po::value(&min_bytes)->default_value(min_bytes), "smallest buffer")(
      "max-bytes", po::value(&max_bytes)->default_value(max_bytes), "largest buffer")(
      "bucket-bytes", po::value(&bucket)->default_value(bucket), "the reducer's bucket")(
      "iters", po::value(&iters)->default_value(iters), "timed iterations per size")(
      "warmup", po::value(&warmup)->default_value(warmup), "untimed iterations first");
  po::variables_map vm;
  if (bench::parse_command_line(desc, argc, argv, "locus_nccl_reducer_bench", vm)) return 0;

  int devices = 0;
  cu(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  cu(cudaSetDevice(world.rank() % devices), "cudaSetDevice");
  float* d = nullptr;
  float* ref = nullptr;
  float* pinned = nullptr;
  const std::size_t max_n = max_bytes / sizeof(float);
  cu(cudaMalloc(&d, max_bytes), "cudaMalloc");
  cu(cudaMalloc(&ref, max_bytes), "cudaMalloc");
  cu(cudaMallocHost(&pinned, max_bytes), "cudaMallocHost");
  cudaStream_t s;
  cu(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  std::vector<float> host(max_n);
  for (std::size_t i = 0; i < max_n; ++i) {
    const std::size_t v = (i * 7 + static_cast<std::size_t>(world.rank()) * 3) % 1024;
    host[i] = static_cast<float>(v) / 256.0f;
  }

  // The plain NCCL communicator (blocking) for the floor.
  ncclUniqueId id{};
  if (world.is_root()) nc(ncclGetUniqueId(&id), "ncclGetUniqueId");
  world.bcast(std::span<char>(id.internal, sizeof(id.internal)), 0);
  ncclComm_t plain = nullptr;
  nc(ncclCommInitRank(&plain, world.size(), id, world.rank()), "ncclCommInitRank");

  comm::ReducerOptions ro;
  ro.backend = comm::ReducerBackend::nccl;
  ro.mode = comm::ReduceMode::presummed_average;
  ro.bucket_bytes = bucket;
  const int n = world.size();
  if (world.is_root()) {
    fmt::print("# locus_nccl_reducer_bench: {} rank(s), {}, bucket {} KiB, {} iters (median), "
               "load {:.2f}\n",
               n, comm::nccl_version(), bucket >> 10, iters, bench::loadavg());
    fmt::print("{:>12} {:>10} {:>10} {:>9} {:>9} {:>9} {:>11} {:>7} {:>13} {:>15} {:>9} {:>9}\n",
               "bytes", "plain_us", "reducer_us", "overhead", "algbw", "busbw", "staged_GB/s",
               "errors", "host_plain_us", "host_reducer_us", "bf16_us", "bf16_off");
  }
  std::int64_t errors_total = 0;
  for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
    const std::size_t count = bytes / sizeof(float);
    const comm::GradientBuffer g{d, count, comm::MemorySpace::cuda, s};
    auto reducer = comm::make_nccl_reducer(world, g, ro);
    // Host enqueue times (the call's return, before timed() waits for the device), after the
    // warm-up calls: the first ones set up NCCL's connections.
    const auto us_since = [](Clock::time_point t0) {
      return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    };
    std::vector<double> plain_host_us, red_host_us;
    int plain_calls = 0;
    const auto plain_ms = timed(s, warmup, iters, [&] {
      const auto t0 = Clock::now();
      nc(ncclAllReduce(d, ref, count, ncclFloat32, ncclSum, plain, s), "ncclAllReduce");
      if (plain_calls++ >= warmup) plain_host_us.push_back(us_since(t0));
    });
    std::memcpy(pinned, host.data(), bytes);
    cu(cudaMemcpy(d, pinned, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
    nc(ncclAllReduce(d, ref, count, ncclFloat32, ncclSum, plain, s), "ncclAllReduce");
    cu(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    std::int64_t errors = 0;
    std::vector<float> want(count), got(count);
    cu(cudaMemcpy(want.data(), ref, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
    // One reducer step per iteration on fresh inputs, `check`ed after each.
    const auto steps = [&](comm::GradientReducer& red, std::vector<double>& ms_out,
                           std::vector<double>* host_out, const auto& check) {
      for (int i = 0; i < warmup + iters; ++i) {
        cu(cudaMemcpyAsync(d, pinned, bytes, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
        double host_us = 0;
        const auto ms = timed(s, 0, 1, [&] {
          const auto t0 = Clock::now();
          for (std::size_t off = count; off > 0;) {  // buckets become ready from the end
            off = off > count / 4 ? off - count / 4 : 0;
            red.ready_from(off);
          }
          red.finish();
          host_us = us_since(t0);
        });
        if (i >= warmup) {
          ms_out.push_back(ms[0]);
          if (host_out != nullptr) host_out->push_back(host_us);
        }
        cu(cudaMemcpy(got.data(), d, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy");
        check();
      }
    };
    std::vector<double> red_ms, bf16_ms;
    steps(*reducer, red_ms, &red_host_us,
          [&] { errors += std::memcmp(got.data(), want.data(), bytes) != 0 ? 1 : 0; });
    reducer.reset();
    comm::ReducerOptions bo = ro;
    bo.precision = comm::ReducePrecision::bf16;
    auto bf16_reducer = comm::make_nccl_reducer(world, g, bo);
    std::int64_t bf16_off = 0;
    steps(*bf16_reducer, bf16_ms, nullptr, [&] {
      for (std::size_t i = 0; i < count; ++i) {
        const float tol = static_cast<float>(n) * std::abs(want[i]) / 128.0f + 1e-6f;
        bf16_off += !(std::abs(got[i] - want[i]) <= tol) ? 1 : 0;
      }
    });
    bf16_reducer.reset();
    const auto staged_ms = timed(s, warmup, iters, [&] {
      cu(cudaMemcpyAsync(pinned, d, bytes, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
      cu(cudaMemcpyAsync(d, pinned, bytes, cudaMemcpyHostToDevice, s), "cudaMemcpyAsync");
    });
    errors = world.allreduce<std::int64_t>(errors, MPI_SUM);
    bf16_off = world.allreduce<std::int64_t>(bf16_off, MPI_SUM);
    errors_total += errors + bf16_off;
    const double p = median(plain_ms), r = median(red_ms), st = median(staged_ms);
    const double algbw = static_cast<double>(bytes) / (r * 1e-3) / 1e9;
    if (world.is_root()) {
      fmt::print("{:>12} {:>10.1f} {:>10.1f} {:>8.0f}% {:>9.2f} {:>9.2f} {:>11.2f} {:>7} {:>13.1f} "
                 "{:>15.1f} {:>9.1f} {:>9}\n",
                 bytes, p * 1e3, r * 1e3, p > 0 ? (r / p - 1.0) * 100.0 : 0.0, algbw,
                 algbw * 2.0 * (n - 1) / n, 2.0 * static_cast<double>(bytes) / (st * 1e-3) / 1e9,
                 errors, median(plain_host_us), median(red_host_us), median(bf16_ms) * 1e3,
                 bf16_off);
    }
  }
  ncclCommDestroy(plain);
  cudaStreamDestroy(s);
  cudaFreeHost(pinned);
  cudaFree(ref);
  cudaFree(d);
  return errors_total == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  // Each row as it is measured, even where a time limit ends the run.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  return run_app(argc, argv, [&](mpi::Comm& world) { return run_bench(world, argc, argv); });
}
