// Test hooks: kill, exit or sleep at named points, or slow a rank down (see test_hook.hpp).
#include "locus/comm/test_hook.hpp"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "locus/comm/mpi.hpp"

namespace locus {

namespace {

// The action LOCUS_TEST_HOOK names for `point` on this world rank ("" when none).
std::string hook_action(const char* point) {
  // Read every time (hooks sit at rare points), so a test may set the variable between runs.
  const char* spec = std::getenv("LOCUS_TEST_HOOK");
  if (spec == nullptr) return {};
  const std::string s(spec);
  const auto colon = s.find(':');
  if (colon == std::string::npos || s.compare(0, colon, point) != 0) return {};
  std::string action = s.substr(colon + 1);
  if (const auto at = action.find('@'); at != std::string::npos) {
    if (std::atoi(action.c_str() + at + 1) != mpi::world_rank()) return {};
    action.resize(at);
  }
  return action;
}

}  // namespace

SlowDown test_hook_slowdown(const char* point) {
  const std::string action = hook_action(point);
  SlowDown s;
  if (action.rfind("slow", 0) == 0) s.factor = std::max(1.0, std::atof(action.c_str() + 4));
  if (action.rfind("delay", 0) == 0) s.extra_ms = std::max(0.0, std::atof(action.c_str() + 5));
  return s;
}

void test_hook(const char* point) {
  const std::string action = hook_action(point);
  if (action.empty()) return;
  std::fprintf(stderr, "[rank %d] test hook '%s': %s\n", mpi::world_rank(), point,
               action.c_str());
  std::fflush(stderr);
  if (action == "kill") ::raise(SIGKILL);
  if (action == "exit") std::_Exit(9);
  if (action.rfind("sleep", 0) == 0) ::sleep(static_cast<unsigned>(std::atoi(action.c_str() + 5)));
}

}  // namespace locus
