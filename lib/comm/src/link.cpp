// The stage-link factories that depend on the build (NCCL or not) and train.stage_link's
// parsing; the MPI link itself is mpi_link.cpp, the NCCL link nccl_link.cpp.
#include "locus/comm/link.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <span>

#include "locus/comm/agree.hpp"
#include "locus/comm/error.hpp"
#include "locus/config.hpp"
#if LOCUS_WITH_NCCL
#include "nccl_entry.hpp"
#endif

namespace locus::comm {

LinkBackend parse_link_backend(std::string_view name) {
  if (name == "auto") return LinkBackend::automatic;
  if (name == "mpi") return LinkBackend::mpi;
  if (name == "nccl") return LinkBackend::nccl;
  throw ConfigError(fmt::format("train.stage_link = {} is not a stage link: use auto, mpi or nccl",
                                name));
}

std::string_view to_string(LinkBackend b) noexcept {
  switch (b) {
    case LinkBackend::automatic: return "auto";
    case LinkBackend::mpi: return "mpi";
    case LinkBackend::nccl: return "nccl";
  }
  return "?";
}

namespace {

// The environment settings that serialize NCCL kernels of different communicators ("" if none).
[[maybe_unused]] std::string serializing_setting() {
  const char* connections = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (connections != nullptr && std::atoi(connections) == 1) return "CUDA_DEVICE_MAX_CONNECTIONS=1";
  const char* order = std::getenv("NCCL_LAUNCH_ORDER_IMPLICIT");
  if (order != nullptr && std::atoi(order) != 0)
    return fmt::format("NCCL_LAUNCH_ORDER_IMPLICIT={}", order);
  return "";
}

}  // namespace

std::string nccl_link_unusable_reason(const mpi::Comm& comm) {
#if LOCUS_WITH_NCCL
  std::string why = detail::duplicate_device_reason(comm, "pipeline");
  if (!why.empty()) return why;
  // The link's two channels (activations up, gradients down) must run their kernels side by
  // side: on one hardware queue (CUDA_DEVICE_MAX_CONNECTIONS=1) or with NCCL ordering its
  // launches across communicators (NCCL_LAUNCH_ORDER_IMPLICIT), 1F1B can queue a send behind
  // a transfer that waits for it.
  const std::string mine = serializing_setting();
  int any = mine.empty() ? 0 : 1;
  comm.allreduce_inplace(std::span<int>(&any, 1), MPI_MAX);
  if (any == 0) return "";
  return fmt::format("{} serializes the kernels of the link's two NCCL communicators, which "
                     "could deadlock the 1F1B schedule; unset it for NCCL stage links",
                     mine.empty() ? "another pipeline rank's environment" : mine);
#else
  (void)comm;
  return "this build has no NCCL (LOCUS_WITH_NCCL=0)";
#endif
}

std::unique_ptr<StageLink> make_nccl_link(const mpi::Comm& comm, std::span<const int> tags,
                                          const LinkOptions& options) {
  mpi::agree_on(comm, [&] {
    if (!(options.timeout_s >= 0)) {
      throw ConfigError(fmt::format("{} = {} is invalid: use 0 (wait forever) or a positive "
                                    "number of seconds",
                                    options.timeout_key, options.timeout_s));
    }
  });
  const std::string why = nccl_link_unusable_reason(comm);
  mpi::agree_on(comm, [&] {
    if (!why.empty()) {
      throw ConfigError(fmt::format("train.stage_link = nccl cannot be used: {}. Set "
                                    "train.stage_link = auto (the host-staged MPI link where NCCL "
                                    "cannot run) or mpi, or give every rank a GPU of its own",
                                    why));
    }
  });
#if LOCUS_WITH_NCCL
  return detail::make_nccl_link(comm, tags, options);
#else
  (void)tags;
  LOCUS_ASSERT(false, "unreachable: no NCCL in this build");
  return nullptr;
#endif
}

}  // namespace locus::comm
