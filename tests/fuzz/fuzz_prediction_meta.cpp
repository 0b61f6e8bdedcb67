// Fuzzes the prediction-file metadata that `locus-infer --incremental` reads
// (lib/infer/src/prediction_file.cpp, PredictionFile::open): format, schema version, output
// kind, num_outputs, top_k, unit and batch rows, the committed_rows watermark, provenance and
// the datasets' presence and shapes, on edits of a valid file written by
// PredictionFile::create (h5_mutate.hpp).
#include <cstdint>

#include <fmt/format.h>

#include "fuzz_support.hpp"
#include "h5_mutate.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/file.hpp"
#include "locus/infer/prediction_file.hpp"

namespace {

using namespace locus;

const fuzz::H5Edits kEdits{
    {"/"},
    {"/scores", "/predicted", "/topk_classes", "/topk_scores", "/writer"},
    {"locus-predictions", "probabilities", "raw", "logits", "locus-model", ""}};

std::string baseline;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const mpi::Comm& world = fuzz::world();
  const fuzz::ScratchFile base("pred-baseline.h5");
  {
    h5::File f = h5::File::create(world, base.path());
    infer::PredictionLayout layout;
    layout.outputs = 3;
    layout.top_k = 2;
    layout.record_writer = true;
    layout.unit_rows = 4;
    layout.batch_rows = 4;
    const infer::PredictionProvenance prov{"model.h5", "0123456789abcdef", 100, "test.h5",
                                           "/features", "[infer]\n"};
    infer::PredictionFile::create(f, layout, prov, 8);
    h5::write_attr(f.id(), "committed_rows", std::int64_t{5});
    f.close();
  }
  baseline = fuzz::slurp(base.path());
  // The unedited baseline must open, with its watermark.
  h5::File f = h5::File::open(world, base.path(), h5::File::Mode::read_write);
  {
    const infer::PredictionFile p = infer::PredictionFile::open(f);
    if (p.committed_rows() != 5 || p.layout().top_k != 2)
      fuzz::unexpected("baseline", "the prediction file does not read back");
  }
  f.close();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const fuzz::ScratchFile file("pred.h5");
  FuzzedDataProvider fdp(data, size);
  fuzz::write_edited(file.path(), baseline, kEdits, fdp);
  fuzz::parses([&] {
    h5::File f = h5::File::open(fuzz::world(), file.path(), h5::File::Mode::read_write);
    {
      const infer::PredictionFile p = infer::PredictionFile::open(f);
      // What --incremental relies on for a file it accepts.
      const infer::PredictionLayout& l = p.layout();
      if (p.committed_rows() > p.rows() || l.outputs < 1 || l.top_k < 0 || l.unit_rows < 1 ||
          l.batch_rows < 1) {
        fuzz::unexpected("accepted inconsistent prediction metadata",
                         fmt::format("committed {} rows {} outputs {} top_k {} unit_rows {}",
                                     p.committed_rows(), p.rows(), l.outputs, l.top_k,
                                     l.unit_rows));
      }
    }
    f.close();
  });
  return 0;
}
