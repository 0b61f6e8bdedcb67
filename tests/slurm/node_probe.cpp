// For the multi-node Slurm tests: where each rank of one MPI world runs, as Slurm and as locus
// (comm::Topology) see it. Every rank prints one line
//   rank R of N job J slurm_node NAME slurm_nodeid ID topology_node K of M host HOST
// and rank 0 then prints "topology: <Topology::describe()>". Exits 1 on any error.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/comm/topology.hpp"

namespace {

std::string env_or_dash(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : "-";
}

}  // namespace

int main(int argc, char** argv) {
  locus::mpi::Environment env(argc, argv);
  try {
    const auto world = locus::mpi::Comm::world();
    const locus::comm::Topology topo(world);  // collective over world
    // One short line per rank, written at once (the launcher forwards whole lines).
    std::printf("rank %d of %d job %s slurm_node %s slurm_nodeid %s topology_node %d of %d host %s\n",
                world.rank(), world.size(), env_or_dash("SLURM_JOB_ID").c_str(),
                env_or_dash("SLURMD_NODENAME").c_str(), env_or_dash("SLURM_NODEID").c_str(),
                topo.node_index(), topo.nodes(), locus::mpi::hostname().c_str());
    std::fflush(stdout);
    if (world.rank() == 0) std::printf("topology: %s\n", topo.describe().c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "slurm_node_probe: error: %s\n", e.what());
    return 1;
  }
}
