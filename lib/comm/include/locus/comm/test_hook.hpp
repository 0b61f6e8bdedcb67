// Fault-injection points for tests. `LOCUS_TEST_HOOK=<point>:<action>[@rank]` makes the
// process act at the named point: `kill` (SIGKILL itself), `exit` (_Exit(9)), `sleep<N>`
// (pause N seconds) or `delay<MS>` (pause MS milliseconds every time the point is reached:
// a rank made slower, for the straggler detector; announced once). Other actions are for
// the code at the point to interpret (test_hook_action, test_hook_slowdown). Without the
// variable a hook costs one getenv.
//
// Slow-down points (test_hook_slowdown) make the caller slower at each occurrence:
// `slow<F>` (F times slower: the caller waits F - 1 times the work it just did, as a slower
// node would) or `delay<MS>` (MS milliseconds more per occurrence), e.g.
// `LOCUS_TEST_HOOK=ingest-unit:slow4@1` makes world rank 1 parse each ingest unit 4x slower.
//
// Hold points (test_hold) stop the job at a place of the test's choosing until the test lets it
// go: `LOCUS_TEST_HOLD=<point>:<path>` makes every rank that reaches `point` wait there until
// `path` exists. A test that must act on a job mid-run (cut its node's network, say) holds it
// there, acts, then creates the file: the job cannot finish before the test had its turn, however
// loaded the machine. The variable is separate from LOCUS_TEST_HOOK, so one job can be both held
// and slowed. The points: `ingest-first-unit` (a rank has parsed its first unit) and
// `infer-second-unit` (a rank is about to claim its second unit), so a held job is mid-run.
#pragma once

#include <functional>
#include <string>

namespace locus {

// Acts if LOCUS_TEST_HOOK names `point` (and this world rank, when `@rank` is given).
void test_hook(const char* point);

// The action LOCUS_TEST_HOOK gives `point` on this world rank ("" when none), for a point
// whose code interprets it (e.g. `anomaly-step-7:loss-spike`). Announced on stderr.
std::string test_hook_action(const std::string& point);

// Whether LOCUS_TEST_HOOK is set at all: lets a hot loop skip building point names.
bool test_hooks_enabled() noexcept;

// How much slower this rank is to be at `point`: factor >= 1 (slow<F>) and extra_ms >= 0
// (delay<MS>); {1, 0} when LOCUS_TEST_HOOK does not name the point and this rank. The caller
// does the waiting (so it can stop waiting when the work turns out to be moot).
struct SlowDown {
  double factor = 1.0;
  double extra_ms = 0.0;
  bool active() const noexcept { return factor > 1.0 || extra_ms > 0.0; }
};
SlowDown test_hook_slowdown(const char* point);

// Waits, if LOCUS_TEST_HOLD names `point`, until its path exists: every 20 ms it looks, calls
// while_held (e.g. to progress the one-sided requests of other ranks on a window this rank
// holds) and marks progress for the watchdog (a hold is the test's doing, not a hang).
// Announced on stderr when the wait starts and ends. Call it outside any collective: the other
// ranks of the job may be waiting in the next collective meanwhile.
void test_hold(const char* point, const std::function<void()>& while_held = {});

}  // namespace locus
