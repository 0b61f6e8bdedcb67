// The stage-link factories that depend on the build (NCCL or not) and train.stage_link's
// parsing; the MPI link itself is mpi_link.cpp, the NCCL link nccl_link.cpp.
#include "locus/comm/link.hpp"

#include <fmt/format.h>

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

std::string nccl_link_unusable_reason(const mpi::Comm& comm) {
#if LOCUS_WITH_NCCL
  return detail::duplicate_device_reason(comm, "pipeline");
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
