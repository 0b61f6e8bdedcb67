// The work queue of locus-infer's scoring units is lib/comm's (shared with locus-ingest); these
// names keep infer's spelling of it.
#pragma once

#include "locus/comm/work_queue.hpp"

namespace locus::infer {

using comm::Schedule;
using comm::WorkQueue;

}  // namespace locus::infer
