// Model files (docs/FORMATS.md, "Model files"): an MLP's spec and parameters in HDF5, one
// dataset per tensor named as PyTorch's state_dict (layers.0.weight [out, in], layers.0.bias
// [out], ...), so a model moves between locus and PyTorch through h5py in a few lines.
// Checkpoints hold the same tensors under their /model group.
#pragma once

#include <cstdint>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/io/file.hpp"
#include "locus/train/loss.hpp"
#include "locus/train/model.hpp"

namespace locus::train {

struct ModelInfo {
  ModelSpec spec;                 // widths, activation, init, dropout, seed
  Loss loss = Loss::softmax_cross_entropy;
  std::int64_t num_classes = 0;   // 0 for regression
  std::int64_t trained_steps = 0;
  std::string dataset;            // the training dataset's path
  std::string config;             // effective training config (INI)
};

// Collective over comm: writes `model` to `path` atomically (temporary name, rename).
void write_model_file(const mpi::Comm& comm, const std::string& path, const Mlp& model,
                      const ModelInfo& info);
// Collective over an open file's communicator: writes the model's tensors and attributes
// under `group` ("/" for a model file, "/model" inside a checkpoint).
void write_model(h5::File& file, const std::string& group, const Mlp& model,
                 const ModelInfo& info);

// Collective over comm: reads a model file, a checkpoint (its /model group) or an h5py-written
// file in the documented layout. DataError naming the file for anything malformed.
Mlp read_model_file(const mpi::Comm& comm, const std::string& path, ModelInfo* info = nullptr);

}  // namespace locus::train
