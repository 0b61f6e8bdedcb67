// Private to lib/train: the CUDA backend's entry points for the factories in compute.cpp.
#pragma once

#include <memory>
#include <string>

#include "layer_ops.hpp"
#include "locus/comm/link.hpp"
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

// Collective over world (the node-local split that picks the device): the CUDA layer
// operations on the held layers of `state` (a pipeline stage's), its parameters and optimizer
// state loaded onto the device. ConfigError as make_cuda_compute.
std::unique_ptr<detail::LayerOps> make_cuda_layer_ops(const ComputeOptions& options,
                                                      const mpi::Comm& world, TrainState& state);

// Collective over comm (duplicated): the stage link for device buffers, host-staged: device ->
// pinned host -> the MPI link -> device, ordered on each buffer's stream with events.
std::unique_ptr<comm::StageLink> make_staged_link(const mpi::Comm& comm);

// The gradient reducer for a device buffer: device -> pinned host -> the MPI reducer -> back,
// ordered on grads.stream with events. Collective over dp.
std::unique_ptr<comm::GradientReducer> make_staged_reducer(const comm::GradientBuffer& grads,
                                                           const mpi::Comm& dp,
                                                           const comm::ReducerOptions& options);

}  // namespace locus::train::cuda
