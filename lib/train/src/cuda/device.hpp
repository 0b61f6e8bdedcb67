// Private to the CUDA backend: which GPU a rank uses and how it is described.
#pragma once

#include <string>
#include <string_view>

#include "locus/comm/mpi.hpp"
#include "locus/train/compute.hpp"

namespace locus::train::cuda {

struct DeviceInfo {
  int index = -1;
  std::string name;
  double memory_gib = 0;
  int major = 0, minor = 0;  // compute capability
  int multiprocessors = 0;
  int runtime_version = 0, driver_version = 0;
  // "device 0 NVIDIA H100 80GB HBM3 (79.1 GiB, cc 9.0, 132 SMs)"
  std::string describe() const;
};

// What computes, for the start-up line and checkpoint provenance (Compute::describe): "cuda
// fp32 on NVIDIA H100 80GB HBM3 (79.1 GiB, cc 9.0), CUDA runtime 13000, driver 13000, cuBLASLt
// 130000".
std::string describe_backend(Precision precision, const DeviceInfo& device);

// What decides which devices this process sees, for messages: "CUDA_VISIBLE_DEVICES=0,1;
// Slurm's SLURM_JOB_GPUS=0,1" (the Slurm part only inside a job given GPUs).
std::string visibility_note();

// Collective over world: the node-local rank (MPI_Comm_split_type SHARED) modulo the visible
// devices, or `requested` when >= 0; made current with cudaSetDevice. ConfigError (not agreed
// here) when the host has no usable device or `requested` is out of range, naming the keys of
// `section` ("train": train.backend, train.device; "infer": infer.backend, infer.device).
DeviceInfo select_device(const mpi::Comm& world, int requested,
                         std::string_view section = "train");

}  // namespace locus::train::cuda
