// Fuzzes the prediction-file metadata that `locus-infer --incremental` reads, through the real
// entry point (run_inference with incremental = true): PredictionFile::open (format, schema
// version, output kind, num_outputs, top_k, unit and batch rows, the committed_rows watermark,
// provenance, the datasets' presence and shapes) and run_incremental's checks against the
// model and input, then the scoring of the rows beyond the watermark. Each input edits a valid
// prediction file (8 rows, 5 committed) written by a full run (h5_mutate.hpp).
#include <hdf5.h>

#include <cstdint>
#include <cstdlib>
#include <vector>

#include <fmt/format.h>

#include "fuzz_support.hpp"
#include "h5_mutate.hpp"
#include "locus/infer/infer.hpp"
#include "locus/io/attribute.hpp"
#include "locus/train/model/model_file.hpp"

namespace {

using namespace locus;

const fuzz::H5Edits kEdits{
    {"/"},
    {"/scores", "/predicted", "/topk_classes", "/topk_scores", "/writer"},
    {"locus-predictions", "probabilities", "raw", "logits", "locus-model", "model.h5", ""}};

constexpr std::uint64_t kRows = 8, kCommitted = 5;

std::string baseline;
infer::InferOptions options;

// An 8 x 4 float input with labels, as any HDF5 writer would produce it (no locus attributes).
void write_input(const std::string& path) {
  h5::Id f(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, H5P_DEFAULT));
  std::vector<float> x(kRows * 4);
  std::vector<std::int32_t> y(kRows);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.125f * static_cast<float>(i % 7);
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>(i % 3);
  const hsize_t dims[2] = {kRows, 4};
  h5::Id xs(H5Screate_simple(2, dims, nullptr)), ys(H5Screate_simple(1, dims, nullptr));
  h5::Id xd(H5Dcreate2(f.get(), "/features", H5T_IEEE_F32LE, xs.get(), H5P_DEFAULT, H5P_DEFAULT,
                       H5P_DEFAULT));
  h5::Id yd(H5Dcreate2(f.get(), "/labels", H5T_STD_I32LE, ys.get(), H5P_DEFAULT, H5P_DEFAULT,
                       H5P_DEFAULT));
  if (!f || !xd || !yd ||
      H5Dwrite(xd.get(), H5T_NATIVE_FLOAT, H5S_ALL, H5S_ALL, H5P_DEFAULT, x.data()) < 0 ||
      H5Dwrite(yd.get(), H5T_NATIVE_INT32, H5S_ALL, H5S_ALL, H5P_DEFAULT, y.data()) < 0)
    fuzz::unexpected("baseline", "cannot write the input file");
}

void set_committed(const std::string& path, std::int64_t rows) {
  h5::Id f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
  if (!f) fuzz::unexpected("baseline", "cannot reopen the prediction file");
  h5::write_attr(f.get(), "committed_rows", rows);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ::setenv("OPENBLAS_NUM_THREADS", "1", 0);
  const mpi::Comm& world = fuzz::world();
  static const fuzz::ScratchFile model("pred-model.h5"), input("pred-input.h5"),
      base("pred-baseline.h5"), report("pred-report.json");
  train::ModelInfo info;
  info.num_classes = 3;
  train::write_model_file(world, model.path(),
                          train::Mlp(train::ModelSpec{{4, 5, 3}, train::Activation::tanh,
                                                      train::Init::xavier, 0.0f, 7}),
                          info);
  write_input(input.path());
  options.model = model.path();
  options.input = input.path();
  options.report = report.path();
  options.output = base.path();
  options.top_k = 2;
  options.batch_rows = 2;
  options.unit_rows = 2;
  options.record_writer = true;
  options.speculate = false;
  infer::run_inference(world, options);
  set_committed(base.path(), kCommitted);
  baseline = fuzz::slurp(base.path());
  // The unedited baseline must extend: rows [5, 8) are scored again.
  options.incremental = true;
  const infer::InferResult r = infer::run_inference(world, options);
  if (r.row_begin != kCommitted || r.row_end != kRows)
    fuzz::unexpected("baseline", fmt::format("incremental run scored [{}, {})", r.row_begin, r.row_end));
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const fuzz::ScratchFile file("pred.h5");
  FuzzedDataProvider fdp(data, size);
  fuzz::write_edited(file.path(), baseline, kEdits, fdp);
  infer::InferOptions opts = options;
  opts.output = file.path();
  infer::InferResult r;
  const bool accepted = fuzz::parses([&] { r = infer::run_inference(fuzz::world(), opts); });
  fuzz::close_open_h5_objects();
  if (!accepted) return 0;
  // An accepted file is extended from its watermark to the end of the input.
  if (r.row_begin > kRows || r.row_end != kRows || r.units_written_once != r.units)
    fuzz::unexpected("accepted prediction file gave an inconsistent run",
                     fmt::format("rows [{}, {}), {} units, {} written once", r.row_begin,
                                 r.row_end, r.units, r.units_written_once));
  return 0;
}
