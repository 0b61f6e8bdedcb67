// Private to lib/train: which ranks of a communicator hold which layers (Mlp::held()), so that
// model files and checkpoints -- global tensors, independent of the grid -- are written and
// read by the ranks that hold each tensor, every tensor's rows split over its holders.
#pragma once

#include <cstdint>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/io/dataset.hpp"
#include "locus/train/model/model.hpp"

namespace locus::train::detail {

class LayerOwners {
 public:
  // Collective over comm: all-gathers every rank's held range. Every layer of a model of
  // `layers` layers must be held by some rank, and two ranks' ranges must be equal or disjoint
  // (stage replicas, or whole models): asserted, alike on every rank.
  LayerOwners(const mpi::Comm& comm, LayerRange mine, int layers);

  // This rank's rows of a tensor of `rows` rows belonging to `layer`: its balanced share
  // (h5::partition_rows) among the ranks holding the layer, in rank order, so the shares of
  // the holders in rank order are the tensor's rows in order; empty where this rank does not
  // hold the layer.
  h5::RowRange rows(int layer, std::uint64_t rows) const;
  // Ranks holding `layer`.
  int holders(int layer) const;
  // Every rank holds every layer (no pipeline stages).
  bool all_whole() const noexcept { return all_whole_; }

  // Collective over comm: the ranks holding this rank's range, in comm's rank order (comm
  // itself, borrowed, when every rank holds the whole model).
  mpi::Comm group(const mpi::Comm& comm) const;

 private:
  std::vector<LayerRange> ranges_;  // by rank
  int rank_ = 0;
  bool all_whole_ = true;
};

}  // namespace locus::train::detail
