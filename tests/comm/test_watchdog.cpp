// The progress watchdog: fires naming the operation when no progress is marked, stays quiet
// while progress is marked, and does not count time the process spent stopped (SIGSTOP).
#include <gtest/gtest.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>

#include "locus/comm/error.hpp"
#include "locus/comm/watchdog.hpp"

extern char** environ;

using namespace locus;
using namespace std::chrono_literals;

namespace {

struct Fired {
  std::mutex mutex;
  std::string message;
  std::atomic<int> count{0};
  comm::Watchdog::FireFn fn() {
    return [this](const std::string& m) {
      std::lock_guard g(mutex);
      message = m;
      ++count;
    };
  }
};

}  // namespace

TEST(Watchdog, FiresNamingTheOperationAndTheKey) {
  Fired fired;
  {
    comm::Watchdog w(0.3, "train.watchdog_s", fired.fn(), 10ms);
    comm::progress("gradient all-reduce step {}", 120);
    for (int i = 0; i < 300 && fired.count == 0; ++i) std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(fired.count, 1);
  EXPECT_NE(fired.message.find("watchdog: no progress for"), std::string::npos) << fired.message;
  EXPECT_NE(fired.message.find("in gradient all-reduce step 120 (train.watchdog_s = 0.3)"),
            std::string::npos) << fired.message;
  EXPECT_NE(fired.message.find("[rank "), std::string::npos) << fired.message;
  EXPECT_NE(fired.message.find("HINT"), std::string::npos) << fired.message;
}

// Stuck while completing the writes of an output (closing it): the message names the file and
// the failed-write cause, and says exit 5; a later plain mark forgets the file.
TEST(Watchdog, FiresNamingTheOutputWhileWritingIt) {
  Fired fired;
  {
    comm::Watchdog w(0.3, "ingest.watchdog_s", fired.fn(), 10ms);
    comm::mark_progress_writing("closing '/x/.data.h5.locus-tmp'", "/x/.data.h5.locus-tmp");
    for (int i = 0; i < 300 && fired.count == 0; ++i) std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(fired.count, 1);
  EXPECT_NE(fired.message.find("cannot write '/x/.data.h5.locus-tmp'"), std::string::npos)
      << fired.message;
  EXPECT_NE(fired.message.find("exit 5"), std::string::npos) << fired.message;
  EXPECT_NE(fired.message.find("(ingest.watchdog_s = 0.3)"), std::string::npos) << fired.message;

  Fired plain;
  {
    comm::Watchdog w(0.3, "ingest.watchdog_s", plain.fn(), 10ms);
    comm::mark_progress_writing("closing 'a.h5'", "a.h5");
    comm::progress("collective read of {}", "b.h5");
    for (int i = 0; i < 300 && plain.count == 0; ++i) std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(plain.count, 1);
  EXPECT_EQ(plain.message.find("cannot write"), std::string::npos) << plain.message;
  EXPECT_NE(plain.message.find("exit 70"), std::string::npos) << plain.message;
}

TEST(Watchdog, ProgressKeepsItQuiet) {
  Fired fired;
  {
    comm::Watchdog w(0.3, "infer.watchdog_s", fired.fn(), 10ms);
    for (int i = 0; i < 60; ++i) {  // 0.6 s in all, twice the timeout
      comm::progress("work queue fetch {}", i);
      std::this_thread::sleep_for(10ms);
    }
  }
  EXPECT_EQ(fired.count, 0) << fired.message;
}

TEST(Watchdog, OffAndDisarmed) {
  EXPECT_FALSE(comm::watchdog_armed());
  {
    comm::Watchdog off(0, "ingest.watchdog_s");
    EXPECT_FALSE(off.armed());
    EXPECT_FALSE(comm::watchdog_armed());
    comm::progress("nothing to watch");
  }
  {
    comm::Watchdog on(100, "ingest.watchdog_s");
    EXPECT_TRUE(comm::watchdog_armed());
    EXPECT_THROW(comm::Watchdog(100, "again"), InternalError);
  }
  EXPECT_FALSE(comm::watchdog_armed());
}

// A helper process stops this one for 2.4 s (four timeouts) and continues it: the stopped
// time does not count, so the watchdog does not fire. The time that does count -- starting the
// helper, the stop landing, reaping it -- stays well inside 0.6 s on a loaded machine too.
TEST(Watchdog, StoppedTimeDoesNotCount) {
  Fired fired;
  {
    comm::Watchdog w(0.6, "train.watchdog_s", fired.fn(), 10ms);
    comm::progress("checkpoint commit");
    const std::string script = "kill -STOP " + std::to_string(::getpid()) +
                               "; sleep 2.4; kill -CONT " + std::to_string(::getpid());
    const char* argv[] = {"sh", "-c", script.c_str(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(::posix_spawnp(&pid, "sh", nullptr, nullptr, const_cast<char**>(argv), environ), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);  // returns after the SIGCONT
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    comm::progress("after the stop");
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(fired.count, 0) << fired.message;
}
