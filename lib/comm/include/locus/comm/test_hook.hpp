// Fault-injection points for tests. `LOCUS_TEST_HOOK=<point>:<action>[@rank]` makes the
// process act at the named point: `kill` (SIGKILL itself), `exit` (_Exit(9)) or `sleep<N>`
// (pause N seconds). Without the variable a hook costs one getenv at first use.
#pragma once

namespace locus {

// Acts if LOCUS_TEST_HOOK names `point` (and this world rank, when `@rank` is given).
void test_hook(const char* point);

}  // namespace locus
