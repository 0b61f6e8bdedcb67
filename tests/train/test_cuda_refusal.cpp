// Where the cuda backend cannot run (a build without CUDA or a host without a device, like
// the CI machines), train.backend = cuda is a ConfigError agreed on every rank (exit 2) that
// names what is available (skipped where a device exists), with or without pipeline stages and
// micro-batches (which the cuda backend runs where it can); the GPU-only
// loader.device_cache_mb, loader.gather = device, train.device and train.precision = tf32 or
// bf16 are refused for the cpu backend everywhere, and the GPU-only switches it would ignore
// are named.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "agreed_error.hpp"
#include "locus/train/compute.hpp"
#include "test_trainer_util.hpp"

namespace locus::train::test {
namespace {

std::optional<std::string> no_device() {
  ComputeOptions c;
  c.backend = "cuda";
  try {
    validate(c);
    return std::nullopt;
  } catch (const ConfigError& e) {
    return std::string(e.what());
  }
}

// Run where the backend cannot: an agreed ConfigError naming what is available (exit 2).
TrainOptions cuda_options(const Data& d) {
  TrainOptions o = small_options(d);
  o.compute.backend = "cuda";
  return o;
}

TEST(CudaRefusal, BackendCudaWithoutADeviceIsAnAgreedConfigError) {
  const auto why = no_device();
  if (!why) GTEST_SKIP() << "this host has a CUDA device";
  EXPECT_NE(why->find("available: cpu"), std::string::npos) << *why;
  const mpi::Comm world = mpi::Comm::world();
  Data d(world);
  const Grid grid(world, 1);
  const std::string message =
      locus::test::agreed_error<ConfigError>([&] { Trainer t(grid, cuda_options(d)); });
  EXPECT_NE(message.find("train.backend = cuda"), std::string::npos) << message;
  EXPECT_NE(message.find("available: cpu"), std::string::npos) << message;
}

// Pipeline stages (at 2 ranks) or micro-batches run on the cuda backend where it can run: here
// the refusal is the backend's (no device, or no CUDA in this build), not the pipeline's.
TEST(CudaRefusal, PipelineOnBackendCudaWithoutADeviceIsTheBackendsAgreedConfigError) {
  const auto why = no_device();
  if (!why) GTEST_SKIP() << "this host has a CUDA device";
  const mpi::Comm world = mpi::Comm::world();
  Data d(world);
  TrainOptions o = cuda_options(d);
  o.model.widths = {kFeatures, 24, 16, kClasses};
  o.pipeline_stages = world.size() == 2 ? 2 : 1;
  o.micro_batches = 3;
  const Grid grid(world, o.pipeline_stages);
  const std::string message =
      locus::test::agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(message.find("train.backend = cuda"), std::string::npos) << message;
  EXPECT_NE(message.find("available: cpu"), std::string::npos) << message;
  EXPECT_EQ(message.find("pipeline"), std::string::npos) << message;
}

// Reduced precision is the GPU's: the cpu backend computes in fp32, so tf32 and bf16 asked of
// it are refused on every rank (exit 2), naming the key and both ways out (runs on every host).
TEST(CudaRefusal, ReducedPrecisionNeedsTheCudaBackend) {
  const mpi::Comm world = mpi::Comm::world();
  Data d(world);
  const Grid grid(world, 1);
  for (const Precision p : {Precision::tf32, Precision::bf16}) {
    TrainOptions o = small_options(d);
    o.compute.precision = p;
    const std::string message =
        locus::test::agreed_error<ConfigError>([&] { Trainer t(grid, o); });
    EXPECT_NE(message.find(fmt::format("train.precision = {} needs a GPU backend",
                                       to_string(p))),
              std::string::npos) << message;
    EXPECT_NE(message.find("set train.precision = fp32, or train.backend = cuda"),
              std::string::npos) << message;
  }
}

// The device cache is a GPU feature: asked of the cpu backend it is refused before any data
// is read, on every rank, naming the key and both ways out (runs on every host).
TEST(CudaRefusal, DeviceCacheNeedsTheCudaBackend) {
  const mpi::Comm world = mpi::Comm::world();
  Data d(world);
  const Grid grid(world, 1);
  TrainOptions o = small_options(d);
  o.device_cache_bytes = std::uint64_t{64} << 20;
  const std::string message =
      locus::test::agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(message.find("loader.device_cache_mb = 64"), std::string::npos) << message;
  EXPECT_NE(message.find("train.backend = cpu"), std::string::npos) << message;
  EXPECT_NE(message.find("set train.backend = cuda"), std::string::npos) << message;
}

// loader.gather = device alike: a GPU feature, refused on the cpu backend; and beside the
// device cache (both would feed the batches) it is refused first, on any backend and host,
// naming both keys.
TEST(CudaRefusal, DeviceGatherNeedsTheCudaBackendAndNoCache) {
  const mpi::Comm world = mpi::Comm::world();
  Data d(world);
  const Grid grid(world, 1);
  TrainOptions o = small_options(d);
  o.device_gather = true;
  const std::string cpu = locus::test::agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(cpu.find("loader.gather = device gathers batches on the GPU, but train.backend = "
                     "cpu: set loader.gather = host, or train.backend = cuda"),
            std::string::npos)
      << cpu;
  o.device_cache_bytes = std::uint64_t{64} << 20;
  const std::string both = locus::test::agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(both.find("loader.gather = device reads the samples from host memory, "
                      "loader.device_cache_mb = 64 copies them to the GPU: choose one"),
            std::string::npos)
      << both;
}

// A GPU index asks for a GPU: on the cpu backend it is refused before any data is read, on
// every rank, naming the key, the value and both ways out.
TEST(CudaRefusal, DeviceIndexNeedsTheCudaBackend) {
  const mpi::Comm world = mpi::Comm::world();
  Data d(world);
  const Grid grid(world, 1);
  TrainOptions o = small_options(d);
  o.compute.device = 0;
  const std::string message =
      locus::test::agreed_error<ConfigError>([&] { Trainer t(grid, o); });
  EXPECT_NE(message.find("train.device = 0 picks a GPU, but train.backend = cpu computes on the "
                         "host (set train.backend = cuda, or train.device = -1)"),
            std::string::npos)
      << message;
}

// Switches that change nothing on the cpu backend are named, each by key and value, only where
// set away from their defaults, and never on the cuda backend (which uses them); the BLAS
// threads, which only the cpu backend uses, are named on cuda.
TEST(CudaRefusal, GpuOnlySwitchesTheCpuBackendIgnoresAreNamed) {
  const mpi::Comm world = mpi::Comm::world();
  Data d(world);
  TrainOptions o = small_options(d);
  EXPECT_TRUE(unused_settings(o).empty());
  o.compute.graphs = false;
  o.compute.measure_gemms = false;
  o.reducer.timeout_s = 5;
  const std::vector<std::string> notes = unused_settings(o);
  ASSERT_EQ(notes.size(), 3u);
  EXPECT_EQ(notes[0], "train.graphs = false applies to train.backend = cuda only: the cpu "
                      "backend ignores it");
  EXPECT_EQ(notes[1], "train.gemm_select = heuristic applies to train.backend = cuda only: the "
                      "cpu backend ignores it");
  EXPECT_EQ(notes[2], "train.reducer_timeout_s = 5 applies to train.backend = cuda only: the "
                      "cpu backend ignores it (train.watchdog_s bounds its MPI waits)");
  o.compute.backend = "cuda";
  EXPECT_TRUE(unused_settings(o).empty());
  // The other way round: the host's BLAS threads, which the cuda backend does not use.
  o.threads = 4;
  const std::vector<std::string> cuda = unused_settings(o);
  ASSERT_EQ(cuda.size(), 1u);
  EXPECT_EQ(cuda[0], "train.threads = 4 sets the host BLAS's threads, which train.backend = "
                     "cuda does not use: it computes on the GPU");
}

}  // namespace
}  // namespace locus::train::test
