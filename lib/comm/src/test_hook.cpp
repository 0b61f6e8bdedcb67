// Test hooks: kill, exit, sleep or slow down at named points (see test_hook.hpp).
#include "locus/comm/test_hook.hpp"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "locus/comm/mpi.hpp"
#include "locus/comm/watchdog.hpp"

namespace locus {

namespace {

// Read every time (a getenv; hooks sit at points reached at most once a step), so a test may
// set the variable between runs in one process.
const char* hook_spec() { return std::getenv("LOCUS_TEST_HOOK"); }

// The action of `point` on this rank, "" when the hook names another point or rank.
std::string action_for(const std::string& point) {
  const char* spec = hook_spec();
  if (spec == nullptr) return "";
  const std::string s(spec);
  const auto colon = s.find(':');
  if (colon == std::string::npos || colon != point.size() || s.compare(0, colon, point) != 0) {
    return "";
  }
  std::string action = s.substr(colon + 1);
  if (const auto at = action.find('@'); at != std::string::npos) {
    if (std::atoi(action.c_str() + at + 1) != mpi::world_rank()) return "";
    action.resize(at);
  }
  return action;
}

void announce(const std::string& point, const std::string& action) {
  std::fprintf(stderr, "[rank %d] test hook '%s': %s\n", mpi::world_rank(), point.c_str(),
               action.c_str());
  std::fflush(stderr);
}

}  // namespace

bool test_hooks_enabled() noexcept { return hook_spec() != nullptr; }

std::string test_hook_action(const std::string& point) {
  std::string action = action_for(point);
  if (!action.empty()) announce(point, action);
  return action;
}

SlowDown test_hook_slowdown(const char* point) {
  const std::string action = action_for(point);
  SlowDown s;
  if (action.rfind("slow", 0) == 0) s.factor = std::max(1.0, std::atof(action.c_str() + 4));
  if (action.rfind("delay", 0) == 0) s.extra_ms = std::max(0.0, std::atof(action.c_str() + 5));
  return s;
}

void test_hold(const char* point, const std::function<void()>& while_held) {
  const char* spec = std::getenv("LOCUS_TEST_HOLD");
  if (spec == nullptr) return;
  const std::string s(spec), p(point);
  if (s.size() <= p.size() + 1 || s.compare(0, p.size(), p) != 0 || s[p.size()] != ':') return;
  const std::string path = s.substr(p.size() + 1);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return;
  announce(point, "held until " + path + " exists");
  const std::string held_at = "test hold '" + p + "' (LOCUS_TEST_HOLD)";
  const auto t0 = std::chrono::steady_clock::now();
  while (::stat(path.c_str(), &st) != 0) {
    comm::mark_progress(held_at);
    if (while_held) while_held();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  comm::mark_progress(held_at);
  const std::chrono::duration<double> held = std::chrono::steady_clock::now() - t0;
  char what[64];
  std::snprintf(what, sizeof what, "released after %.1f s", held.count());
  announce(point, what);
}

void test_hook(const char* point) {
  if (hook_spec() == nullptr) return;
  const std::string action = action_for(point);
  if (action.empty()) return;
  if (action.rfind("delay", 0) == 0) {  // every time, announced once
    static bool announced = false;
    if (!announced) announce(point, action + " (every time)");
    announced = true;
    std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(action.c_str() + 5)));
    return;
  }
  announce(point, action);
  if (action == "kill") ::raise(SIGKILL);
  if (action == "exit") std::_Exit(9);
  if (action.rfind("sleep", 0) == 0) ::sleep(static_cast<unsigned>(std::atoi(action.c_str() + 5)));
}

}  // namespace locus
