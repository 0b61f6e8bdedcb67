// infer.backend / infer.precision / infer.device where they cannot run (runs on every host):
// cuda in a build without CUDA, or on a host without a usable GPU (this project's CI machines:
// the CUDA runtime is there, the driver and the device are not), is a ConfigError agreed on
// every rank (locus-infer: exit 2) that names the key and what is available, raised before the
// model or the input is read, and nothing is published (cuda: skipped where a GPU can run it
// -- tests/infer/gpu covers that); infer.device on the cpu backend alike, everywhere.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <string>
#include <vector>

#include "agreed_error.hpp"
#include "locus/config.hpp"
#include "locus/infer/infer.hpp"
#include "shared_tmpdir.hpp"
#if LOCUS_WITH_CUDA
#include "locus/train/cuda/device_model.hpp"
#endif

using namespace locus;

namespace {

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Options that would fail on the model or input if the backend check came later: neither file
// exists, so only an error raised before they are read can name the backend.
infer::InferOptions options(const test::SharedTmpDir& dir) {
  infer::InferOptions o;
  o.model = dir.file("no-model.h5");
  o.input = dir.file("no-input.h5");
  o.output = dir.file("out.h5");
  return o;
}

}  // namespace

TEST(InferBackend, CudaWhereItCannotRunIsAnAgreedConfigError) {
  const mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  infer::InferOptions o = options(dir);
  o.backend = "cuda";
#if LOCUS_WITH_CUDA
  if (train::cuda::device_count() > 0) {
    GTEST_SKIP() << "this host has a GPU: " << train::cuda::describe_devices();
  }
  const std::string why = "has no usable GPU";
#else
  const std::string why = "this build of locus has no CUDA backend";
#endif
  const std::string message =
      test::agreed_error<ConfigError>([&] { infer::run_inference(world, o); });
  EXPECT_NE(message.find("infer.backend = cuda"), std::string::npos) << message;
  EXPECT_NE(message.find(why), std::string::npos) << message;
  EXPECT_NE(message.find("set infer.backend = cpu"), std::string::npos) << message;
  EXPECT_FALSE(exists(o.output)) << "nothing may be published";
}

TEST(InferBackend, BadPrecisionOrBackendIsAnAgreedConfigError) {
  const mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  infer::InferOptions o = options(dir);
  o.precision = "bf16";  // the cpu computes in fp32 only
  std::string message = test::agreed_error<ConfigError>([&] { infer::run_inference(world, o); });
  EXPECT_NE(message.find("infer.precision = bf16"), std::string::npos) << message;
  EXPECT_NE(message.find("set infer.precision = fp32"), std::string::npos) << message;
  o.precision = "fp16";
  message = test::agreed_error<ConfigError>([&] { infer::run_inference(world, o); });
  EXPECT_NE(message.find("infer.precision = 'fp16' is unknown"), std::string::npos) << message;
  o.precision = "fp32";
  o.backend = "tpu";
  message = test::agreed_error<ConfigError>([&] { infer::run_inference(world, o); });
  EXPECT_NE(message.find("infer.backend = 'tpu' is unknown"), std::string::npos) << message;
  EXPECT_FALSE(exists(o.output));
}

// infer.blas_threads sets the host BLAS, which only the cpu engine uses: named on cuda (not
// refused: a config shared by CPU and GPU runs keeps it), silent at its default and on cpu.
TEST(InferBackend, BlasThreadsOnTheCudaBackendIsNamedAsUnused) {
  infer::InferOptions o;
  EXPECT_TRUE(infer::unused_settings(o).empty());
  o.blas_threads = 4;
  EXPECT_TRUE(infer::unused_settings(o).empty()) << "the cpu engine uses it";
  o.backend = "cuda";
  EXPECT_EQ(infer::unused_settings(o),
            std::vector<std::string>{"infer.blas_threads = 4 sets the host BLAS's threads, which "
                                     "infer.backend = cuda does not use: it scores on the GPU"});
  o.blas_threads = 1;
  EXPECT_TRUE(infer::unused_settings(o).empty());
}

// A GPU index asks for a GPU: on the cpu backend it is refused before the model or the input is
// read, on every rank, naming the key, the value and both ways out.
TEST(InferBackend, DeviceIndexOnTheCpuBackendIsAnAgreedConfigError) {
  const mpi::Comm world = mpi::Comm::world();
  test::SharedTmpDir dir(world);
  infer::InferOptions o = options(dir);
  o.device = 1;
  const std::string message =
      test::agreed_error<ConfigError>([&] { infer::run_inference(world, o); });
  EXPECT_NE(message.find("infer.device = 1 picks a GPU, but infer.backend = cpu computes on the "
                         "host (set infer.backend = cuda, or infer.device = -1)"),
            std::string::npos)
      << message;
  EXPECT_FALSE(exists(o.output)) << "nothing may be published";
}
