// Private to lib/comm: the NCCL stage link's entry points (nccl_link.cpp, built only with
// LOCUS_WITH_NCCL); link.cpp's factories call them.
#pragma once

#include <memory>
#include <span>
#include <string>

#include "locus/comm/link.hpp"
#include "locus/comm/mpi.hpp"

namespace locus::comm::detail {

// Collective over comm: why the pipeline's ranks cannot form one NCCL communicator, or "".
std::string pipeline_device_reason(const mpi::Comm& comm);

// Collective over comm (its NCCL communicators are made over comm's ranks; comm itself is not
// kept): the link; the options were validated and agreed and the devices checked.
std::unique_ptr<StageLink> make_nccl_link(const mpi::Comm& comm, std::span<const int> tags,
                                          const LinkOptions& options);

}  // namespace locus::comm::detail
