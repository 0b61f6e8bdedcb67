// The data-parallel × pipeline process grid (see grid.hpp for the rank layout).
#include "locus/train/grid.hpp"

#include <fmt/format.h>

#include "locus/comm/error.hpp"

namespace locus::train {

namespace {

// Every rank sees the same world size and the same option, so every rank throws alike.
mpi::Comm checked_dup(const mpi::Comm& world, int stages) {
  if (stages < 1) {
    throw ConfigError(fmt::format("train.pipeline_stages = {} is invalid: use 1 (pure data "
                                  "parallelism) or more",
                                  stages));
  }
  if (world.size() % stages != 0) {
    throw ConfigError(fmt::format("train.pipeline_stages = {} does not divide the {} ranks of "
                                  "this job: run with a multiple of {} ranks, or set "
                                  "pipeline_stages to a divisor of {}",
                                  stages, world.size(), stages, world.size()));
  }
  return world.dup();
}

}  // namespace

Grid::Grid(const mpi::Comm& world, int pipeline_stages)
    : world_(checked_dup(world, pipeline_stages)),
      dp_(world_.split(/*color=*/world_.rank() % pipeline_stages, world_.rank())),
      pp_(world_.split(/*color=*/world_.rank() / pipeline_stages, world_.rank())) {
  LOCUS_ASSERT(dp_.size() * pp_.size() == world_.size(),
               fmt::format("grid {} x {} does not cover {} ranks", dp_.size(), pp_.size(),
                           world_.size()));
  LOCUS_ASSERT(world_.rank() == dp_.rank() * pp_.size() + pp_.rank(),
               "the grid's rank layout is not dp_rank * stages + stage");
}

std::string Grid::describe() const {
  return fmt::format("{} rank{} = {} data-parallel x {} pipeline stage{}", world_.size(),
                     world_.size() == 1 ? "" : "s", data_parallel(), pipeline_stages(),
                     pipeline_stages() == 1 ? "" : "s");
}

}  // namespace locus::train
