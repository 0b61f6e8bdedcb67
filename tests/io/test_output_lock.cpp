// The output lock at 1, 2 and 4 ranks: a second writer of one output is refused on every rank
// and changes nothing (before the lock it removed the first writer's temporary file, and the
// first then published the second's partial file); the lock is released with its holder and
// its file stays; a publication under a held lock or a directory lock; a requeued Slurm job
// waiting for its predecessor (longer for one whose watchdog was armed), two steps of one
// allocation not waiting.
#include <gtest/gtest.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "agreed_error.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/io/publish.hpp"
#include "scoped_env.hpp"
#include "file_test_util.hpp"
#include "shared_tmpdir.hpp"

namespace locus::io::test {
namespace {

namespace fs = std::filesystem;
using locus::test::agreed_error;
using locus::test_support::ScopedEnv;

const mpi::Comm& world() {
  static const mpi::Comm w = mpi::Comm::world();
  return w;
}

using locus::test::dir_snapshot;
using locus::test::slurp;
long root_pid() { return locus::test::root_pid(world()); }

// Collective: whether another job could take the output's lock now (its record is then this
// process's).
bool lock_is_free(const std::string& out) {
  try {
    OutputLock::acquire(world(), out);
    return true;
  } catch (const ConfigError& e) {
    EXPECT_TRUE(e.agreed()) << e.what();
    EXPECT_NE(std::string(e.what()).find("is being written by another job"), std::string::npos)
        << e.what();
    return false;
  }
}

// Whether the lock file exists, seen by every rank between two barriers: after rank 0 changed
// it, before rank 0 goes on to change it again.
bool lock_file_exists(const std::string& out) {
  world().barrier();
  const bool exists = fs::exists(lock_path_for(out));
  world().barrier();
  return exists;
}

TEST(OutputLock, SecondWriterIsRefusedEverywhereAndChangesNothing) {
  locus::test::SharedTmpDir tmp(world());
  const std::string out = tmp.file("out.h5");
  if (world().is_root()) std::ofstream(out) << "the previous output";
  Publication first(world(), out);
  EXPECT_EQ(lock_path_for(out), tmp.file(".out.h5.locus-lock"));
  if (world().is_root()) std::ofstream(first.temp_path()) << "the first job's rows";
  world().barrier();
  const auto before = dir_snapshot(tmp.path());
  ASSERT_TRUE(before.contains(".out.h5.locus-lock"));
  const std::string holder = describe_lock_holder(lock_path_for(out));
  EXPECT_NE(holder.find(fmt::format("pid {}", root_pid())), std::string::npos) << holder;
  EXPECT_NE(holder.find("host " + mpi::hostname()), std::string::npos) << holder;
  world().barrier();  // every rank took its snapshot before the refused jobs probe the directory

  const std::string why = agreed_error<ConfigError>([&] { Publication second(world(), out); });
  EXPECT_NE(why.find(fmt::format("output '{}' is being written by another job (host {}, pid {}",
                                 out, mpi::hostname(), root_pid())),
            std::string::npos) << why;
  EXPECT_NE(why.find(fmt::format("Wait until process {} on {} ends", root_pid(), mpi::hostname())),
            std::string::npos) << why;
  EXPECT_NE(why.find(lock_path_for(out)), std::string::npos) << why;
  // An OutputLock alone (an append or an incremental run) is refused alike.
  EXPECT_NE(agreed_error<ConfigError>([&] { OutputLock::acquire(world(), out); })
                .find("is being written by another job"), std::string::npos);
  world().barrier();
  EXPECT_EQ(dir_snapshot(tmp.path()), before) << "a refused job changed the directory";
  world().barrier();

  first.commit();
  EXPECT_EQ(slurp(out), "the first job's rows");
  EXPECT_FALSE(lock_is_free(out)) << "held until the publication ends";
}

TEST(OutputLock, ReleasedWithItsHolderAndTheFileStays) {
  locus::test::SharedTmpDir tmp(world());
  const std::string out = tmp.file("out.h5");
  {
    Publication pub(world(), out);
    EXPECT_FALSE(lock_is_free(out));
    if (world().is_root()) std::ofstream(pub.temp_path()) << "rows";
    world().barrier();
    pub.commit();
  }
  EXPECT_TRUE(lock_is_free(out)) << "a committed publication releases the lock";
  EXPECT_TRUE(lock_file_exists(out)) << "the file stays: removing it would let two jobs lock "
                                        "two files";
  {
    Publication pub(world(), out);
    world().barrier();
  }  // abandoned, as when an error unwinds the app
  EXPECT_TRUE(lock_is_free(out)) << "an abandoned publication releases the lock";
  // A holder killed by SIGKILL leaves its record: the next job takes the lock and rewrites it.
  if (world().is_root()) std::ofstream(lock_path_for(out)) << "host gone\npid 1\nslurm_job -\n";
  world().barrier();
  {
    OutputLock lock = OutputLock::acquire(world(), out);
    EXPECT_EQ(lock.held(), world().is_root()) << "rank 0 alone holds the lock";
    EXPECT_NE(describe_lock_holder(lock_path_for(out)).find(fmt::format("pid {}", root_pid())),
              std::string::npos) << "the record is this holder's";
    // Moving the lock moves the ownership; the moved-from one releases nothing.
    OutputLock moved = std::move(lock);
    EXPECT_FALSE(lock_is_free(out));
  }
  EXPECT_TRUE(lock_is_free(out));
}

TEST(OutputLock, PublicationUnderAHeldLockOrADirectoryLock) {
  locus::test::SharedTmpDir tmp(world());
  const std::string out = tmp.file("out.h5");
  {
    const OutputLock lock = OutputLock::acquire(world(), out);
    {
      Publication pub(world(), out, lock);  // no second lock of its own: no self-refusal
      if (world().is_root()) std::ofstream(pub.temp_path()) << "rows";
      world().barrier();
      pub.commit();
    }
    EXPECT_FALSE(lock_is_free(out)) << "the caller's lock outlives the publication";
    EXPECT_THROW(Publication(world(), tmp.file("other.h5"), lock), InternalError);
  }
  EXPECT_TRUE(lock_is_free(out));
  EXPECT_EQ(slurp(out), "rows");
  Publication pub(world(), tmp.file("ckpt.h5"), Publication::DirectoryLocked{});
  EXPECT_FALSE(lock_file_exists(tmp.file("ckpt.h5"))) << "under a directory lock: none of its own";
}

TEST(OutputLock, UnwritableDirectoryIsAnIoErrorBeforeAnyLock) {
  const std::string why =
      agreed_error<IoError>([] { OutputLock::acquire(world(), "/proc/locus-out.h5"); });
  EXPECT_NE(why.find("/proc"), std::string::npos) << why;
}

// A file rank 0 alone writes on its own node (a Prometheus file in node_exporter's directory):
// other nodes need not have its directory. Emulated with a relative path from a working
// directory of each rank's: rank 0's has the directory, the others' do not.
TEST(OutputLock, AFileOfRank0AloneNeedsItsDirectoryOnRank0Only) {
  if (world().size() < 2) GTEST_SKIP() << "needs a rank besides rank 0";
  locus::test::SharedTmpDir tmp(world());
  const std::string mine = tmp.file(fmt::format("rank{}", world().rank()));
  fs::create_directories(mine);
  if (world().is_root()) fs::create_directories(mine + "/textfile");
  world().barrier();
  // Back to the first working directory however the test ends (before tmp is removed).
  struct Chdir {
    fs::path before = fs::current_path();
    explicit Chdir(const fs::path& to) { fs::current_path(to); }
    ~Chdir() {
      std::error_code ec;
      fs::current_path(before, ec);
    }
  } chdir(mine);
  const std::string prom = "textfile/job.prom";
  {
    const OutputLock held =
        OutputLock::acquire(world(), prom, "train.prometheus", {}, OutputLock::Writer::rank_0);
    if (world().is_root()) {
      EXPECT_TRUE(held.held());
    }
  }
  // The default: every rank writes the output, so every rank needs its directory.
  const std::string why = agreed_error<IoError>([&] { OutputLock::acquire(world(), prom); });
  EXPECT_NE(why.find("textfile"), std::string::npos) << why;
}

// A requeued Slurm job (the same SLURM_JOB_ID, a higher SLURM_RESTART_COUNT) whose previous
// instance still writes the output waits for it; the predecessor's armed watchdog, recorded in
// the lock file, lengthens the wait. Another step of the same run (the same count) does not.
TEST(OutputLock, RequeuedJobWaitsForItsPredecessorsWatchdog) {
  locus::test::SharedTmpDir tmp(world());
  const std::string out = tmp.file("out.h5");
  const ScopedEnv job("SLURM_JOB_ID", "4245");
  const ScopedEnv no_wait("LOCUS_TEST_REQUEUE_WAIT_S", "0");
  const ScopedEnv count("SLURM_RESTART_COUNT", nullptr);  // the first run: no count
  {
    const OutputLock first = OutputLock::acquire(world(), out);
    ::setenv("SLURM_RESTART_COUNT", "1", 1);  // requeued once
    // No watchdog recorded and no wait: refused at once, named as an earlier instance.
    const std::string why = agreed_error<ConfigError>([&] { OutputLock::acquire(world(), out); });
    EXPECT_NE(why.find("an earlier instance of this Slurm job that did not end within"),
              std::string::npos) << why;
    EXPECT_NE(why.find("Wait until Slurm job 4245 ends"), std::string::npos) << why;
  }
  ::setenv("SLURM_RESTART_COUNT", "0", 1);
  std::optional<OutputLock> first;
  {
    const comm::Watchdog watchdog(600, "infer.watchdog_s", [](const std::string&) {});
    first = OutputLock::acquire(world(), out);
  }
  EXPECT_NE(describe_lock_holder(lock_path_for(out)).find("infer.watchdog_s 600"),
            std::string::npos) << describe_lock_holder(lock_path_for(out));
  world().barrier();
  // Another step of the same run: refused at once, whatever the holder's watchdog.
  const std::string step = agreed_error<ConfigError>([&] { OutputLock::acquire(world(), out); });
  EXPECT_NE(step.find("Slurm job 4245"), std::string::npos) << step;
  EXPECT_EQ(step.find("earlier instance"), std::string::npos) << step;
  // The requeued job. Rank 0, which holds the lock, releases it once the wait was announced.
  ::setenv("SLURM_RESTART_COUNT", "1", 1);
  std::atomic<bool> announced{false};
  std::string said;
  std::thread predecessor([&] {
    for (int i = 0; i < 1000 && world().is_root() && !announced.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    first.reset();
  });
  const OutputLock second = OutputLock::acquire(world(), out, {}, [&](const std::string& line) {
    said += line;
    announced.store(true);
  });
  predecessor.join();
  if (world().is_root()) {
    EXPECT_NE(said.find(fmt::format("output '{}' is held by an earlier instance of this Slurm "
                                    "job", out)), std::string::npos) << said;
    EXPECT_NE(said.find("waiting up to 600 s for it to end (its infer.watchdog_s = 600 ends it"),
              std::string::npos) << said;
  }
  const std::string record = describe_lock_holder(lock_path_for(out));
  EXPECT_NE(record.find("Slurm job 4245 (restart 1)"), std::string::npos) << record;
  EXPECT_EQ(record.find("watchdog"), std::string::npos) << "no watchdog armed: " << record;
  world().barrier();
}

}  // namespace
}  // namespace locus::io::test
