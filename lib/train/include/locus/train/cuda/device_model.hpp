// The forward pass of an MLP on a GPU, for inference: the parameters uploaded once, then per
// batch one cuBLASLt GEMM and one fused bias/activation kernel per layer -- the training
// backend's kernels, GEMM shapes and precision choices, without its gradients, optimizer or
// loss. Only in builds with LOCUS_WITH_CUDA (include it from code compiled only there).
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>
#include <string_view>

#include "locus/comm/mpi.hpp"
#include "locus/train/model/model.hpp"
#include "locus/train/model/precision.hpp"

namespace locus::train::cuda {

// Usable devices on this host (0 when the driver or the devices are missing), and their
// description or why there are none ("no device on this host: cudaErrorNoDevice (...)").
int device_count() noexcept;
std::string describe_devices();

// Collective over world: picks this rank's GPU -- the node-local rank (MPI_Comm_split_type
// SHARED) modulo the visible devices, or `requested` when >= 0 -- makes it current on the
// calling thread (a thread that uses it later calls cudaSetDevice(index) itself) and loads
// cuBLASLt (CublasError when it cannot), so that the device is ready to use. ConfigError
// (not agreed) naming <section>.backend / <section>.device when the host has no usable device
// or `requested` is out of range.
struct SelectedDevice {
  int index = -1;
  std::string name;         // "NVIDIA H100 80GB HBM3"
  std::string description;  // "device 0 NVIDIA H100 80GB HBM3 (79.1 GiB, cc 9.0, 132 SMs)"
};
SelectedDevice use_device(const mpi::Comm& world, int requested, std::string_view section);

class DeviceModel {
 public:
  // Uploads the whole model's parameters (one buffer in the host layout, as the training
  // backend keeps them; a bf16 copy too for bf16) to the current device and sizes the
  // activations for batches of up to max_rows rows. The host model may go away afterwards.
  DeviceModel(const Mlp& model, Precision precision, int max_rows);
  ~DeviceModel();
  DeviceModel(const DeviceModel&) = delete;
  DeviceModel& operator=(const DeviceModel&) = delete;

  // Enqueues the forward pass of `rows` rows of x (device memory, [rows, inputs] float32) on
  // stream and returns their logits [rows, outputs]: device memory owned by this object, valid
  // until the next forward() (call it from one stream, or order the streams). Each GEMM's
  // algorithm is chosen once per shape and pointer alignment (the first call of a shape is not
  // capturable into a CUDA graph); the same rows, shape and alignment give the same bits.
  const float* forward(const float* x, int rows, cudaStream_t stream);

  int inputs() const noexcept;
  int outputs() const noexcept;
  int max_rows() const noexcept;
  Precision precision() const noexcept;
  // "fp32, cuBLASLt 130000"
  std::string describe() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace locus::train::cuda
