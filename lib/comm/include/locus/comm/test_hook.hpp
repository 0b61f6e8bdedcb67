// Fault-injection points for tests. `LOCUS_TEST_HOOK=<point>:<action>[@rank]` makes the
// process act at the named point: `kill` (SIGKILL itself), `exit` (_Exit(9)), `sleep<N>`
// (pause N seconds) or `slow<N>` (pause N milliseconds, every time the point is reached:
// a rank made slower, for the straggler detector; announced once). Other actions are for the
// code at the point to interpret (test_hook_action). Without the variable a hook costs one
// getenv at first use.
#pragma once

#include <string>

namespace locus {

// Acts if LOCUS_TEST_HOOK names `point` (and this world rank, when `@rank` is given).
void test_hook(const char* point);

// The action LOCUS_TEST_HOOK gives `point` on this world rank ("" when none), for a point
// whose code interprets it (e.g. `anomaly-step-7:loss-spike`). Announced on stderr.
std::string test_hook_action(const std::string& point);

// Whether LOCUS_TEST_HOOK is set at all: lets a hot loop skip building point names.
bool test_hooks_enabled() noexcept;

}  // namespace locus
