// Model files (docs/FORMATS.md, "Model files"): an MLP's spec and parameters in HDF5, one
// dataset per tensor named as PyTorch's state_dict (layers.0.weight [out, in], layers.0.bias
// [out], ...), so a model moves between locus and PyTorch through h5py in a few lines.
// Checkpoints hold the same tensors under their /model group.
#pragma once

#include <cstdint>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/io/file.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/model/model.hpp"

namespace locus::io {
class OutputLock;
}

namespace locus::train {

inline constexpr std::int64_t kModelSchemaVersion = 1;
inline constexpr const char* kModelFormat = "locus-model";
inline constexpr const char* kCheckpointFormat = "locus-checkpoint";
// The newest checkpoint format_version this build reads (checkpoint.hpp; here so that a model
// read from a checkpoint's /model group refuses a newer checkpoint as load_checkpoint does).
inline constexpr std::int64_t kCheckpointFormatVersion = 1;

struct ModelInfo {
  ModelSpec spec;                 // widths, activation, init, dropout, seed
  Loss loss = Loss::softmax_cross_entropy;
  std::int64_t num_classes = 0;   // 0 for regression
  std::int64_t trained_steps = 0;
  std::string dataset;            // the training dataset's path
  std::string config;             // effective training config (INI)
  // Filled by read_model_file; write_model records this build's version and revision.
  std::string tool_version;
  std::string git_revision;
};

// Collective over comm: writes `model` to `path` atomically (temporary name, rename) under the
// output's lock: `held` when the caller holds it already (locus-train, for its whole run), else
// one taken here. Every rank passes the same info and its model: the whole model, or with
// pipeline stages the layers it holds (Mlp::held(); together the ranks must hold every layer,
// see write_model).
void write_model_file(const mpi::Comm& comm, const std::string& path, const Mlp& model,
                      const ModelInfo& info, const io::OutputLock* held = nullptr);
// Collective over an open file's communicator: writes the model's tensors and attributes
// under `group` ("/" for a model file, "/model" inside a checkpoint; created if missing).
// Each tensor is written by the ranks holding its layer (every rank for whole models, a pipeline
// stage's replicas otherwise), each its share of the rows: no rank funnels the data, and no
// rank needs the whole model. Held ranges must cover every layer and be equal or disjoint.
// info.spec is ignored: the model's own spec is recorded.
void write_model(h5::File& file, const std::string& group, const Mlp& model,
                 const ModelInfo& info);

// Collective over comm: reads a model file, a checkpoint (its /model group) or an h5py-written
// file in the documented layout; every rank returns the whole model. Each rank reads a share of
// every tensor and the shares are all-gathered. DataError (agreed) naming the file, the tensor
// or attribute and what was expected for anything malformed: missing tensors, wrong shapes,
// non-float or non-finite values, unknown activation/init/loss, a newer schema version.
Mlp read_model_file(const mpi::Comm& comm, const std::string& path, ModelInfo* info = nullptr);

// Collective over the file's communicator: the same, from an open file and group (for a
// checkpoint reader that already holds the file open).
Mlp read_model(h5::File& file, const std::string& group, ModelInfo* info = nullptr);

}  // namespace locus::train
