// The prediction file layout: collective creation and growth, independent unit writes, and the
// durable committed_rows watermark.
#include "locus/infer/prediction_file.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <array>
#include <climits>

#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/config.hpp"
#include "locus/infer/infer.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/publish.hpp"
#include "quiet_wait.hpp"

namespace locus::infer {

namespace {

constexpr const char* kScores = "/scores";
constexpr const char* kPredicted = "/predicted";
constexpr const char* kTopkClasses = "/topk_classes";
constexpr const char* kTopkScores = "/topk_scores";
constexpr const char* kWriter = "/writer";

// /writer is the one dataset with a fill value (-1): a row nobody wrote stands out.
h5::Dataset create_writer(h5::File& file, std::uint64_t rows, std::uint64_t chunk_rows) {
  const hsize_t dims = rows, maxdims = H5S_UNLIMITED, chunk = chunk_rows;
  h5::Id space(LOCUS_H5_CHECK(H5Screate_simple(1, &dims, &maxdims)));
  h5::Id dcpl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
  LOCUS_H5_CHECK(H5Pset_chunk(dcpl.get(), 1, &chunk));
  const std::int32_t fill = -1;
  LOCUS_H5_CHECK(H5Pset_fill_value(dcpl.get(), H5T_NATIVE_INT32, &fill));
  LOCUS_H5_CHECK(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_ALLOC));
  LOCUS_H5_CHECK(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY));
  h5::Id id(LOCUS_H5_CHECK(H5Dcreate2(file.id(), kWriter, H5T_STD_I32LE, space.get(),
                                      H5P_DEFAULT, dcpl.get(), H5P_DEFAULT)));
  id.reset();
  return h5::Dataset::open(file, kWriter);
}

h5::Id independent_dxpl() {
  h5::Id dxpl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_XFER)));
  LOCUS_H5_CHECK(H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_INDEPENDENT));
  return dxpl;
}

void write_layout(hid_t root, const PredictionLayout& l) {
  h5::write_attr(root, "locus_format", kPredictionFormat);
  h5::write_attr(root, "schema_version", kPredictionSchemaVersion);
  h5::write_attr(root, "kind", std::string(to_string(l.kind)));
  h5::write_attr(root, "num_outputs", static_cast<std::int64_t>(l.outputs));
  h5::write_attr(root, "top_k", static_cast<std::int64_t>(l.top_k));
  h5::write_attr(root, "unit_rows", static_cast<std::int64_t>(l.unit_rows));
  h5::write_attr(root, "batch_rows", static_cast<std::int64_t>(l.batch_rows));
  h5::write_attr(root, "tool_version", LOCUS_VERSION);
  h5::write_attr(root, "git_revision", LOCUS_GIT_REVISION);
}

PredictionLayout read_layout(h5::File& file) {
  const hid_t root = file.id();
  if (!h5::has_attr(root, "locus_format") ||
      h5::read_attr<std::string>(root, "locus_format") != kPredictionFormat) {
    throw DataError(fmt::format("'{}' is not a locus prediction file (no locus_format = \"{}\"); "
                                "choose another output, or pass --overwrite to replace it",
                                file.path(), kPredictionFormat));
  }
  const auto version = h5::read_attr<std::int64_t>(root, "schema_version");
  if (version > kPredictionSchemaVersion) {
    throw DataError(fmt::format("'{}' has prediction schema version {}, newer than this locus "
                                "writes ({}); upgrade locus or pass --overwrite",
                                file.path(), version, kPredictionSchemaVersion));
  }
  PredictionLayout l;
  try {
    l.kind = parse_output_kind(h5::read_attr<std::string>(root, "kind"));
  } catch (const ConfigError& e) {
    throw DataError(fmt::format("'{}': {}", file.path(), e.what()));
  }
  // Range-checked as stored, before narrowing: a negative unit_rows must not become 2^64 - 1.
  const auto outputs = h5::read_attr<std::int64_t>(root, "num_outputs");
  const auto top_k = h5::read_attr<std::int64_t>(root, "top_k");
  const auto unit_rows = h5::read_attr<std::int64_t>(root, "unit_rows");
  const auto batch_rows = h5::read_attr<std::int64_t>(root, "batch_rows");
  if (unit_rows < 1 || batch_rows < 1 || batch_rows > kMaxBatchRows || outputs < 1 ||
      outputs > INT_MAX || top_k < 0 || top_k > outputs) {
    throw DataError(fmt::format("'{}' has unit_rows {}, batch_rows {}, num_outputs {}, top_k {}: "
                                "the file is damaged; pass --overwrite to score everything again",
                                file.path(), unit_rows, batch_rows, outputs, top_k));
  }
  l.outputs = static_cast<int>(outputs);
  l.top_k = static_cast<int>(top_k);
  l.unit_rows = static_cast<std::uint64_t>(unit_rows);
  l.batch_rows = static_cast<std::uint64_t>(batch_rows);
  l.record_writer = h5::exists(root, kWriter);
  return l;
}

void check_shape(const std::string& path, const h5::Dataset& d, std::uint64_t cols,
                 std::uint64_t rows) {
  if (d.cols() != cols || d.rows() < rows) {
    throw DataError(fmt::format("'{}': dataset '{}' has shape [{}, {}]; expected at least {} rows "
                                "x {} columns; the file is damaged: pass --overwrite",
                                path, d.name(), d.rows(), d.cols(), rows, cols));
  }
}

}  // namespace

void write_rows_independent(const h5::Dataset& dset, std::uint64_t first_row,
                            std::uint64_t rows, hid_t mem_type, const void* data, hid_t dxpl) {
  if (rows == 0) return;
  LOCUS_ASSERT(first_row + rows <= dset.rows(),
               fmt::format("writing rows [{}, {}) of '{}' which has {} rows", first_row,
                           first_row + rows, dset.name(), dset.rows()));
  const int rank = dset.cols() == 0 ? 1 : 2;
  const std::array<hsize_t, 2> start{first_row, 0}, count{rows, dset.cols()};
  h5::Id filespace(LOCUS_H5_CHECK(H5Dget_space(dset.id())));
  LOCUS_H5_CHECK(H5Sselect_hyperslab(filespace.get(), H5S_SELECT_SET, start.data(), nullptr,
                                     count.data(), nullptr));
  h5::Id memspace(LOCUS_H5_CHECK(H5Screate_simple(rank, count.data(), nullptr)));
  LOCUS_H5_WRITE_CHECK(h5::detail::file_of(dset.id()),
                       H5Dwrite(dset.id(), mem_type, memspace.get(), filespace.get(), dxpl, data));
}

PredictionFile::PredictionFile(h5::File& file, PredictionLayout layout, h5::Dataset values)
    : file_(&file), layout_(layout), values_(std::move(values)), dxpl_(independent_dxpl()),
      writeback_fd_(::open(file.path().c_str(), O_RDONLY | O_CLOEXEC)) {}

PredictionFile PredictionFile::create(h5::File& file, const PredictionLayout& layout,
                                      const PredictionProvenance& prov, std::uint64_t rows) {
  const std::uint64_t chunk = layout.unit_rows;
  auto make = [&](const char* name, h5::Dtype t, std::uint64_t cols) {
    return h5::Dataset::create(file, {.name = name, .dtype = t, .rows = rows, .cols = cols,
                                      .chunk_rows = chunk, .extendible = true});
  };
  const auto c = static_cast<std::uint64_t>(layout.outputs);
  const auto k = static_cast<std::uint64_t>(layout.top_k);
  PredictionFile p(file, layout, make(kScores, h5::Dtype::f32, c));
  if (layout.kind == OutputKind::probabilities) p.predicted_ = make(kPredicted, h5::Dtype::i32, 0);
  if (k > 0) {
    p.topk_index_ = make(kTopkClasses, h5::Dtype::i32, k);
    p.topk_value_ = make(kTopkScores, h5::Dtype::f32, k);
  }
  if (layout.record_writer) p.writer_ = create_writer(file, rows, chunk);
  write_layout(file.id(), layout);
  p.write_provenance(prov);
  h5::write_attr(file.id(), "committed_rows", std::int64_t{0});
  return p;
}

PredictionFile PredictionFile::open(h5::File& file) {
  PredictionLayout layout;
  PredictionProvenance prov;
  std::uint64_t committed = 0;
  mpi::agree_on(file.comm(), [&] {
    layout = read_layout(file);
    const hid_t root = file.id();
    committed = static_cast<std::uint64_t>(h5::read_attr<std::int64_t>(root, "committed_rows"));
    prov.model = h5::read_attr<std::string>(root, "model");
    prov.model_fingerprint = h5::read_attr<std::string>(root, "model_fingerprint");
    prov.model_trained_steps = h5::read_attr<std::int64_t>(root, "model_trained_steps");
    prov.input = h5::read_attr<std::string>(root, "input");
    prov.features = h5::read_attr<std::string>(root, "input_features");
    prov.config = h5::read_attr<std::string>(root, "config");
    for (const char* name : {kScores, kPredicted, kTopkClasses, kTopkScores}) {
      const bool needed = name == kScores ||
                          (name == kPredicted && layout.kind == OutputKind::probabilities) ||
                          (layout.top_k > 0 && name != kPredicted);
      if (needed && !h5::exists(root, name)) {
        throw DataError(fmt::format("'{}' has no dataset '{}'; the file is damaged: pass "
                                    "--overwrite to score everything again", file.path(), name));
      }
    }
  });
  PredictionFile p(file, layout, h5::Dataset::open(file, kScores));
  p.prov_ = std::move(prov);
  p.committed_ = committed;
  if (layout.kind == OutputKind::probabilities) p.predicted_ = h5::Dataset::open(file, kPredicted);
  if (layout.top_k > 0) {
    p.topk_index_ = h5::Dataset::open(file, kTopkClasses);
    p.topk_value_ = h5::Dataset::open(file, kTopkScores);
  }
  if (layout.record_writer) p.writer_ = h5::Dataset::open(file, kWriter);
  mpi::agree_on(file.comm(), [&] {
    const auto k = static_cast<std::uint64_t>(layout.top_k);
    check_shape(file.path(), p.values_, static_cast<std::uint64_t>(layout.outputs), committed);
    if (p.predicted_) check_shape(file.path(), *p.predicted_, 0, committed);
    if (p.topk_index_) check_shape(file.path(), *p.topk_index_, k, committed);
    if (p.topk_value_) check_shape(file.path(), *p.topk_value_, k, committed);
    if (p.writer_) check_shape(file.path(), *p.writer_, 0, committed);
    // Created and resized together: rows of one dataset are written to all of them.
    for (const auto* d : {&p.predicted_, &p.topk_index_, &p.topk_value_, &p.writer_}) {
      if (*d && (*d)->rows() != p.values_.rows()) {
        throw DataError(fmt::format("'{}': dataset '{}' has {} rows but '{}' has {}; the file is "
                                    "damaged: pass --overwrite", file.path(), (*d)->name(),
                                    (*d)->rows(), p.values_.name(), p.values_.rows()));
      }
    }
  });
  return p;
}

void PredictionFile::resize(std::uint64_t rows) {
  values_.resize(rows);
  for (auto* d : {&predicted_, &topk_index_, &topk_value_, &writer_})
    if (*d) (*d)->resize(rows);
}

void PredictionFile::write_provenance(const PredictionProvenance& prov) {
  const hid_t root = file_->id();
  h5::write_attr(root, "model", prov.model);
  h5::write_attr(root, "model_fingerprint", prov.model_fingerprint);
  h5::write_attr(root, "model_trained_steps", prov.model_trained_steps);
  h5::write_attr(root, "input", prov.input);
  h5::write_attr(root, "input_features", prov.features);
  h5::write_attr(root, "config", prov.config);
  prov_ = prov;
}

void PredictionFile::write(std::uint64_t first_row, const Scores& s, int writer_rank) {
  const auto c = static_cast<std::uint64_t>(layout_.outputs);
  const std::uint64_t n = s.values.size() / c;
  const hid_t x = dxpl_.get();
  write_rows_independent(values_, first_row, n, H5T_NATIVE_FLOAT, s.values.data(), x);
  if (predicted_)
    write_rows_independent(*predicted_, first_row, n, H5T_NATIVE_INT32, s.predicted.data(), x);
  if (topk_index_) {
    write_rows_independent(*topk_index_, first_row, n, H5T_NATIVE_INT32, s.topk_index.data(), x);
    write_rows_independent(*topk_value_, first_row, n, H5T_NATIVE_FLOAT, s.topk_value.data(), x);
  }
  if (writer_) {
    const std::vector<std::int32_t> who(n, writer_rank);
    write_rows_independent(*writer_, first_row, n, H5T_NATIVE_INT32, who.data(), x);
  }
}

void PredictionFile::start_writeback() noexcept {
  // Best effort: a failure here only means the final fsync has more to do.
  if (writeback_fd_) ::sync_file_range(writeback_fd_.get(), 0, 0, SYNC_FILE_RANGE_WRITE);
}

void PredictionFile::commit_rows(std::uint64_t rows, bool sync, const char* hook_point) {
  const mpi::Comm& comm = file_->comm();
  auto durable = [&] {
    if (!sync) return;
    file_->flush();
    detail::on_root_quietly(comm, [&] { io::fsync_path(file_->path(), false); });
  };
  durable();
  if (hook_point != nullptr) test_hook(hook_point);
  h5::write_attr(file_->id(), "committed_rows", static_cast<std::int64_t>(rows));
  durable();
  committed_ = rows;
}

}  // namespace locus::infer
