// Collective hyperslab transfers of row ranges, dataset creation with chunking/filters.
#include "locus/io/dataset.hpp"

#include <algorithm>
#include <array>

#include <fmt/format.h>

namespace locus::h5 {

namespace {

std::uint64_t g_max_piece_bytes = 1ULL << 30;  // MPI-IO counts are int: stay far below 2 GiB

hid_t native_type(Dtype t) {
  switch (t) {
    case Dtype::f32: return H5T_NATIVE_FLOAT;
    case Dtype::f64: return H5T_NATIVE_DOUBLE;
    case Dtype::i32: return H5T_NATIVE_INT32;
    case Dtype::i64: return H5T_NATIVE_INT64;
    case Dtype::u8: return H5T_NATIVE_UINT8;
  }
  return H5T_NATIVE_FLOAT;
}

// Little-endian file types, so files are identical whatever the writer's platform.
hid_t file_type(Dtype t) {
  switch (t) {
    case Dtype::f32: return H5T_IEEE_F32LE;
    case Dtype::f64: return H5T_IEEE_F64LE;
    case Dtype::i32: return H5T_STD_I32LE;
    case Dtype::i64: return H5T_STD_I64LE;
    case Dtype::u8: return H5T_STD_U8LE;
  }
  return H5T_IEEE_F32LE;
}

std::size_t dtype_size(Dtype t) {
  switch (t) {
    case Dtype::f32: case Dtype::i32: return 4;
    case Dtype::f64: case Dtype::i64: return 8;
    case Dtype::u8: return 1;
  }
  return 4;
}

Dtype dtype_from_file(hid_t type, const std::string& name) {
  const H5T_class_t cls = H5Tget_class(type);
  const std::size_t size = H5Tget_size(type);
  if (cls == H5T_FLOAT && size == 4) return Dtype::f32;
  if (cls == H5T_FLOAT && size == 8) return Dtype::f64;
  if (cls == H5T_INTEGER) {
    const bool is_signed = H5Tget_sign(type) == H5T_SGN_2;
    if (size == 4 && is_signed) return Dtype::i32;
    if (size == 8 && is_signed) return Dtype::i64;
    if (size == 1 && !is_signed) return Dtype::u8;
  }
  throw DataError(fmt::format("dataset '{}' has an unsupported element type (class {}, {} "
                              "bytes); locus reads float32/float64/int32/int64/uint8",
                              name, static_cast<int>(cls), size));
}

}  // namespace

const char* dtype_name(Dtype t) {
  switch (t) {
    case Dtype::f32: return "float32";
    case Dtype::f64: return "float64";
    case Dtype::i32: return "int32";
    case Dtype::i64: return "int64";
    case Dtype::u8: return "uint8";
  }
  return "?";
}

RowRange partition_rows(std::uint64_t n, int rank, int size, std::uint64_t align) {
  const auto r = static_cast<std::uint64_t>(rank);
  const auto p = static_cast<std::uint64_t>(size);
  if (align <= 1) {
    const std::uint64_t base = n / p, extra = n % p;
    const std::uint64_t begin = r * base + std::min(r, extra);
    return {begin, base + (r < extra ? 1 : 0)};
  }
  const std::uint64_t units = (n + align - 1) / align;
  const RowRange u = partition_rows(units, rank, size, 1);
  const std::uint64_t begin = std::min(n, u.begin * align);
  const std::uint64_t end = std::min(n, u.end() * align);
  return {begin, end - begin};
}

void Dataset::set_max_piece_bytes(std::uint64_t bytes) {
  g_max_piece_bytes = std::max<std::uint64_t>(bytes, 1);
}

Dataset::Dataset(const mpi::Comm& comm, Id id, std::string name)
    : comm_(comm.view()), id_(std::move(id)), name_(std::move(name)) {
  Id space(LOCUS_H5_CHECK(H5Dget_space(id_.get())));
  const int rank = LOCUS_H5_CHECK(H5Sget_simple_extent_ndims(space.get()));
  if (rank != 1 && rank != 2) {
    throw DataError(fmt::format("dataset '{}' has {} dimensions; locus expects a 1-D [N] or "
                                "2-D [N, D] dataset", name_, rank));
  }
  std::array<hsize_t, 2> dims{0, 0};
  LOCUS_H5_CHECK(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr));
  rows_ = dims[0];
  cols_ = rank == 2 ? dims[1] : 0;
  Id type(LOCUS_H5_CHECK(H5Dget_type(id_.get())));
  dtype_ = dtype_from_file(type.get(), name_);
}

Dataset Dataset::create(File& file, const DatasetSpec& spec) {
  const int rank = spec.cols == 0 ? 1 : 2;
  std::array<hsize_t, 2> dims{spec.rows, spec.cols};
  std::array<hsize_t, 2> maxdims{spec.extendible ? H5S_UNLIMITED : spec.rows, spec.cols};
  Id space(LOCUS_H5_CHECK(H5Screate_simple(rank, dims.data(), maxdims.data())));

  const std::uint64_t row_bytes = std::max<std::uint64_t>(spec.cols, 1) * dtype_size(spec.dtype);
  std::uint64_t chunk_rows = spec.chunk_rows;
  if (chunk_rows == 0) chunk_rows = std::max<std::uint64_t>(1, (1u << 20) / row_bytes);
  if (!spec.extendible) chunk_rows = std::min(chunk_rows, std::max<std::uint64_t>(spec.rows, 1));
  std::array<hsize_t, 2> chunk{chunk_rows, std::max<std::uint64_t>(spec.cols, 1)};

  Id dcpl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
  LOCUS_H5_CHECK(H5Pset_chunk(dcpl.get(), rank, chunk.data()));
  // Every row is written by exactly one rank: skip fill-value writes.
  LOCUS_H5_CHECK(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER));
  LOCUS_H5_CHECK(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY));
  if (spec.fletcher32) LOCUS_H5_CHECK(H5Pset_fletcher32(dcpl.get()));

  Id id(LOCUS_H5_CHECK(H5Dcreate2(file.id(), spec.name.c_str(), file_type(spec.dtype),
                                  space.get(), H5P_DEFAULT, dcpl.get(), H5P_DEFAULT)));
  return Dataset(file.comm(), std::move(id), spec.name);
}

Dataset Dataset::open(File& file, const std::string& name) {
  if (!exists(file.id(), name)) {
    throw DataError(fmt::format("'{}' has no dataset '{}'; check the dataset name (h5ls {} "
                                "lists what is there)", file.path(), name, file.path()));
  }
  Id id(LOCUS_H5_CHECK(H5Dopen2(file.id(), name.c_str(), H5P_DEFAULT)));
  return Dataset(file.comm(), std::move(id), name);
}

void Dataset::resize(std::uint64_t new_rows) {
  std::array<hsize_t, 2> dims{new_rows, cols_};
  LOCUS_H5_CHECK(H5Dset_extent(id_.get(), dims.data()));
  rows_ = new_rows;
}

void Dataset::transfer(bool write, std::uint64_t first_row, std::size_t elements, Dtype memtype,
                       void* data) {
  const std::uint64_t width = row_width();
  LOCUS_ASSERT(elements % width == 0,
               fmt::format("{} elements is not a whole number of {}-wide rows", elements, width));
  const std::uint64_t nrows = elements / width;
  if (first_row + nrows > rows_) {
    throw InternalError(fmt::format("{} rows [{}, {}) of dataset '{}' which has {} rows",
                                    write ? "writing" : "reading", first_row, first_row + nrows,
                                    name_, rows_));
  }
  const std::size_t esize = dtype_size(memtype);
  const std::uint64_t piece_rows =
      std::max<std::uint64_t>(1, g_max_piece_bytes / (width * esize));
  const std::uint64_t my_pieces = (nrows + piece_rows - 1) / piece_rows;
  // Every rank must join every collective piece, including ranks with nothing left to move.
  const std::uint64_t pieces = comm_.allreduce(my_pieces, MPI_MAX);

  Id dxpl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_XFER)));
  LOCUS_H5_CHECK(H5Pset_dxpl_mpio(dxpl.get(), H5FD_MPIO_COLLECTIVE));
  Id filespace(LOCUS_H5_CHECK(H5Dget_space(id_.get())));
  const int rank = cols_ == 0 ? 1 : 2;
  auto* bytes = static_cast<unsigned char*>(data);
  for (std::uint64_t p = 0; p < pieces; ++p) {
    const std::uint64_t r0 = std::min(nrows, p * piece_rows);
    const std::uint64_t n = std::min(nrows, r0 + piece_rows) - r0;
    std::array<hsize_t, 2> start{first_row + r0, 0};
    std::array<hsize_t, 2> count{n, cols_};
    std::array<hsize_t, 2> mdims{std::max<hsize_t>(n, 1), cols_};
    Id memspace(LOCUS_H5_CHECK(H5Screate_simple(rank, mdims.data(), nullptr)));
    if (n == 0) {
      LOCUS_H5_CHECK(H5Sselect_none(filespace.get()));
      LOCUS_H5_CHECK(H5Sselect_none(memspace.get()));
    } else {
      LOCUS_H5_CHECK(H5Sselect_hyperslab(filespace.get(), H5S_SELECT_SET, start.data(), nullptr,
                                         count.data(), nullptr));
    }
    void* buf = bytes + r0 * width * esize;
    if (write) {
      LOCUS_H5_WRITE_CHECK(detail::file_of(id_.get()),
                           H5Dwrite(id_.get(), native_type(memtype), memspace.get(),
                                    filespace.get(), dxpl.get(), buf));
    } else {
      LOCUS_H5_CHECK(H5Dread(id_.get(), native_type(memtype), memspace.get(), filespace.get(),
                             dxpl.get(), buf));
    }
  }
  LOCUS_H5_CHECK(H5Pget_mpio_actual_io_mode(dxpl.get(), &last_.mode));
  LOCUS_H5_CHECK(H5Pget_mpio_no_collective_cause(dxpl.get(), &last_.local_no_collective_cause,
                                                 &last_.global_no_collective_cause));
}

}  // namespace locus::h5
