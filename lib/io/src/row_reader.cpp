// Row reads of a 2-D float32 dataset: by parallel pread where the rows lie in the file as
// plain bytes, else by H5Dread (see row_reader.hpp).
#include "locus/io/row_reader.hpp"

#include <array>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "locus/io/h5.hpp"
#include "locus/io/raw_io.hpp"
#include "read_pool.hpp"

namespace locus::io {

namespace {

constexpr std::uint64_t kMinChunkBytesOneThread = std::uint64_t{4} << 20;

// Why the rows cannot be read as raw bytes ("" when they can); chunk_rows: rows per chunk
// (0 for contiguous storage).
std::string why_not_raw(hid_t file, hid_t dataset, std::uint64_t cols, int threads,
                        std::uint64_t& chunk_rows) {
  chunk_rows = 0;
  h5::Id dcpl(LOCUS_H5_CHECK(H5Dget_create_plist(dataset)));
  if (LOCUS_H5_CHECK(H5Pget_external_count(dcpl.get())) > 0) return "the dataset is external";
  if (LOCUS_H5_CHECK(H5Pget_nfilters(dcpl.get())) > 0) return "the dataset is compressed";
  h5::Id type(LOCUS_H5_CHECK(H5Dget_type(dataset)));
  if (LOCUS_H5_CHECK(H5Tequal(type.get(), H5T_NATIVE_FLOAT)) <= 0)
    return "the dataset is not stored as native float32";
  h5::Id fapl(LOCUS_H5_CHECK(H5Fget_access_plist(file)));
  if (LOCUS_H5_CHECK(H5Pget_driver(fapl.get())) != H5FD_SEC2)
    return "the file is not open through the POSIX driver";
  h5::Id fcpl(LOCUS_H5_CHECK(H5Fget_create_plist(file)));
  hsize_t userblock = 0;
  LOCUS_H5_CHECK(H5Pget_userblock(fcpl.get(), &userblock));
  // Chunk addresses are relative to the end of a user block; H5Dget_offset's is not.
  if (userblock > 0) return "the file has a user block";
  switch (H5Pget_layout(dcpl.get())) {
    case H5D_CONTIGUOUS:
      return "";
    case H5D_CHUNKED: {
      std::array<hsize_t, 2> chunk{0, 0};
      if (LOCUS_H5_CHECK(H5Pget_chunk(dcpl.get(), 2, chunk.data())) != 2)
        return "the dataset's chunks are not 2-D";
      if (chunk[1] != cols) return "the dataset's chunks do not span whole rows";
      // HDF5 takes ~15 us to give a chunk's address (H5Dget_chunk_info_by_coord), as long as
      // copying 200 KiB: one thread that looks up and reads each chunk in turn is slower than
      // H5Dread on chunks of a few MiB (0.84-0.91x on 1 MiB chunks; 1.06x on 12.5 MiB ones,
      // bench/RESULTS.md). Several threads read while the next chunks are looked up.
      if (threads == 1 && chunk[0] * cols * sizeof(float) < kMinChunkBytesOneThread)
        return "one thread, chunks below 4 MiB";
      chunk_rows = chunk[0];
      return "";
    }
    default:
      return "the dataset's layout is compact or virtual";
  }
}

}  // namespace

struct RowReader::Impl {
  hid_t dataset = H5I_INVALID_HID;
  std::uint64_t rows = 0, cols = 0;
  std::string path;
  std::string method;
  bool direct = false;
  int fd = -1;                       // HDF5's own descriptor of the file (borrowed)
  std::uint64_t chunk_rows = 0;      // 0: contiguous, at `contiguous_at`
  std::uint64_t contiguous_at = 0;
  // The last chunk looked up (reads go front to back, so a chunk is usually looked up once).
  std::uint64_t cached_chunk = ~std::uint64_t{0};
  std::optional<std::uint64_t> cached_at;
  // The range being built: consecutive chunks adjacent in the file and in memory are merged
  // before they go to the pool.
  std::uint64_t pending_at = 0, pending_bytes = 0;
  std::byte* pending_dst = nullptr;
  detail::ReadPool pool;

  Impl(hid_t d, int threads) : dataset(d), pool(threads) {}

  // The chunk's file offset; nullopt when it was never written (its rows are the fill value).
  std::optional<std::uint64_t> chunk_at(std::uint64_t k) {
    if (k == cached_chunk) return cached_at;
    const std::array<hsize_t, 2> coord{k * chunk_rows, 0};
    unsigned mask = 0;
    haddr_t addr = HADDR_UNDEF;
    hsize_t size = 0;
    LOCUS_H5_CHECK(H5Dget_chunk_info_by_coord(dataset, coord.data(), &mask, &addr, &size));
    cached_chunk = k;
    cached_at.reset();
    if (addr == HADDR_UNDEF) return cached_at;
    // HDF5 records no size for a chunk without filters: it reports the nominal one.
    LOCUS_ASSERT(size == chunk_rows * cols * sizeof(float),
                 fmt::format("'{}': chunk {} of its features holds {} bytes, not {}", path, k,
                             size, chunk_rows * cols * sizeof(float)));
    cached_at = addr;
    return cached_at;
  }

  void h5_read(std::uint64_t first_row, std::uint64_t n, float* out) {
    const std::array<hsize_t, 2> start{first_row, 0}, count{n, cols};
    h5::Id file_space(LOCUS_H5_CHECK(H5Dget_space(dataset)));
    LOCUS_H5_CHECK(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr,
                                       count.data(), nullptr));
    h5::Id mem_space(LOCUS_H5_CHECK(H5Screate_simple(2, count.data(), nullptr)));
    LOCUS_H5_CHECK(
        H5Dread(dataset, H5T_NATIVE_FLOAT, mem_space.get(), file_space.get(), H5P_DEFAULT, out));
  }

  // Queues a range, merged with the pending one when both are adjacent in the file and in
  // memory (consecutive chunks usually are) until it holds a piece's worth: the pool's threads
  // start on it while the next chunks are looked up. flush() hands the last one over.
  void add(std::uint64_t offset, float* dst, std::uint64_t bytes) {
    auto* d = reinterpret_cast<std::byte*>(dst);
    if (pending_bytes > 0 && pending_at + pending_bytes == offset &&
        pending_dst + pending_bytes == d) {
      pending_bytes += bytes;
    } else {
      flush();
      pending_at = offset;
      pending_dst = d;
      pending_bytes = bytes;
    }
    if (pending_bytes >= detail::ReadPool::kPieceBytes) flush();
  }
  void flush() {
    pool.add(pending_at, pending_dst, pending_bytes);
    pending_bytes = 0;
  }
};

RowReader::RowReader(hid_t file, hid_t dataset, int threads)
    : impl_(std::make_unique<Impl>(dataset, threads)) {
  Impl& m = *impl_;
  m.path = h5::file_name(file);
  h5::Id space(LOCUS_H5_CHECK(H5Dget_space(dataset)));
  std::array<hsize_t, 2> dims{0, 0};
  if (LOCUS_H5_CHECK(H5Sget_simple_extent_ndims(space.get())) != 2)
    throw DataError(fmt::format("'{}': a dataset read by rows must be 2-D", m.path));
  LOCUS_H5_CHECK(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr));
  m.rows = dims[0];
  m.cols = dims[1];
  std::string why = why_not_raw(file, dataset, m.cols, m.pool.threads(), m.chunk_rows);
  if (why.empty() && m.chunk_rows == 0) {
    const std::optional<std::uint64_t> at = h5::raw_offset(dataset, H5T_NATIVE_FLOAT);
    if (at) m.contiguous_at = *at;
    else why = "the dataset's storage is not allocated";
  }
  if (why.empty()) {
    void* handle = nullptr;
    h5::Id fapl(LOCUS_H5_CHECK(H5Fget_access_plist(file)));
    LOCUS_H5_CHECK(H5Fget_vfd_handle(file, fapl.get(), &handle));
    m.fd = *static_cast<int*>(handle);
  }
  m.direct = why.empty();
  const int n = m.pool.threads();
  m.method = !m.direct ? fmt::format("H5Dread ({})", why)
             : m.chunk_rows == 0
                 ? fmt::format("pread, {} thread{} (contiguous)", n, n == 1 ? "" : "s")
                 : fmt::format("pread, {} thread{} (chunks of {} rows)", n, n == 1 ? "" : "s",
                               m.chunk_rows);
}

RowReader::~RowReader() = default;

std::uint64_t RowReader::cols() const noexcept { return impl_->cols; }
bool RowReader::direct() const noexcept { return impl_->direct; }
const std::string& RowReader::method() const noexcept { return impl_->method; }

void RowReader::read(std::uint64_t first_row, std::span<float> out) {
  Impl& m = *impl_;
  const std::uint64_t rows = m.cols == 0 ? 0 : out.size() / m.cols;
  if (rows == 0) return;
  LOCUS_ASSERT(first_row + rows <= m.rows,
               fmt::format("rows [{}, {}) of '{}' read past its {} rows", first_row,
                           first_row + rows, m.path, m.rows));
  if (!m.direct) {
    m.h5_read(first_row, rows, out.data());
    return;
  }
  const std::uint64_t row_bytes = m.cols * sizeof(float);
  m.pool.begin(m.fd, m.path);
  m.pending_bytes = 0;
  try {
    if (m.chunk_rows == 0) {
      m.add(m.contiguous_at + first_row * row_bytes, out.data(), rows * row_bytes);
    } else {
      // Chunk by chunk: the pool's threads read the first chunks while the later ones are
      // looked up.
      const std::uint64_t end = first_row + rows;
      for (std::uint64_t k = first_row / m.chunk_rows; k * m.chunk_rows < end; ++k) {
        const std::uint64_t lo = std::max(first_row, k * m.chunk_rows);
        const std::uint64_t hi = std::min(end, (k + 1) * m.chunk_rows);
        float* dst = out.data() + (lo - first_row) * m.cols;
        const std::optional<std::uint64_t> at = m.chunk_at(k);
        if (at) m.add(*at + (lo - k * m.chunk_rows) * row_bytes, dst, (hi - lo) * row_bytes);
        else m.h5_read(lo, hi - lo, dst);  // never written: HDF5 supplies the fill value
      }
    }
    m.flush();
  } catch (...) {
    m.pool.abandon();  // the pool's threads may still be writing into out
    throw;
  }
  m.pool.finish();
}

}  // namespace locus::io
