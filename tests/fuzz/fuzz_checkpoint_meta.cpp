// Fuzzes the checkpoint metadata reader (lib/train/src/checkpoint/checkpoint_meta.cpp,
// read_checkpoint_meta): every root attribute (format, version, counters, optimizer and
// schedule, dataset identity, config, world and pipeline sizes, provenance, meta_crc32), the
// /model spec attributes and /optimizer state_names, on edits of a valid checkpoint's metadata
// written by the checkpointer's own writers (write_model + write_meta; h5_mutate.hpp).
#include <cstdint>

#include "checkpoint/checkpoint_detail.hpp"
#include "fuzz_support.hpp"
#include "h5_mutate.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/file.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"
#include "locus/train/model/model_file.hpp"

namespace {

using namespace locus;

const fuzz::H5Edits kEdits{
    {"/", "/model", "/optimizer"},
    {"/model", "/optimizer"},
    {"locus-checkpoint", "locus-model", "crc32", "sgd", "adam", "adamw", "cosine", "constant",
     "global", "local", "relu", "gelu", "he", "xavier", "cross_entropy", "mse", "momentum",
     "m,v", ",", ""}};

std::string baseline;

train::CheckpointMeta baseline_meta(const train::Mlp& model) {
  train::CheckpointMeta m;
  m.run_id = "run-0001";
  m.step = 100;
  m.epoch = 2;
  m.step_in_epoch = 5;
  m.samples_in_epoch = 640;
  m.samples_seen = 12800;
  m.steps_per_epoch = 47;
  m.optimizer_steps = 100;
  m.optimizer = "sgd";
  m.schedule = "cosine";
  m.base_lr = 0.05;
  m.total_steps = 564;
  m.lr = 0.04;
  m.global_batch = 128;
  m.shuffle = "global";
  m.loader_seed = 3;
  m.dataset = {"train.h5", 6000, 4, "0123456789abcdef"};
  m.config = "[train]\nepochs = 12\n";
  m.config_hash = "fedcba9876543210";
  m.world_size = 2;
  m.data_parallel = 2;
  m.pipeline_stages = 1;
  m.tool_version = "0.1.0";
  m.git_revision = "abc";
  m.compute = "cpu (OpenBLAS)";
  m.created = 1.7e9;
  m.model = model.spec();
  m.num_classes = 2;
  m.optimizer_state = {"momentum"};
  return m;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const mpi::Comm& world = fuzz::world();
  const fuzz::ScratchFile base("ckpt-baseline.h5");
  const train::Mlp model(train::ModelSpec{{4, 3, 2}, train::Activation::relu,
                                          train::Init::he, 0.0f, 7});
  const train::CheckpointMeta m = baseline_meta(model);
  {
    h5::File f = h5::File::create(world, base.path());
    train::ModelInfo info;
    info.num_classes = m.num_classes;
    train::write_model(f, "/model", model, info);
    h5::write_attr(h5::create_group(f.id(), "/optimizer").get(), "state_names", "momentum");
    train::detail::write_meta(f.id(), m);
    f.close();
  }
  baseline = fuzz::slurp(base.path());
  // The unedited baseline must read back, or every input would only test the CRC check.
  const train::CheckpointMeta back = train::read_checkpoint_meta(world, base.path());
  if (train::meta_text(back) != train::meta_text(m) || back.optimizer_state != m.optimizer_state)
    fuzz::unexpected("baseline", "the checkpoint metadata does not read back");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const fuzz::ScratchFile file("ckpt.h5");
  FuzzedDataProvider fdp(data, size);
  fuzz::write_edited(file.path(), baseline, kEdits, fdp);
  train::CheckpointMeta m;
  const bool accepted =
      fuzz::parses([&] { m = train::read_checkpoint_meta(fuzz::world(), file.path()); });
  fuzz::close_open_h5_objects();
  if (!accepted) return 0;
  if (m.model.widths.size() < 2) fuzz::unexpected("accepted a model of fewer than 2 widths", "");
  return 0;
}
