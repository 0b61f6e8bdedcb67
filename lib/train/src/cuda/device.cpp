// Device selection: one GPU per rank, by node-local rank, and the descriptions messages use.
#include "cuda/device.hpp"

#include <fmt/format.h>

#include <cstdlib>

#include "cuda/cuda_check.hpp"
#include "cuda/cuda_compute.hpp"
#include "cuda/matmul.hpp"

namespace locus::train::cuda {

namespace {

// Visible devices, or the reason there are none.
int device_count(std::string& why) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess) {
    cudaGetLastError();
    why = fmt::format("{} ({})", cudaGetErrorName(rc), cudaGetErrorString(rc));
    return 0;
  }
  if (count == 0) why = "no CUDA device is visible (CUDA_VISIBLE_DEVICES?)";
  return count;
}

DeviceInfo info_of(int index) {
  cudaDeviceProp p{};
  LOCUS_CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  DeviceInfo d;
  d.index = index;
  d.name = p.name;
  d.memory_gib = static_cast<double>(p.totalGlobalMem) / static_cast<double>(1ull << 30);
  d.major = p.major;
  d.minor = p.minor;
  d.multiprocessors = p.multiProcessorCount;
  LOCUS_CUDA_CHECK(cudaRuntimeGetVersion(&d.runtime_version));
  LOCUS_CUDA_CHECK(cudaDriverGetVersion(&d.driver_version));
  return d;
}

}  // namespace

std::string visibility_note() {
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  std::string note = visible != nullptr ? fmt::format("CUDA_VISIBLE_DEVICES={}", visible)
                                        : std::string("CUDA_VISIBLE_DEVICES unset");
  // Under Slurm, what the job (or this step) was given: GPUs granted but not visible to CUDA
  // point at the node (driver, device files), not at the request.
  for (const char* var : {"SLURM_STEP_GPUS", "SLURM_JOB_GPUS"}) {
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') {
      note += fmt::format("; Slurm's {}={}", var, v);
      break;
    }
  }
  return note;
}

int device_count() noexcept {
  std::string why;
  return device_count(why);
}

std::string DeviceInfo::describe() const {
  return fmt::format("device {} {} ({:.1f} GiB, cc {}.{}, {} SMs)", index, name, memory_gib,
                     major, minor, multiprocessors);
}

std::string describe_backend(Precision precision, const DeviceInfo& d) {
  return fmt::format("cuda {} on {} ({:.1f} GiB, cc {}.{}), CUDA runtime {}, driver {}, {}",
                     to_string(precision), d.name, d.memory_gib, d.major, d.minor,
                     d.runtime_version, d.driver_version, Matmul::version());
}

std::string describe_devices() {
  std::string why;
  const int count = device_count(why);
  if (count == 0) return fmt::format("no usable CUDA device: {} ({})", why, visibility_note());
  std::string text = fmt::format("{} device{}:", count, count == 1 ? "" : "s");
  for (int i = 0; i < count; ++i) text += fmt::format(" {}", info_of(i).describe());
  return text;
}

DeviceInfo select_device(const mpi::Comm& world, int requested, std::string_view section) {
  MPI_Comm node = MPI_COMM_NULL;
  LOCUS_MPI_CHECK(MPI_Comm_split_type(world.get(), MPI_COMM_TYPE_SHARED, world.rank(),
                                      MPI_INFO_NULL, &node));
  int local_rank = 0;
  const int rc = MPI_Comm_rank(node, &local_rank);
  MPI_Comm_free(&node);
  LOCUS_MPI_CHECK(rc);

  std::string why;
  const int count = device_count(why);
  if (count == 0) {
    throw ConfigError(fmt::format("{0}.backend = cuda, but host {1} has no usable GPU: {2} "
                                  "({3}). Available here: cpu (set {0}.backend = cpu), or run "
                                  "on a GPU node",
                                  section, mpi::hostname(), why, visibility_note()));
  }
  if (requested >= count) {
    throw ConfigError(fmt::format("{0}.device = {1}, but host {2} has {3} visible device{4} "
                                  "(0..{5}; {6}): set {0}.device = -1 (node-local rank modulo "
                                  "the devices) or a valid index",
                                  section, requested, mpi::hostname(), count,
                                  count == 1 ? "" : "s", count - 1, visibility_note()));
  }
  const int index = requested >= 0 ? requested : local_rank % count;
  LOCUS_CUDA_CHECK(cudaSetDevice(index));
  return info_of(index);
}

}  // namespace locus::train::cuda
