// A minimal MPI program for the Slurm tests: proves the ranks a launcher started inside a job
// form one MPI world (an all-reduce over it) and says which job they ran in.
#include <mpi.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  // The sum 0 + 1 + ... + (size-1) only comes out if every rank took part.
  int sum = 0;
  MPI_Allreduce(&rank, &sum, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  const char* job = std::getenv("SLURM_JOB_ID");
  std::printf("rank %d of %d sum %d job %s\n", rank, size, sum, job != nullptr ? job : "none");
  MPI_Finalize();
  return sum == size * (size - 1) / 2 ? 0 : 1;
}
