// Node-local staging of a training set (LoaderOptions::stage_dir): before the first step every
// node copies the rows its ranks will read into a staged HDF5 file in stage_dir, each source
// byte read once per node with the copy shared among the node's ranks; the loader then reads
// batches from the staged copy, bitwise the same as from the source.
//
// Which rows a node stages: under global shuffle the whole dataset (every rank may need any
// row); under local (and none) the union of its ranks' partitions h5::partition_rows(N, r, P)
// -- one contiguous range when the node's ranks are consecutive. The staged file holds those
// rows, in source order, as /features [M, D] float32 and /labels [M] int32 (contiguous), with a
// manifest in root attributes (docs/FORMATS.md "Staged copy"): the source's path and identity
// (size, mtime, inode, rows), the row ranges, the shuffle mode, the world layout, and the
// CRC-32 of the staged bytes.
//
// The file is <stage_dir>/locus-stage-<hash>-node<i>.h5: hash = FNV-1a of the source's real
// path and dataset names, i = the node's index (comm::Topology). The node index in the name
// keeps emulated nodes on one host (LOCUS_TEST_RANKS_PER_NODE, scripts/slurm-cluster.sh
// --nodes) and a stage_dir that happens to be shared from overwriting each other's copies.
//
// Reuse (a requeued or resumed job): a node keeps its existing copy when the manifest matches
// (same source identity, the same rows) and the CRC-32 of its bytes, recomputed by the node's
// ranks, matches the manifest; otherwise it is rebuilt. A copy is built under a temporary name
// (<file>.tmp.<pid>), synced, and renamed only when complete: a crash mid-stage leaves a
// temporary file that no run trusts (the next build of that node removes it). Free space is
// checked first (statvfs; the test-only LOCUS_TEST_STAGE_FREE_BYTES=B pretends B bytes free).
#pragma once

#include <cstdint>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train {

struct StageReport {
  bool staged = false;
  std::string path;            // this node's staged file
  int nodes = 0;               // nodes of the loader's communicator
  int reused_nodes = 0;        // nodes that kept a verified copy
  std::string reason;          // why node 0 rebuilt ("" when it reused its copy)
  std::uint64_t node_bytes = 0;  // bytes of node 0's staged rows
  std::uint64_t source_bytes_read = 0;  // bytes read from the source, all nodes together
  double seconds = 0;          // staging (or verification) time, slowest rank
  // "staged the training data on 2 nodes in 0.31 s (...)": one line for the log.
  std::string describe() const;
};

// The staged file of node `node_index` for `opts` (stage_dir must be set).
std::string staged_file_path(const LoaderOptions& opts, int node_index);

// Collective over comm (the loader's communicator), after every Loader of the staged data on
// comm is destroyed: unless opts.stage_keep (or stage_dir is ""), the leader of each node
// removes its node's staged file. Returns whether anything was removed on any node. Apps call
// it at the successful end of a run only: a preempted job keeps its copy for the requeue.
bool remove_staged_copy(const mpi::Comm& comm, const LoaderOptions& opts);

}  // namespace locus::train
