// Every rank agrees on one verdict: the lowest failing rank's error kind and message.
#include <gtest/gtest.h>
#include <mpi.h>

#include <array>
#include <chrono>
#include <thread>

#include "locus/comm/agree.hpp"
#include "locus/comm/quiet_wait.hpp"

using namespace locus;

TEST(Agree, NoFailureMeansNoThrow) {
  mpi::Comm world = mpi::Comm::world();
  EXPECT_NO_THROW(mpi::agree_on(world, [] {}));
}

TEST(Agree, LastRankFailureReachesEveryRank) {
  mpi::Comm world = mpi::Comm::world();
  const int bad = world.size() - 1;
  try {
    mpi::agree_on(world, [&] {
      if (world.rank() == bad) throw DataError("rank " + std::to_string(bad) + " saw bad data");
    });
    FAIL() << "every rank must throw";
  } catch (const DataError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_EQ(std::string(e.what()), "rank " + std::to_string(bad) + " saw bad data");
  }
}

TEST(Agree, LowestFailingRankWins) {
  mpi::Comm world = mpi::Comm::world();
  try {
    mpi::agree_on(world, [&] {
      if (world.rank() == 0) throw ConfigError("from rank 0");
      throw GateError("from another rank");
    });
    FAIL() << "every rank must throw";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "from rank 0");
  } catch (const GateError&) {
    FAIL() << "rank 0's error must win";
  }
}

// allreduce_max_within: what a rank whose part of a collective write failed uses to learn, with
// a deadline, whether its peers failed too (lib/io, settle_collective_write).
TEST(AllreduceMaxWithin, GivesEachElementsMaximum) {
  mpi::Comm world = mpi::Comm::world();
  std::array<int, 3> v{world.rank(), -world.rank(), world.rank() == 0 ? 7 : -1};
  ASSERT_TRUE(comm::allreduce_max_within(world, v, 0.0));
  EXPECT_EQ(v[0], world.size() - 1);
  EXPECT_EQ(v[1], 0);
  EXPECT_EQ(v[2], 7);
}

TEST(AllreduceMaxWithin, GivesUpWhenAPeerDoesNotComeInTime) {
  mpi::Comm world = mpi::Comm::world();
  if (world.size() == 1) GTEST_SKIP() << "needs a peer that is late";
  std::array<int, 2> v{world.rank(), 1};
  constexpr int kGaveUp = 4711;  // a peer's word to rank 0 that it has given up
  constexpr double kLateS = 10.0;
  if (world.rank() == 0) {
    // Late, but it comes: once every peer said it gave up (a handshake, not a guess at how
    // long a busy machine takes), or after kLateS, which a peer that waited for it would show.
    const auto t0 = std::chrono::steady_clock::now();
    for (int heard = 0; heard < world.size() - 1 &&
                        std::chrono::steady_clock::now() - t0 < std::chrono::duration<double>(kLateS);) {
      int flag = 0;
      MPI_Status st;
      MPI_Iprobe(MPI_ANY_SOURCE, kGaveUp, world.get(), &flag, &st);
      if (flag == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        continue;
      }
      MPI_Recv(nullptr, 0, MPI_BYTE, st.MPI_SOURCE, kGaveUp, world.get(), MPI_STATUS_IGNORE);
      ++heard;
    }
    ASSERT_TRUE(comm::allreduce_max_within(world, v, 0.0));  // no deadline: waits for them
    EXPECT_EQ(v[0], world.size() - 1);
  } else {
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_FALSE(comm::allreduce_max_within(world, v, 0.2));
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MPI_Send(nullptr, 0, MPI_BYTE, 0, kGaveUp, world.get());
    EXPECT_GE(waited, 0.2);
    EXPECT_LT(waited, kLateS / 2) << "it must not wait for the late rank";
    EXPECT_EQ(v[0], world.rank()) << "values stay as given when nobody answered";
  }
  comm::quiet_barrier(world);  // the abandoned requests complete once rank 0 has joined
}
