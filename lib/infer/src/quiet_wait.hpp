// Quiet waits (private): lib/comm's, under the names the scoring loop uses.
#pragma once

#include "locus/comm/quiet_wait.hpp"

namespace locus::infer::detail {

using comm::on_root_quietly;
using comm::quiet_barrier;

}  // namespace locus::infer::detail
