// Communicator ownership, collectives against serial references, checked-call errors.
#include <gtest/gtest.h>

#include <numeric>

#include "locus/comm/error.hpp"
#include "locus/comm/handle.hpp"
#include "locus/comm/mpi.hpp"

using locus::mpi::Comm;

TEST(Comm, WorldIsBorrowedDupIsOwned) {
  Comm world = Comm::world();
  Comm d = world.dup();
  EXPECT_NE(d.get(), MPI_COMM_WORLD);
  EXPECT_EQ(d.rank(), world.rank());
  EXPECT_EQ(d.size(), world.size());
  MPI_Comm raw = d.get();
  {
    Comm moved = std::move(d);
    EXPECT_EQ(moved.get(), raw);
    EXPECT_EQ(d.get(), MPI_COMM_NULL);
  }
  // world must survive its borrowed wrapper going away
  { Comm w2 = Comm::world(); }
  world.barrier();
}

TEST(Comm, SplitByParity) {
  Comm world = Comm::world();
  Comm half = world.split(world.rank() % 2, world.rank());
  const int expect = (world.size() + (world.rank() % 2 == 0 ? 1 : 0)) / 2;
  EXPECT_EQ(half.size(), expect);
  EXPECT_EQ(half.rank(), world.rank() / 2);
}

TEST(Comm, CollectivesMatchSerial) {
  Comm world = Comm::world();
  const int n = world.size();
  EXPECT_EQ(world.allreduce(world.rank() + 1, MPI_SUM), n * (n + 1) / 2);
  EXPECT_EQ(world.exscan_sum(world.rank() + 1), world.rank() * (world.rank() + 1) / 2);
  auto all = world.allgather(world.rank() * 10);
  for (int r = 0; r < n; ++r) EXPECT_EQ(all[static_cast<std::size_t>(r)], r * 10);
  std::string s = world.bcast(world.is_root() ? std::string("hello from root") : std::string());
  EXPECT_EQ(s, "hello from root");
}

TEST(Errors, MpiCheckThrowsWithCallTextAndRank) {
  int bogus = 0;
  try {
    // A negative count is an argument error under MPI_ERRORS_RETURN.
    LOCUS_MPI_CHECK(MPI_Bcast(&bogus, -1, MPI_INT, 0, MPI_COMM_WORLD));
    FAIL() << "expected MpiError";
  } catch (const locus::MpiError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("MPI_Bcast"), std::string::npos) << what;
    EXPECT_NE(what.find("test_mpi.cpp"), std::string::npos) << what;
    EXPECT_NE(what.find("rank " + std::to_string(locus::mpi::world_rank())), std::string::npos)
        << what;
    EXPECT_EQ(e.kind(), locus::ErrorKind::mpi);
  }
}

namespace {
int g_closed = 0;
struct CountingTraits {
  using value_type = int;
  static constexpr int invalid() noexcept { return -1; }
  static void close(int) noexcept { ++g_closed; }
};
}  // namespace

TEST(Handle, MoveNullsSourceAndClosesOnce) {
  g_closed = 0;
  {
    locus::Handle<CountingTraits> a(7);
    locus::Handle<CountingTraits> b(std::move(a));
    EXPECT_FALSE(a);
    EXPECT_EQ(b.get(), 7);
    locus::Handle<CountingTraits> c(9);
    c = std::move(b);  // closes 9
    EXPECT_EQ(g_closed, 1);
  }
  EXPECT_EQ(g_closed, 2);  // closes 7 once
}
