// The commands of locus-ckpt: list, verify, inspect, export and diff of checkpoint files
// (docs/FORMATS.md, "Checkpoint files"). Each is collective over the world: every rank reads
// its share of every tensor; rank 0 prints.
#pragma once

#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"

namespace locus::app {

// Exit code of `diff` when the checkpoints differ (as diff(1)).
inline constexpr int kExitDiffer = 1;

int ckpt_list(const mpi::Comm& world, const std::string& dir);
int ckpt_verify(const mpi::Comm& world, const std::vector<std::string>& paths);
int ckpt_inspect(const mpi::Comm& world, const std::string& path);
int ckpt_export(const mpi::Comm& world, const std::string& checkpoint, const std::string& out);
int ckpt_diff(const mpi::Comm& world, const std::string& a, const std::string& b,
              double tolerance);

}  // namespace locus::app
