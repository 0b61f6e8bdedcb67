#include "locus/comm/topology.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "locus/comm/agree.hpp"

namespace locus::comm {

int test_ranks_per_node() {
  const char* text = std::getenv("LOCUS_TEST_RANKS_PER_NODE");
  if (text == nullptr || *text == '\0') return 0;
  const std::string_view s(text);
  int k = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), k);
  if (ec != std::errc{} || end != s.data() + s.size() || k <= 0) {
    throw ConfigError(fmt::format(
        "LOCUS_TEST_RANKS_PER_NODE = '{}' is not a positive rank count: it declares how many "
        "consecutive ranks form one node in tests; unset it outside tests",
        s));
  }
  return k;
}

namespace {

// This rank's node colour inside the shared-memory communicator `shared`: the lowest shared
// rank with the same Slurm node name (all zero where SLURMD_NODENAME is unset everywhere).
int slurm_node_colour(const mpi::Comm& shared, bool& any_named) {
  constexpr std::size_t width = 256;
  std::array<char, width> mine{};
  if (const char* name = std::getenv("SLURMD_NODENAME"); name != nullptr) {
    std::strncpy(mine.data(), name, width - 1);
  }
  std::vector<char> all(width * static_cast<std::size_t>(shared.size()));
  LOCUS_MPI_CHECK(MPI_Allgather(mine.data(), static_cast<int>(width), MPI_CHAR, all.data(),
                                static_cast<int>(width), MPI_CHAR, shared.get()));
  any_named = false;
  int colour = shared.rank();
  for (int r = shared.size() - 1; r >= 0; --r) {
    const char* theirs = all.data() + width * static_cast<std::size_t>(r);
    if (theirs[0] != '\0') any_named = true;
    if (std::strncmp(theirs, mine.data(), width) == 0) colour = r;
  }
  return colour;
}

}  // namespace

Topology::Topology(const mpi::Comm& comm) {
  int per_node = 0;
  mpi::agree_on(comm, [&] { per_node = test_ranks_per_node(); });

  // Node key of this rank: a value equal on the ranks of one node, distinct across nodes.
  if (per_node > 0) {
    // Keyed on the world rank, so sub-communicators agree with the world's nodes.
    int world_rank = 0;
    LOCUS_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
    node_ = comm.split(world_rank / per_node, comm.rank());
    source_ = fmt::format("LOCUS_TEST_RANKS_PER_NODE={} (test only)", per_node);
  } else {
    MPI_Comm shared_raw = MPI_COMM_NULL;
    LOCUS_MPI_CHECK(MPI_Comm_split_type(comm.get(), MPI_COMM_TYPE_SHARED, comm.rank(),
                                        MPI_INFO_NULL, &shared_raw));
    mpi::Comm shared = mpi::Comm::borrow(shared_raw);
    bool named = false;
    const int colour = slurm_node_colour(shared, named);
    node_ = shared.split(colour, comm.rank());
    MPI_Comm_free(&shared_raw);
    const bool any_named = comm.allreduce(named ? 1 : 0, MPI_MAX) != 0;
    source_ = any_named ? "shared memory and Slurm node names" : "shared memory";
  }

  leaders_ = comm.split(node_.rank() == 0 ? 0 : MPI_UNDEFINED, comm.rank());
  // Leaders are ordered by their comm rank (the lowest rank of their node): that order is the
  // node index, which every rank of the node learns from its leader.
  int index = leaders_.get() != MPI_COMM_NULL ? leaders_.rank() : 0;
  LOCUS_MPI_CHECK(MPI_Bcast(&index, 1, MPI_INT, 0, node_.get()));
  node_index_ = index;

  node_of_rank_ = comm.allgather(node_index_);
  const int count = *std::max_element(node_of_rank_.begin(), node_of_rank_.end()) + 1;
  node_sizes_.assign(static_cast<std::size_t>(count), 0);
  for (const int n : node_of_rank_) ++node_sizes_[static_cast<std::size_t>(n)];
  uniform_blocks_ = std::all_of(node_sizes_.begin(), node_sizes_.end(),
                                [&](int s) { return s == node_sizes_.front(); });
  for (std::size_t r = 1; r < node_of_rank_.size() && uniform_blocks_; ++r) {
    const int step = node_of_rank_[r] - node_of_rank_[r - 1];
    uniform_blocks_ = step == 0 || step == 1;
  }
}

std::string Topology::describe() const {
  std::string sizes;
  for (std::size_t i = 0; i < node_sizes_.size(); ++i) {
    sizes += fmt::format("{}{}", i == 0 ? "" : "+", node_sizes_[i]);
  }
  const int ranks = static_cast<int>(node_of_rank_.size());
  return fmt::format("{} rank{} on {} node{} ({}; {})", ranks, ranks == 1 ? "" : "s", nodes(),
                     nodes() == 1 ? "" : "s", sizes, source_);
}

}  // namespace locus::comm
