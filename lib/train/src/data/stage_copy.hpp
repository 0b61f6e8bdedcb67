// Node-local staging (private): builds or reuses a node's staged copy of the training set
// (see locus/train/data/stage.hpp) and maps source rows to the copy's rows for the loader.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/comm/topology.hpp"
#include "locus/io/dataset.hpp"
#include "locus/train/data/loader.hpp"
#include "locus/train/data/stage.hpp"

namespace locus::train::detail {

struct StagedCopy {
  explicit StagedCopy(const mpi::Comm& comm) : topo(comm) {}

  comm::Topology topo;                // the loader reads the copy over topo.node()
  std::string path;                   // this node's staged file
  std::vector<h5::RowRange> ranges;   // source rows held, ascending, stored in this order
  std::uint64_t source_rows = 0;      // N of the source
  std::uint64_t staged_rows = 0;      // M: the rows in ranges
  bool has_labels = false;            // the copy has /labels (it always names its datasets
                                      // /features and /labels, whatever the source's names)
  StageReport report;

  // The copy's row of source row `row`, for a run of `count` rows that must lie inside one of
  // the held ranges (an internal invariant: a rank reads only rows its node staged).
  std::uint64_t to_staged(std::uint64_t row, std::uint64_t count) const;
};

// Collective over comm (the loader's communicator): stages opts.path into opts.stage_dir on
// every node, or verifies and reuses a node's existing copy. Errors (stage_dir missing: a
// ConfigError; not writable, too small, a failed write: IoError; a bad source: DataError) are
// agreed on every rank, and leave no staged file behind.
std::unique_ptr<StagedCopy> stage_dataset(const mpi::Comm& comm, const LoaderOptions& opts);

}  // namespace locus::train::detail
