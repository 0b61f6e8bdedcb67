// The ownership lock of a checkpoint directory at 1, 2 and 4 ranks: the holder record, a second
// holder refused on every rank with nothing in the directory changed, the lock taken again
// after its holder released it or was SIGKILLed (no stale lock), a requeued Slurm job waiting
// for its predecessor (longer for one that recorded a watchdog), and the errors of a directory
// that cannot be created.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include "locus/comm/error.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"
#include "file_test_util.hpp"
#include "shared_tmpdir.hpp"

extern char** environ;

namespace locus::train::test {
namespace {

namespace fs = std::filesystem;

const mpi::Comm& world() {
  static const mpi::Comm w = mpi::Comm::world();
  return w;
}

using locus::test::dir_snapshot;
using locus::test::slurp;
long root_pid() { return locus::test::root_pid(world()); }

// Runs acquire and returns the agreed ConfigError's message ("" when it succeeded).
std::string refusal(const std::string& dir, const std::string& run, double wait_s = 0,
                    std::string* said = nullptr, std::atomic<bool>* announced = nullptr) {
  try {
    CheckpointDirLock l = CheckpointDirLock::acquire(
        world(), dir, run, LockWait{wait_s, 0}, [&](const std::string& line) {
          if (said != nullptr) *said += line;
          if (announced != nullptr) announced->store(true);
        });
    return "";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(e.agreed()) << "every rank must fail alike: " << e.what();
    return e.what();
  }
}

// The Slurm job this process belongs to, on its first run (no SLURM_RESTART_COUNT) until
// requeued() says Slurm requeued it.
class SlurmJobId {
 public:
  explicit SlurmJobId(const char* id) {
    ::setenv("SLURM_JOB_ID", id, 1);
    ::unsetenv("SLURM_RESTART_COUNT");
  }
  ~SlurmJobId() {
    ::unsetenv("SLURM_JOB_ID");
    ::unsetenv("SLURM_RESTART_COUNT");
  }
  static void requeued() { ::setenv("SLURM_RESTART_COUNT", "1", 1); }
};

TEST(CheckpointLock, CreatesTheDirectoryAndRecordsTheHolder) {
  locus::test::SharedTmpDir tmp(world());
  const std::string dir = tmp.file("a/ck");
  CheckpointDirLock lock = CheckpointDirLock::acquire(world(), dir, "run-a");
  EXPECT_EQ(lock.held(), world().is_root()) << "rank 0 alone holds the lock";
  EXPECT_TRUE(lock.warning().empty()) << lock.warning();
  ASSERT_TRUE(fs::is_regular_file(dir + "/.lock"));
  const std::string holder = read_lock_holder(dir);
  EXPECT_NE(holder.find(fmt::format("pid {}", root_pid())), std::string::npos) << holder;
  EXPECT_NE(holder.find("host " + mpi::hostname()), std::string::npos) << holder;
  EXPECT_NE(holder.find("run run-a"), std::string::npos) << holder;
  EXPECT_EQ(holder.find("Slurm job"), std::string::npos) << "no SLURM_JOB_ID here: " << holder;
  world().barrier();
  lock.set_run("run-b");  // a resume adopted another run
  world().barrier();
  EXPECT_NE(read_lock_holder(dir).find("run run-b"), std::string::npos) << read_lock_holder(dir);
  EXPECT_EQ(read_lock_holder(tmp.file("nowhere")), "");
  world().barrier();
}

TEST(CheckpointLock, SecondHolderIsRefusedEverywhereAndChangesNothing) {
  locus::test::SharedTmpDir tmp(world());
  const std::string dir = tmp.file("ck");
  CheckpointDirLock first = CheckpointDirLock::acquire(world(), dir, "run-a");
  if (world().is_root()) std::ofstream(dir + "/ckpt-00000005.h5") << "a checkpoint";
  world().barrier();
  const auto before = dir_snapshot(dir);
  const std::string why = refusal(dir, "run-b");
  EXPECT_NE(why.find(fmt::format("checkpoint.dir '{}' is in use by another training job", dir)),
            std::string::npos) << why;
  EXPECT_NE(why.find(fmt::format("pid {}", root_pid())), std::string::npos) << why;
  EXPECT_NE(why.find("run run-a"), std::string::npos) << why;
  EXPECT_NE(why.find("Set checkpoint.dir to another directory, or wait until process"),
            std::string::npos) << why;
  world().barrier();
  EXPECT_EQ(dir_snapshot(dir), before) << "a refused job changed the directory";
  EXPECT_NE(read_lock_holder(dir).find("run run-a"), std::string::npos);
}

TEST(CheckpointLock, ReleasedLockIsTakenAgain) {
  locus::test::SharedTmpDir tmp(world());
  const std::string dir = tmp.file("ck");
  { CheckpointDirLock first = CheckpointDirLock::acquire(world(), dir, "run-a"); }
  CheckpointDirLock second = CheckpointDirLock::acquire(world(), dir, "run-b");
  EXPECT_EQ(second.held(), world().is_root());
  EXPECT_NE(read_lock_holder(dir).find("run run-b"), std::string::npos) << read_lock_holder(dir);
  // Moving the lock moves the ownership; the moved-from one releases nothing.
  CheckpointDirLock moved = std::move(second);
  EXPECT_FALSE(second.held());  // NOLINT(bugprone-use-after-move): the point of the check
  EXPECT_NE(refusal(dir, "run-c"), "");
  moved = CheckpointDirLock();
  EXPECT_EQ(refusal(dir, "run-c"), "");
}

// Another process holds the lock (util-linux flock(1), which writes no record), then dies by
// SIGKILL: the kernel releases the lock and the directory is taken.
TEST(CheckpointLock, KilledHolderLeavesNoStaleLock) {
  if (!fs::exists("/usr/bin/flock")) GTEST_SKIP() << "needs /usr/bin/flock (util-linux)";
  locus::test::SharedTmpDir tmp(world());
  const std::string dir = tmp.file("ck");
  fs::create_directories(dir);
  pid_t child = -1;
  if (world().is_root()) {
    const std::string lock = dir + "/.lock", ready = dir + "/ready";
    const std::string script = fmt::format("touch '{}'; exec sleep 60", ready);
    // -o: the command does not inherit the lock, so it dies with flock(1) itself.
    const char* argv[] = {"/usr/bin/flock", "-n", "-o", lock.c_str(), "/bin/sh", "-c", script.c_str(),
                          nullptr};
    // In its own process group, so that the kill below also ends the sleep (whose inherited
    // output would otherwise keep ctest waiting for it).
    posix_spawnattr_t attr;
    posix_spawnattr_init(&attr);
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP);
    posix_spawnattr_setpgroup(&attr, 0);
    const int rc = ::posix_spawn(&child, argv[0], nullptr, &attr, const_cast<char**>(argv), environ);
    posix_spawnattr_destroy(&attr);
    ASSERT_EQ(rc, 0);
    for (int i = 0; i < 600 && !fs::exists(ready); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(fs::exists(ready)) << "flock(1) did not take the lock";
    fs::remove(ready);
  }
  world().barrier();
  const std::string why = refusal(dir, "run-b");
  EXPECT_NE(why.find("holder not recorded"), std::string::npos) << why;
  if (world().is_root()) {
    ::kill(-child, SIGKILL);  // flock(1), the holder, and its sleep
    int status = 0;
    ::waitpid(child, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status));
  }
  world().barrier();
  EXPECT_EQ(refusal(dir, "run-b"), "") << "the lock of a killed process must be free";
}

// A requeued Slurm job whose previous instance still holds the directory waits for it (up to
// the given time); another job does not wait.
TEST(CheckpointLock, RequeuedJobWaitsForItsPredecessor) {
  locus::test::SharedTmpDir tmp(world());
  const std::string dir = tmp.file("ck");
  const SlurmJobId job("4242");
  CheckpointDirLock first = CheckpointDirLock::acquire(world(), dir, "run-a");
  EXPECT_NE(read_lock_holder(dir).find("Slurm job 4242"), std::string::npos);
  std::string said;
  // Another step of the same run (the same SLURM_RESTART_COUNT) does not wait.
  EXPECT_EQ(refusal(dir, "run-b", 600, &said).find("earlier instance"), std::string::npos);
  EXPECT_EQ(said, "") << "another step of the same run must not wait";
  SlurmJobId::requeued();
  const std::string why = refusal(dir, "run-b", 0.3, &said);
  EXPECT_NE(why.find("an earlier instance of this Slurm job that did not end within"),
            std::string::npos) << why;
  EXPECT_NE(why.find("wait until Slurm job 4242 ends"), std::string::npos) << why;
  if (world().is_root()) {
    EXPECT_NE(said.find("held by an earlier instance of this Slurm job"), std::string::npos) << said;
  }
  {
    const SlurmJobId other("4243");
    SlurmJobId::requeued();
    said.clear();
    const std::string no_wait = refusal(dir, "run-b", 600, &said);
    EXPECT_NE(no_wait.find("Slurm job 4242"), std::string::npos) << no_wait;
    EXPECT_EQ(no_wait.find("earlier instance"), std::string::npos) << no_wait;
    EXPECT_EQ(said, "") << "another job must not wait";
  }
  ::setenv("SLURM_JOB_ID", "4242", 1);
  SlurmJobId::requeued();
  // The predecessor goes away while the new instance waits: rank 0, which holds the lock,
  // releases it once the wait was announced (10 s at most), however late a loaded machine lets
  // the main thread reach the lock.
  std::atomic<bool> announced{false};
  std::thread predecessor([&] {
    for (int i = 0; i < 1000 && world().is_root() && !announced.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    first = CheckpointDirLock();
  });
  said.clear();
  EXPECT_EQ(refusal(dir, "run-b", 600, &said, &announced), "");
  predecessor.join();
  if (world().is_root()) {
    EXPECT_NE(said, "") << "the wait was not announced";
  }
  EXPECT_NE(read_lock_holder(dir).find("run run-b"), std::string::npos) << read_lock_holder(dir);
}

// A predecessor that recorded its watchdog is waited for that much longer: it may be stranded
// on a node that lost its network (Slurm requeued the job elsewhere), and its watchdog ends it.
TEST(CheckpointLock, RequeuedJobWaitsForItsStrandedPredecessorsWatchdog) {
  locus::test::SharedTmpDir tmp(world());
  const std::string dir = tmp.file("ck");
  const SlurmJobId job("4244");
  CheckpointDirLock first =
      CheckpointDirLock::acquire(world(), dir, "run-a", LockWait{0, 600});
  EXPECT_NE(read_lock_holder(dir).find("train.watchdog_s 600"), std::string::npos)
      << read_lock_holder(dir);
  SlurmJobId::requeued();
  // With no wait of its own the successor would be refused at once (as for a predecessor that
  // recorded no watchdog, above); the predecessor's 600 s make it wait. Rank 0, which holds the
  // lock, releases it once the wait was announced.
  std::atomic<bool> announced{false};
  std::thread predecessor([&] {
    for (int i = 0; i < 1000 && world().is_root() && !announced.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    first = CheckpointDirLock();
  });
  std::string said;
  EXPECT_EQ(refusal(dir, "run-b", 0, &said, &announced), "");
  predecessor.join();
  if (world().is_root()) {
    EXPECT_NE(said.find("waiting up to 600 s for it to end (its train.watchdog_s = 600 ends it"),
              std::string::npos) << said;
  }
  EXPECT_NE(read_lock_holder(dir).find("run run-b"), std::string::npos) << read_lock_holder(dir);
  EXPECT_EQ(read_lock_holder(dir).find("train.watchdog_s"), std::string::npos)
      << "run-b recorded no watchdog: " << read_lock_holder(dir);
}

TEST(CheckpointLock, DirectoryThatCannotBeCreatedIsAnIoError) {
  locus::test::SharedTmpDir tmp(world());
  if (world().is_root()) std::ofstream(tmp.file("file")) << "x";
  world().barrier();
  try {
    CheckpointDirLock::acquire(world(), tmp.file("file/ck"), "run-a");
    ADD_FAILURE() << "a directory below a file was accepted";
  } catch (const IoError& e) {
    EXPECT_TRUE(e.agreed());
    EXPECT_NE(std::string(e.what()).find("cannot create checkpoint.dir"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace locus::train::test
