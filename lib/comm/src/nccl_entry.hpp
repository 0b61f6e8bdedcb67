// Private to lib/comm: the entry points of the NCCL code (nccl_comm.cpp, nccl_reducer.cpp,
// nccl_link.cpp, built only with LOCUS_WITH_NCCL) that the factories in reducer.cpp and
// link.cpp call. Free of CUDA and NCCL headers, so those files build without them.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "locus/comm/link.hpp"
#include "locus/comm/mpi.hpp"
#include "locus/comm/reducer.hpp"

namespace locus::comm::detail {

// Collective over comm: why the ranks' current CUDA devices cannot form one NCCL communicator
// (two ranks on one GPU, a rank without a device), or "" when they can. `role` names the
// ranks in the reason ("data-parallel", "pipeline").
std::string duplicate_device_reason(const mpi::Comm& comm, std::string_view role);

// Collective over comm (its own duplicate, taken over): the reducer; options were validated
// and agreed, grads is a device buffer with its producer stream.
std::unique_ptr<GradientReducer> make_nccl(mpi::Comm comm, const GradientBuffer& grads,
                                           const ReducerOptions& options);

// Collective over comm (its NCCL communicators are made over comm's ranks; comm itself is not
// kept): the stage link; the options were validated and agreed and the devices checked.
std::unique_ptr<StageLink> make_nccl_link(const mpi::Comm& comm, std::span<const int> tags,
                                          const LinkOptions& options);

// "NCCL 2.28.9" (the library loaded at run time).
std::string nccl_version();

}  // namespace locus::comm::detail
