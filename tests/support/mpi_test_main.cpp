// GoogleTest main for MPI tests: every rank runs every test; rank 0 prints the usual report,
// other ranks print only their failures (prefixed with the rank); the exit code is the
// all-reduced verdict, so a failure on any rank fails the test on every rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "locus/comm/mpi.hpp"

namespace {

class RankFailurePrinter : public testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.summary());
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  locus::mpi::Environment env(argc, argv, MPI_THREAD_MULTIPLE);
  testing::InitGoogleTest(&argc, argv);
  const int rank = locus::mpi::world_rank();
  if (rank != 0) {
    auto& listeners = testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  const int local = RUN_ALL_TESTS();
  int global = 0;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && global != 0 && local == 0)
    std::fprintf(stderr, "a test failed on another rank (see [rank N] lines above)\n");
  return global;
}
