// The loader's HDF5 reads: opening and validating the dataset, the collective range read of
// the initial load, and independent hyperslab-union reads of scattered rows afterwards.
#include "data/loader_source.hpp"
#include "data/stage_copy.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <vector>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"
#include "locus/io/attribute.hpp"

namespace locus::train {

std::mutex& hdf5_mutex() {
  static std::mutex m;
  return m;
}

namespace detail {

namespace {

constexpr std::uint64_t kMaxPieceBytes = 1ULL << 30;  // MPI-IO counts are int: stay far below

// H5Lexists fails, instead of answering false, when an intermediate group is missing: walk
// the path one component at a time.
bool dataset_path_exists(hid_t file, const std::string& path) {
  std::string prefix;
  std::size_t pos = 0;
  while (pos < path.size()) {
    const std::size_t next = path.find('/', pos);
    const std::string part = path.substr(pos, next == std::string::npos ? next : next - pos);
    pos = next == std::string::npos ? path.size() : next + 1;
    if (part.empty()) continue;
    prefix += "/" + part;
    const htri_t e = H5Lexists(file, prefix.c_str(), H5P_DEFAULT);
    if (e <= 0) {
      H5Eclear2(H5E_DEFAULT);
      return false;
    }
  }
  return !prefix.empty();
}

struct Shape {
  int ndims = 0;
  std::array<hsize_t, 2> dims{0, 0};
  H5T_class_t cls = H5T_NO_CLASS;
  std::size_t size = 0;  // bytes per element
  // "float64 [300, 12]", "int64 [3600]", "float32 (3 dimensions)": for messages.
  std::string describe() const {
    const char* kind = cls == H5T_FLOAT ? "float" : cls == H5T_INTEGER ? "int" : "non-numeric ";
    std::string text = fmt::format("{}{}", kind, cls == H5T_FLOAT || cls == H5T_INTEGER
                                                     ? std::to_string(8 * size) : "");
    if (ndims == 1) return text + fmt::format(" [{}]", dims[0]);
    if (ndims == 2) return text + fmt::format(" [{}, {}]", dims[0], dims[1]);
    return text + fmt::format(" ({} dimensions)", ndims);
  }
};

Shape shape_of(hid_t dset) {
  Shape s;
  h5::Id space(LOCUS_H5_CHECK(H5Dget_space(dset)));
  s.ndims = LOCUS_H5_CHECK(H5Sget_simple_extent_ndims(space.get()));
  if (s.ndims >= 1 && s.ndims <= 2)
    LOCUS_H5_CHECK(H5Sget_simple_extent_dims(space.get(), s.dims.data(), nullptr));
  h5::Id type(LOCUS_H5_CHECK(H5Dget_type(dset)));
  s.cls = H5Tget_class(type.get());
  s.size = H5Tget_size(type.get());
  return s;
}

h5::Id open_dataset(hid_t file, const std::string& path, const std::string& name,
                    const char* option) {
  if (!dataset_path_exists(file, name)) {
    throw DataError(fmt::format("'{}' has no dataset '{}' (loader option '{}'); set it to the "
                                "dataset's path (h5ls -r {} lists them)", path, name, option,
                                path));
  }
  // No chunk cache: a scattered read would otherwise pull whole chunks (1 MiB each in a locus
  // dataset) through the cache for a few rows each; without it HDF5 reads just the rows.
  h5::Id dapl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_ACCESS)));
  LOCUS_H5_CHECK(H5Pset_chunk_cache(dapl.get(), 0, 0, 1.0));
  const hid_t d = H5Dopen2(file, name.c_str(), dapl.get());
  if (d < 0) {
    H5Eclear2(H5E_DEFAULT);
    throw DataError(fmt::format("'{}' in '{}' is not a dataset (loader option '{}'); set it to "
                                "a dataset's path (h5ls -r {} lists them)", name, path, option,
                                path));
  }
  return h5::Id(d);
}

h5::Id transfer_plist(H5FD_mpio_xfer_t mode) {
  h5::Id dxpl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_XFER)));
  LOCUS_H5_CHECK(H5Pset_dxpl_mpio(dxpl.get(), mode));
  return dxpl;
}

// Selects the union of `runs` (rows) in a dataset's file space; width 0 means 1-D.
void select_runs(hid_t space, std::span<const h5::RowRange> runs, std::uint64_t width) {
  LOCUS_H5_CHECK(H5Sselect_none(space));
  for (const auto& r : runs) {
    const std::array<hsize_t, 2> start{r.begin, 0};
    const std::array<hsize_t, 2> count{r.count, width};
    LOCUS_H5_CHECK(H5Sselect_hyperslab(space, H5S_SELECT_OR, start.data(), nullptr,
                                       count.data(), nullptr));
  }
}

// Reads the union of `runs` (n rows in all; none on a rank that only joins a collective).
void read_selection(hid_t dset, hid_t memtype, std::uint64_t width,
                    std::span<const h5::RowRange> runs, std::uint64_t n, hid_t dxpl,
                    void* out) {
  h5::Id filespace(LOCUS_H5_CHECK(H5Dget_space(dset)));
  const int rank = width == 0 ? 1 : 2;
  const std::array<hsize_t, 2> mdims{std::max<hsize_t>(n, 1), width};
  h5::Id memspace(LOCUS_H5_CHECK(H5Screate_simple(rank, mdims.data(), nullptr)));
  select_runs(filespace.get(), runs, width);
  if (n == 0) LOCUS_H5_CHECK(H5Sselect_none(memspace.get()));
  LOCUS_H5_CHECK(H5Dread(dset, memtype, memspace.get(), filespace.get(), dxpl, out));
}

}  // namespace

Source::Source(const mpi::Comm& comm, const LoaderOptions& opts, const StagedCopy* staged)
    : staged_(staged),
      comm_(staged != nullptr ? staged->topo.node() : comm),
      path_(staged != nullptr ? staged->path : opts.path) {
  std::lock_guard<std::mutex> lock(hdf5_mutex());
  h5::init();
  mpi::agree_on(comm_, [&] {
    if (::access(path_.c_str(), R_OK) != 0) {
      throw DataError(fmt::format("cannot open the training data '{}': {}; check the loader "
                                  "path", path_, std::strerror(errno)));
    }
  });
  // Plain MPI-IO access: metadata reads stay independent, so later independent reads of a
  // chunk index never wait for another rank.
  h5::Id fapl(LOCUS_H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)));
  LOCUS_H5_CHECK(H5Pset_fapl_mpio(fapl.get(), comm_.get(), MPI_INFO_NULL));
  mpi::agree_on(comm_, [&] {
    const hid_t f = H5Fopen(path_.c_str(), H5F_ACC_RDONLY, fapl.get());
    if (f < 0) {
      const std::string stack = h5::error_stack();
      H5Eclear2(H5E_DEFAULT);
      throw DataError(fmt::format("'{}' is not a readable HDF5 file (truncated or corrupt?); "
                                  "HDF5 error stack:{}", path_, stack));
    }
    file_ = h5::Id(f);
  });
  try {
    // A staged copy names its datasets /features and /labels.
    LoaderOptions names = opts;
    if (staged_ != nullptr) {
      names.features = "/features";
      names.labels = staged_->has_labels ? "/labels" : "";
    }
    mpi::agree_on(comm_, [&] { inspect(names); });
  } catch (const Error& e) {
    // Agreed: every rank is here, so the collective close is safe.
    labels_.reset();
    features_.reset();
    if (e.agreed()) {
      H5Fclose(file_.release());
    } else {
      static_cast<void>(file_.release());
    }
    throw;
  }
}

void Source::inspect(const LoaderOptions& opts) {
  features_ = open_dataset(file_.get(), path_, opts.features, "features");
  const Shape f = shape_of(features_.get());
  if (f.ndims != 2 || f.cls != H5T_FLOAT || f.dims[1] == 0) {
    throw DataError(fmt::format("dataset '{}' in '{}' is {}; the loader reads a floating-point "
                                "[N, D] matrix (N rows of D features; float32, or float64 "
                                "converted on read): point data.train/data.test at such a "
                                "dataset{}",
                                opts.features, path_, f.describe(),
                                f.ndims == 2 && f.cls == H5T_INTEGER
                                    ? fmt::format(", or convert it (h5py: f['{}'][:].astype("
                                                  "'float32'))", opts.features)
                                    : std::string()));
  }
  const std::uint64_t extent = f.dims[0];
  cols_ = f.dims[1];
  rows_ = extent;
  const bool committed = h5::has_attr(file_.get(), "committed_rows");
  if (committed) {
    const auto c = h5::read_attr<std::int64_t>(file_.get(), "committed_rows");
    if (c < 0 || static_cast<std::uint64_t>(c) > extent) {
      throw DataError(fmt::format("'{}': committed_rows = {} but '{}' has {} rows; the file is "
                                  "damaged, re-ingest it", path_, c, opts.features, extent));
    }
    rows_ = static_cast<std::uint64_t>(c);
  }
  if (rows_ == 0 && staged_ == nullptr) {
    throw DataError(fmt::format("'{}' has no rows to train on ('{}' is empty{})", path_,
                                opts.features, committed ? " below committed_rows" : ""));
  }
  if (staged_ != nullptr && rows_ != staged_->staged_rows) {
    throw DataError(fmt::format("the staged copy '{}' has {} rows where its manifest says {}; "
                                "it is damaged: delete it (the next run stages it again)",
                                path_, rows_, staged_->staged_rows));
  }
  h5::check_stored(features_.get(), rows_, path_, opts.features);
  // From here on rows_ counts source rows; reads are mapped to the file by local().
  const std::uint64_t file_rows = rows_;
  if (staged_ != nullptr) rows_ = staged_->source_rows;
  if (opts.labels.empty() || !dataset_path_exists(file_.get(), opts.labels)) return;
  labels_ = open_dataset(file_.get(), path_, opts.labels, "labels");
  const Shape l = shape_of(labels_.get());
  if (l.ndims != 1 || l.cls != H5T_INTEGER) {
    throw DataError(fmt::format("dataset '{}' in '{}' is {}; labels are a 1-D integer vector "
                                "[rows] (int32), or set labels = \"\"",
                                opts.labels, path_, l.describe()));
  }
  // A locus dataset may hold uncommitted rows past committed_rows in both datasets.
  if (committed ? l.dims[0] < file_rows : l.dims[0] != extent) {
    throw DataError(fmt::format("'{}': labels '{}' have {} rows but features '{}' have {}{}; "
                                "both must describe the same samples (or set labels = \"\" to "
                                "load without labels)", path_, opts.labels, l.dims[0],
                                opts.features, committed ? file_rows : extent,
                                committed ? " committed rows" : ""));
  }
  h5::check_stored(labels_.get(), file_rows, path_, opts.labels);
}

Source::~Source() { abandon(); }

h5::RowRange Source::local(h5::RowRange r) const {
  if (staged_ == nullptr) return r;
  if (r.count == 0) return {0, 0};
  return {staged_->to_staged(r.begin, r.count), r.count};
}

void Source::read_range(h5::RowRange source_range, float* x, std::int32_t* y) {
  const h5::RowRange range = local(source_range);
  std::lock_guard<std::mutex> lock(hdf5_mutex());
  const std::uint64_t piece_rows = std::max<std::uint64_t>(1, kMaxPieceBytes / (cols_ * 4));
  const std::uint64_t mine = (range.count + piece_rows - 1) / piece_rows;
  // Every rank joins every collective piece, also ranks with nothing (left) to read.
  const std::uint64_t pieces = comm_.allreduce(mine, MPI_MAX);
  h5::Id dxpl = transfer_plist(H5FD_MPIO_COLLECTIVE);
  for (std::uint64_t p = 0; p < pieces; ++p) {
    const std::uint64_t r0 = std::min(range.count, p * piece_rows);
    const std::uint64_t n = std::min(range.count, r0 + piece_rows) - r0;
    const h5::RowRange run{range.begin + r0, n};
    const std::span<const h5::RowRange> runs(&run, n == 0 ? 0 : 1);
    read_selection(features_.get(), H5T_NATIVE_FLOAT, cols_, runs, n, dxpl.get(),
                   x + r0 * cols_);
    if (labels_) {
      read_selection(labels_.get(), H5T_NATIVE_INT32, 0, runs, n, dxpl.get(), y + r0);
    }
  }
}

void Source::read_runs(std::span<const h5::RowRange> source_runs, float* x, std::int32_t* y) {
  std::vector<h5::RowRange> mapped;
  if (staged_ != nullptr) {
    mapped.reserve(source_runs.size());
    for (const h5::RowRange& r : source_runs) mapped.push_back(local(r));
  }
  const std::span<const h5::RowRange> runs = staged_ != nullptr
      ? std::span<const h5::RowRange>(mapped) : source_runs;
  std::lock_guard<std::mutex> lock(hdf5_mutex());
  const std::uint64_t piece_rows = std::max<std::uint64_t>(1, kMaxPieceBytes / (cols_ * 4));
  h5::Id dxpl = transfer_plist(H5FD_MPIO_INDEPENDENT);
  // Features: one read per run (a regular hyperslab). HDF5 1.10 maps an irregular selection
  // (a union of runs) to chunks element by element, which costs more than the reads
  // themselves for scattered rows of a wide dataset (bench/train/loader_bench.cpp).
  std::uint64_t done = 0;
  for (h5::RowRange r : runs) {
    while (r.count > 0) {
      const h5::RowRange piece{r.begin, std::min(r.count, piece_rows)};
      read_selection(features_.get(), H5T_NATIVE_FLOAT, cols_, {&piece, 1}, piece.count,
                     dxpl.get(), x + done * cols_);
      done += piece.count;
      r.begin += piece.count;
      r.count -= piece.count;
    }
  }
  // Labels: one element per row, so the union is cheap: one read for all runs.
  if (labels_ && done > 0) {
    read_selection(labels_.get(), H5T_NATIVE_INT32, 0, runs, done, dxpl.get(), y);
  }
}

void Source::close() {
  std::lock_guard<std::mutex> lock(hdf5_mutex());
  labels_.reset();
  features_.reset();
  if (file_) LOCUS_H5_CHECK(H5Fclose(file_.release()));
}

void Source::abandon() noexcept {
  std::lock_guard<std::mutex> lock(hdf5_mutex());
  // Dataset handles close locally; only the file close is collective.
  labels_.reset();
  features_.reset();
  static_cast<void>(file_.release());
}

}  // namespace detail
}  // namespace locus::train
