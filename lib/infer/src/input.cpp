// Input validation for inference and the model fingerprint.
#include "input.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstring>

#include "locus/comm/agree.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"

namespace locus::infer::detail {

namespace {

std::uint64_t chunk_rows_of(const h5::Dataset& d) {
  h5::Id dcpl(LOCUS_H5_CHECK(H5Dget_create_plist(d.id())));
  if (H5Pget_layout(dcpl.get()) != H5D_CHUNKED) return 1;
  std::array<hsize_t, 2> chunk{1, 1};
  LOCUS_H5_CHECK(H5Pget_chunk(dcpl.get(), 2, chunk.data()));
  return std::max<std::uint64_t>(chunk[0], 1);
}

bool is_integer(h5::Dtype t) {
  return t == h5::Dtype::i32 || t == h5::Dtype::i64 || t == h5::Dtype::u8;
}

}  // namespace

InputInfo inspect_input(const mpi::Comm& comm, const InferOptions& opts, const train::Mlp& model,
                        const std::string& model_path) {
  h5::File file = h5::File::open(comm, opts.input, h5::File::Mode::read);
  InputInfo info;
  mpi::agree_on(comm, [&] {
    const std::string& path = opts.input;
    if (!h5::exists(file.id(), opts.features)) {
      throw DataError(fmt::format("input '{}' has no dataset '{}'; set infer.features to the "
                                  "float [N, D] features dataset (h5ls {} lists them)",
                                  path, opts.features, path));
    }
    h5::Dataset f = h5::Dataset::open(file, opts.features);
    if (f.cols() == 0 || (f.dtype() != h5::Dtype::f32 && f.dtype() != h5::Dtype::f64)) {
      throw DataError(fmt::format("input '{}': dataset '{}' is {} {}; expected float32 "
                                  "[N, D] features",
                                  path, opts.features, h5::dtype_name(f.dtype()),
                                  f.cols() == 0 ? fmt::format("[{}]", f.rows())
                                                : fmt::format("[{}, {}]", f.rows(), f.cols())));
    }
    const int width = model.layout().input_width();
    if (f.cols() != static_cast<std::uint64_t>(width)) {
      throw DataError(fmt::format(
          "feature-width mismatch: input '{}' dataset '{}' has {} features per row, but model "
          "'{}' (widths {}) expects {}; score data prepared like the model's training set",
          path, opts.features, f.cols(), model_path, train::format_widths(model.layout().widths()),
          width));
    }
    info.rows = f.rows();
    const hid_t root = file.id();
    const bool locus_dataset = h5::has_attr(root, "locus_format") &&
                               h5::read_attr<std::string>(root, "locus_format") == "locus-dataset";
    if (locus_dataset) {
      const auto committed = h5::read_attr<std::int64_t>(root, "committed_rows");
      if (committed < 0 || static_cast<std::uint64_t>(committed) > f.rows()) {
        throw DataError(fmt::format("input '{}': committed_rows = {} but '{}' has {} rows; the "
                                    "file is damaged, re-ingest it",
                                    path, committed, opts.features, f.rows()));
      }
      info.rows = static_cast<std::uint64_t>(committed);
    }
    if (info.rows == 0) {
      throw DataError(fmt::format("input '{}' has no rows to score ('{}' is empty{}); check "
                                  "infer.input (an ingest that published nothing?)",
                                  path, opts.features,
                                  locus_dataset ? " below committed_rows" : ""));
    }
    h5::check_stored(f.id(), info.rows, path, opts.features);
    info.chunk_rows = chunk_rows_of(f);
    if (opts.labels.empty() || !h5::exists(root, opts.labels)) return;
    h5::Dataset l = h5::Dataset::open(file, opts.labels);
    // As the trainer's loader: a locus dataset may hold uncommitted rows past committed_rows
    // in both datasets; in any other file labels and features describe the same samples.
    const bool rows_ok = locus_dataset ? l.rows() >= info.rows : l.rows() == info.rows;
    if (l.cols() != 0 || !is_integer(l.dtype()) || !rows_ok) {
      throw DataError(fmt::format("input '{}': labels dataset '{}' is {} [{}{}]; expected "
                                  "integer labels [N] with N {} {}, one per row of '{}' (set "
                                  "infer.labels to another dataset, or to nothing to skip "
                                  "metrics)",
                                  path, opts.labels, h5::dtype_name(l.dtype()), l.rows(),
                                  l.cols() == 0 ? "" : fmt::format(", {}", l.cols()),
                                  locus_dataset ? ">=" : "=", info.rows, opts.features));
    }
    h5::check_stored(l.id(), info.rows, path, opts.labels);
    info.has_labels = true;
  });
  mpi::agree_on(comm, [&] { file.close(); });
  return info;
}

LocalInput::LocalInput(const std::string& path, const std::string& features,
                       const std::string& labels, int read_threads) {
  h5::init();
  file_ = h5::Id(LOCUS_H5_CHECK(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)));
  // No chunk cache: every chunk is read once, straight into the unit's buffer (a cached chunk
  // would be read into the cache and then copied).
  h5::Id dapl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_ACCESS)));
  LOCUS_H5_CHECK(H5Pset_chunk_cache(dapl.get(), 0, 0, H5D_CHUNK_CACHE_W0_DEFAULT));
  features_ = h5::Id(LOCUS_H5_CHECK(H5Dopen2(file_.get(), features.c_str(), dapl.get())));
  if (!labels.empty())
    labels_ = h5::Id(LOCUS_H5_CHECK(H5Dopen2(file_.get(), labels.c_str(), dapl.get())));
  rows_ = std::make_unique<io::RowReader>(file_.get(), features_.get(), read_threads);
}

void LocalInput::read(std::uint64_t first_row, std::span<float> x, std::span<std::int32_t> y) {
  rows_->read(first_row, x);
  if (!y.empty()) read_labels(first_row, y);
}

void LocalInput::read_labels(std::uint64_t first_row, std::span<std::int32_t> y) {
  if (y.empty()) return;
  const std::array<hsize_t, 1> start{first_row}, count{y.size()};
  h5::Id file_space(LOCUS_H5_CHECK(H5Dget_space(labels_.get())));
  LOCUS_H5_CHECK(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr,
                                     count.data(), nullptr));
  h5::Id mem_space(LOCUS_H5_CHECK(H5Screate_simple(1, count.data(), nullptr)));
  LOCUS_H5_CHECK(H5Dread(labels_.get(), H5T_NATIVE_INT32, mem_space.get(), file_space.get(),
                         H5P_DEFAULT, y.data()));
}

int auto_read_threads(bool cuda, int rank_cpus) {
  if (!cuda) return 1;
  return std::clamp(rank_cpus - 2, 1, 8);
}

int cpu_share(int own, int node_union, int ranks_on_node) {
  return std::max(std::min(own, node_union / std::max(ranks_on_node, 1)), 1);
}

std::string model_fingerprint(const train::Mlp& model) {
  std::uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, 64 bit
  auto mix = [&h](const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  };
  for (int w : model.layout().widths()) mix(&w, sizeof w);
  const std::string_view act = train::to_string(model.spec().activation);
  mix(act.data(), act.size());
  const auto params = model.params();
  mix(params.data(), params.size_bytes());
  return fmt::format("{:016x}", h);
}

}  // namespace locus::infer::detail
