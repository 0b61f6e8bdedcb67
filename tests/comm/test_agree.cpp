// Every rank agrees on one verdict: the lowest failing rank's error kind and message.
#include <gtest/gtest.h>

#include "locus/comm/agree.hpp"

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
