// Private to lib/comm: the NCCL gradient reducer's entry points (nccl_reducer.cpp, built only
// with LOCUS_WITH_NCCL); reducer.cpp's factories call them.
#pragma once

#include <memory>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/comm/reducer.hpp"

namespace locus::comm::detail {

// Collective over comm: why the ranks' current CUDA devices cannot form one NCCL communicator
// (two ranks on one GPU, a rank without a device), or "" when they can.
std::string duplicate_device_reason(const mpi::Comm& comm);

// Collective over comm (its own duplicate, taken over): the reducer; options were validated
// and agreed, grads is a device buffer with its producer stream.
std::unique_ptr<GradientReducer> make_nccl(mpi::Comm comm, const GradientBuffer& grads,
                                           const ReducerOptions& options);

// "NCCL 2.28.9" (the library loaded at run time).
std::string nccl_version();

}  // namespace locus::comm::detail
