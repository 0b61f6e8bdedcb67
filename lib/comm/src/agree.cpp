// Verdict agreement: MIN-reduce of the failing rank, then a broadcast of its failure.
#include "locus/comm/agree.hpp"

namespace locus::mpi {

std::optional<Failure> agree(const Comm& comm, const std::optional<Failure>& local) {
  const int mine = local ? comm.rank() : comm.size();
  const int first = comm.allreduce(mine, MPI_MIN);
  if (first == comm.size()) return std::nullopt;
  int kind = local && first == comm.rank() ? static_cast<int>(local->kind) : 0;
  comm.bcast(std::span<int>(&kind, 1), first);
  std::string msg = comm.bcast(local && first == comm.rank() ? local->message : std::string(),
                               first);
  return Failure{static_cast<ErrorKind>(kind), std::move(msg)};
}

}  // namespace locus::mpi
