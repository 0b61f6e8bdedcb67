// Fuzzes the model-file reader (lib/train/src/model/model_file.cpp, read_model_file): the
// format, schema and spec attributes (widths, activation, init, dropout, seed, loss,
// num_classes, provenance) and the tensor layout, on edits of a valid 4-3-2 model file
// written by write_model_file (h5_mutate.hpp).
#include <cmath>
#include <cstdint>
#include <optional>

#include <fmt/format.h>

#include "fuzz_support.hpp"
#include "h5_mutate.hpp"
#include "locus/train/model/model_file.hpp"

namespace {

using namespace locus;

const fuzz::H5Edits kEdits{
    {"/"},
    {"/layers.0.weight", "/layers.0.bias", "/layers.1.weight", "/layers.1.bias"},
    {"locus-model", "locus-checkpoint", "relu", "gelu", "tanh", "he", "xavier", "cross_entropy",
     "mse", "sigmoid", ""}};

std::string baseline;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const mpi::Comm& world = fuzz::world();
  const fuzz::ScratchFile base("model-baseline.h5");
  const train::Mlp model(train::ModelSpec{{4, 3, 2}, train::Activation::relu,
                                          train::Init::he, 0.0f, 7});
  train::ModelInfo info;
  info.num_classes = 2;
  info.dataset = "train.h5";
  info.config = "[model]\nwidths = 4,3,2\n";
  train::write_model_file(world, base.path(), model, info);
  baseline = fuzz::slurp(base.path());
  // The unedited baseline must read back: a harness that only ever sees errors tests nothing.
  const train::Mlp back = train::read_model_file(world, base.path());
  if (back.spec().widths != model.spec().widths) fuzz::unexpected("baseline", "widths differ");
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const fuzz::ScratchFile file("model.h5");
  FuzzedDataProvider fdp(data, size);
  fuzz::write_edited(file.path(), baseline, kEdits, fdp);
  train::ModelInfo info;
  std::optional<train::Mlp> model;
  const auto read = [&] { model.emplace(train::read_model_file(fuzz::world(), file.path(), &info)); };
  const bool accepted = fuzz::parses(read);
  fuzz::close_open_h5_objects();
  if (!accepted) return 0;
  // What the reader promises about a model it accepts.
  const auto& w = model->spec().widths;
  if (w.size() < 2 || info.spec.widths != w ||
      (info.loss == train::Loss::softmax_cross_entropy && info.num_classes != w.back())) {
    fuzz::unexpected("accepted an inconsistent model", fmt::format("widths {}", w.size()));
  }
  for (const float p : model->params())
    if (!std::isfinite(p)) fuzz::unexpected("accepted a non-finite parameter", "");
  return 0;
}
