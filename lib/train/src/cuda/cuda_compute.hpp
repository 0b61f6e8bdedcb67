// Private to lib/train: the CUDA backend's entry points for the factories in compute.cpp.
#pragma once

#include <memory>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/comm/reducer.hpp"
#include "locus/train/compute.hpp"

namespace locus::train::cuda {

// "1 device: 0 NVIDIA H100 80GB HBM3 (79.1 GiB, cc 9.0)", or why there is none
// ("no device: cudaErrorNoDevice (no CUDA-capable device is detected)").
std::string describe_devices();
// Usable devices on this host (0 when the driver or the devices are missing).
int device_count() noexcept;

// Collective over world (the node-local split that picks the device). ConfigError when this
// host has no usable device or options.device is out of range, naming what there is.
std::unique_ptr<Compute> make_cuda_compute(const ComputeOptions& options, const mpi::Comm& world,
                                           TrainState& state, Loss loss);

// The gradient reducer for a device buffer: device -> pinned host -> the MPI reducer -> back,
// ordered on grads.stream with events. Collective over dp.
std::unique_ptr<comm::GradientReducer> make_staged_reducer(const comm::GradientBuffer& grads,
                                                           const mpi::Comm& dp,
                                                           const comm::ReducerOptions& options);

}  // namespace locus::train::cuda
