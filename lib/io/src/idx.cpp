// IDX reader: header parsing and validation, big-endian decoding of every IDX dtype, and the
// per-rank record range read with pread (plain) or a discarding zlib stream (gzip).
#include "locus/io/idx.hpp"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "locus/comm/agree.hpp"
#include "locus/io/unit_source.hpp"
#include "source_file.hpp"

namespace locus::io {

namespace {

constexpr std::size_t kChunk = std::size_t{1} << 20;
// Most features per record: 2^24 (a 4096x4096 image), far beyond any IDX data set.
constexpr std::uint64_t kMaxFeatures = std::uint64_t{1} << 24;

struct GzTraits {
  using value_type = gzFile;
  static gzFile invalid() noexcept { return nullptr; }
  static void close(gzFile f) noexcept { gzclose(f); }
};

// Element size of an IDX dtype code, 0 when unknown.
std::size_t dtype_size(std::uint8_t code) {
  switch (code) {
    case 0x08: case 0x09: return 1;
    case 0x0B: return 2;
    case 0x0C: case 0x0D: return 4;
    case 0x0E: return 8;
    default: return 0;
  }
}

bool dtype_is_integer(std::uint8_t code) { return code >= 0x08 && code <= 0x0C; }

std::uint32_t load_be32(const unsigned char* p) {
  std::uint32_t v;
  std::memcpy(&v, p, 4);
  if constexpr (std::endian::native == std::endian::little) v = __builtin_bswap32(v);
  return v;
}

std::uint64_t load_be64(const unsigned char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, 8);
  if constexpr (std::endian::native == std::endian::little) v = __builtin_bswap64(v);
  return v;
}

// Converts n big-endian elements of an IDX dtype to T (float features or int32 labels).
template <class T>
void decode(std::uint8_t dtype, const unsigned char* src, std::size_t n, T* dst) {
  switch (dtype) {
    case 0x08:
      for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
      break;
    case 0x09:
      for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<std::int8_t>(src[i]));
      break;
    case 0x0B:
      for (std::size_t i = 0; i < n; ++i) {
        const auto u = static_cast<std::uint16_t>((src[2 * i] << 8) | src[2 * i + 1]);
        dst[i] = static_cast<T>(static_cast<std::int16_t>(u));
      }
      break;
    case 0x0C:
      for (std::size_t i = 0; i < n; ++i)
        dst[i] = static_cast<T>(static_cast<std::int32_t>(load_be32(src + 4 * i)));
      break;
    case 0x0D:
      for (std::size_t i = 0; i < n; ++i)
        dst[i] = static_cast<T>(std::bit_cast<float>(load_be32(src + 4 * i)));
      break;
    case 0x0E:
      for (std::size_t i = 0; i < n; ++i)
        dst[i] = static_cast<T>(std::bit_cast<double>(load_be64(src + 8 * i)));
      break;
    default: LOCUS_ASSERT(false, fmt::format("unchecked IDX dtype {:#04x}", dtype));
  }
}

// Sequential reads over an IDX file: positional reads for a plain file, a zlib stream for
// gzip (which can only move forward, so skipping decompresses and discards).
class IdxStream {
 public:
  explicit IdxStream(const std::string& path) : file_(path) {
    unsigned char magic[2] = {0, 0};
    if (file_.read_at(magic, 2, 0) == 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
      const int fd = ::dup(file_.fd());
      gzFile gz = fd < 0 ? nullptr : gzdopen(fd, "rb");
      if (gz == nullptr) {
        if (fd >= 0) ::close(fd);
        throw DataError(detail::cannot_open_message(path, errno));
      }
      gz_ = Handle<GzTraits>(gz);
      gzbuffer(gz, static_cast<unsigned>(kChunk));
    }
  }

  const std::string& path() const noexcept { return file_.path(); }
  bool gzip() const noexcept { return static_cast<bool>(gz_); }
  std::uint64_t file_size() const noexcept { return file_.size(); }
  std::uint64_t pos() const noexcept { return pos_; }

  // Reads up to n bytes at the current position; fewer only at the end of the data. Throws
  // DataError for an I/O error or a truncated / corrupt gzip stream.
  std::size_t read(void* dst, std::size_t n) {
    if (!gzip()) {
      const std::size_t got = file_.read_at(dst, n, pos_);
      pos_ += got;
      return got;
    }
    auto* out = static_cast<char*>(dst);
    std::size_t done = 0;
    while (done < n) {
      const auto want = static_cast<unsigned>(std::min(n - done, kChunk));
      const int got = gzread(gz_.get(), out + done, want);
      if (got > 0) done += static_cast<std::size_t>(got);
      if (got < static_cast<int>(want)) break;
    }
    pos_ += done;
    if (done < n) throw_if_gzip_error();
    return done;
  }

  // Moves forward to a byte offset of the (decompressed) data.
  void skip_to(std::uint64_t offset, const std::string& what) {
    LOCUS_ASSERT(offset >= pos_, "IDX streams only move forward");
    if (!gzip()) {
      pos_ = offset;
      return;
    }
    std::vector<unsigned char> scratch(std::min<std::uint64_t>(kChunk, offset - pos_));
    while (pos_ < offset) {
      const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, offset - pos_));
      if (read(scratch.data(), want) != want) throw_short(offset, what);
    }
  }

  [[noreturn]] void throw_short(std::uint64_t needed, const std::string& what) const {
    throw DataError(fmt::format(
        "'{}' is shorter than its header says: {} needs {} bytes{} but the data ends at byte "
        "{}; the file is truncated: re-download or re-create it",
        path(), what, needed, gzip() ? " after decompression" : "", pos_));
  }

  // Fails when a gzip stream holds more data than expected, and makes zlib reach the gzip
  // trailer so its CRC check runs. Plain files are checked against their size instead.
  void expect_end(const std::string& what) {
    if (!gzip()) return;
    unsigned char extra[4096];
    const std::uint64_t end = pos_;
    if (read(extra, 1) != 0) {
      // Drain the rest first: a corrupt stream often decodes to extra bytes, and zlib's CRC
      // verdict at the end names the real problem better than "more data".
      while (read(extra, sizeof extra) == sizeof extra) {
      }
      throw DataError(fmt::format(
          "'{}' holds more data than its header says: {} ends at byte {} after decompression "
          "but there is more; the header or the file is wrong: re-create the file",
          path(), what, end));
    }
  }

 private:
  void throw_if_gzip_error() const {
    int errnum = Z_OK;
    const char* msg = gzerror(gz_.get(), &errnum);
    if (errnum == Z_OK) return;
    std::string_view text = msg != nullptr ? msg : "unknown error";
    const std::string prefix = path() + ": ";  // zlib prefixes its messages with the path
    if (text.starts_with(prefix)) text.remove_prefix(prefix.size());
    throw DataError(fmt::format(
        "'{}' is a truncated or corrupt gzip file (zlib: {}) after {} decompressed bytes; "
        "re-download it, or check it with 'gzip -t'",
        path(), text, pos_));
  }

  detail::InputFile file_;
  Handle<GzTraits> gz_;
  std::uint64_t pos_ = 0;
};

struct IdxHeader {
  std::uint8_t dtype = 0;
  std::vector<std::uint32_t> dims;
  std::uint64_t records = 0;       // N = dims[0]
  std::uint64_t record_elems = 1;  // d1*d2*...
  std::size_t elem_size = 0;
  std::uint64_t header_bytes = 0;
  std::uint64_t total = 0;         // header and data bytes (checked against overflow)
  std::uint64_t record_bytes() const { return record_elems * elem_size; }
  std::uint64_t total_bytes() const { return total; }
};

std::string shape_text(const std::vector<std::uint32_t>& dims) {
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

IdxHeader read_header(IdxStream& s) {
  unsigned char magic[4] = {0, 0, 0, 0};
  const std::size_t got = s.read(magic, 4);
  if (got < 4) {
    throw DataError(fmt::format("'{}' is too short to be an IDX file: {} bytes{}, but the IDX "
                                "header alone has at least 8; the file is truncated or empty: "
                                "re-download or re-create it",
                                s.path(), got, s.gzip() ? " after decompression" : ""));
  }
  if (magic[0] != 0 || magic[1] != 0) {
    throw DataError(fmt::format(
        "'{}' is not an IDX file: its first bytes{} are {:02x} but an IDX file starts with "
        "00 00 <dtype> <ndims>; check that [ingest] points at an IDX file (use the CSV source "
        "for text data)",
        s.path(), s.gzip() ? " after decompression" : "",
        fmt::join(std::span<const unsigned char>(magic, 4), " ")));
  }
  IdxHeader h;
  h.dtype = magic[2];
  h.elem_size = dtype_size(h.dtype);
  if (h.elem_size == 0) {
    throw DataError(fmt::format(
        "'{}' has unknown IDX dtype {:#04x}; supported: 0x08 u8, 0x09 i8, 0x0b i16, 0x0c i32, "
        "0x0d f32, 0x0e f64; the file is corrupt or not IDX",
        s.path(), h.dtype));
  }
  const int ndims = magic[3];
  if (ndims == 0) {
    throw DataError(fmt::format("'{}' declares 0 dimensions; an IDX file needs at least the "
                                "record count: re-create the file", s.path()));
  }
  std::vector<unsigned char> raw(4 * static_cast<std::size_t>(ndims));
  if (s.read(raw.data(), raw.size()) != raw.size())
    s.throw_short(4 + raw.size(), fmt::format("the header with {} dimensions", ndims));
  for (int i = 0; i < ndims; ++i) h.dims.push_back(load_be32(raw.data() + 4 * i));
  h.header_bytes = 4 + raw.size();
  h.records = h.dims[0];
  for (std::size_t i = 1; i < h.dims.size(); ++i) {
    if (h.dims[i] == 0 || __builtin_mul_overflow(h.record_elems, h.dims[i], &h.record_elems)) {
      throw DataError(fmt::format("'{}' has an invalid shape {}: every record dimension must be "
                                  "at least 1; the file is corrupt", s.path(), shape_text(h.dims)));
    }
  }
  // Every feature gets a name and a column: a record of more features than kMaxFeatures is a
  // corrupt header, not data (and with 0 records no data size would ever refute it).
  std::uint64_t data_bytes = 0;
  if (h.record_elems > kMaxFeatures ||
      __builtin_mul_overflow(h.records, h.record_elems * h.elem_size, &data_bytes) ||
      __builtin_add_overflow(h.header_bytes, data_bytes, &h.total)) {
    throw DataError(fmt::format("'{}' has an implausible shape {}: records of {} features (at "
                                "most {} are supported) or more than 2^64 bytes of data; the "
                                "header is corrupt: re-create the file",
                                s.path(), shape_text(h.dims), h.record_elems, kMaxFeatures));
  }
  return h;
}

// Checks a plain file's size against its header (every rank sees the same verdict).
void check_plain_size(const IdxStream& s, const IdxHeader& h) {
  if (s.gzip()) return;
  const std::uint64_t want = h.total_bytes();
  if (s.file_size() < want) {
    throw DataError(fmt::format(
        "'{}' is shorter than its header says: shape {} of {}-byte elements needs {} bytes but "
        "the file has {}; the file is truncated: re-download or re-create it",
        s.path(), shape_text(h.dims), h.elem_size, want, s.file_size()));
  }
  if (s.file_size() > want) {
    throw DataError(fmt::format(
        "'{}' is longer than its header says: shape {} of {}-byte elements needs {} bytes but "
        "the file has {}; the header or the file is wrong: re-create the file",
        s.path(), shape_text(h.dims), h.elem_size, want, s.file_size()));
  }
}

// Reads and decodes records [r.begin, r.end), appending them to out (r.count() *
// record_elems values). Calls keep_going (when given) after every chunk of about 1 MiB and
// returns false, leaving out partly filled, when it says stop.
template <class T>
bool read_records(IdxStream& s, const IdxHeader& h, detail::Range r, std::vector<T>& out,
                  const std::function<bool()>* keep_going = nullptr) {
  const std::string what =
      fmt::format("shape {} of {}-byte elements", shape_text(h.dims), h.elem_size);
  s.skip_to(h.header_bytes + r.begin * h.record_bytes(), what);
  const std::uint64_t total = r.count() * h.record_elems;
  // A gzip file's header is not checked against a size: grow with the data actually read, so
  // a header claiming more than the stream holds fails as truncated instead of allocating it.
  // (Reserved once, for a first read into an empty vector: reserving per appended unit would
  // reallocate every time.)
  if (!s.gzip() && out.empty()) out.reserve(total);
  const std::size_t chunk_elems = std::max<std::size_t>(1, kChunk / h.elem_size);
  std::vector<unsigned char> buf(std::min<std::uint64_t>(chunk_elems, total) * h.elem_size);
  const std::size_t base = out.size();
  for (std::uint64_t done = 0; done < total;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(chunk_elems, total - done));
    if (s.read(buf.data(), n * h.elem_size) != n * h.elem_size)
      s.throw_short(h.total_bytes(), what);
    out.resize(base + done + n);
    decode(h.dtype, buf.data(), n, out.data() + base + done);
    done += n;
    if (keep_going != nullptr && done < total && !(*keep_going)()) return false;
  }
  return true;
}

IdxHeader open_labels(IdxStream& s, const IdxHeader& images, const std::string& images_path) {
  IdxHeader h = read_header(s);
  if (h.record_elems != 1) {
    throw DataError(fmt::format("'{}' has shape {} but a labels file must have shape [N]; "
                                "point [ingest] labels at the labels file",
                                s.path(), shape_text(h.dims)));
  }
  if (!dtype_is_integer(h.dtype)) {
    throw DataError(fmt::format("'{}' holds floating-point values (IDX dtype {:#04x}) but "
                                "labels must be integers (u8, i8, i16 or i32)",
                                s.path(), h.dtype));
  }
  if (h.records != images.records) {
    throw DataError(fmt::format(
        "label count mismatch: '{}' has {} records but '{}' has {} labels; point [ingest] "
        "labels at the labels file that belongs to these images",
        images_path, images.records, s.path(), h.records));
  }
  check_plain_size(s, h);
  return h;
}

// This rank's share, read without any communication (the caller agrees on errors).
Table read_local(int size, int rank, const IdxOptions& opts) {
  IdxStream images(opts.images);
  const IdxHeader ih = read_header(images);
  check_plain_size(images, ih);
  std::optional<IdxStream> labels;
  std::optional<IdxHeader> lh;
  if (!opts.labels.empty()) {
    labels.emplace(opts.labels);
    lh = open_labels(*labels, ih, opts.images);
  }
  const detail::Range mine = detail::partition(ih.records, size, rank);
  // The rank holding the last record (rank 0 when N = 0) reads on to the end of the stream.
  const bool last = mine.end == ih.records && (mine.count() > 0 || rank == 0);

  Table t;
  t.cols = static_cast<std::int64_t>(ih.record_elems);
  read_records(images, ih, mine, t.features);
  if (last) images.expect_end(fmt::format("shape {}", shape_text(ih.dims)));
  if (labels) {
    read_records(*labels, *lh, mine, t.labels);
    if (last) labels->expect_end(fmt::format("shape {}", shape_text(lh->dims)));
    t.has_labels = true;
    t.label_name = "label";
  }
  t.feature_names.reserve(ih.record_elems);
  for (std::uint64_t i = 0; i < ih.record_elems; ++i)
    t.feature_names.push_back(fmt::format("pixel{}", i));
  return t;
}

// Records in units of a fixed size, each rank reading the units it is handed.
class IdxUnits final : public UnitSource {
 public:
  IdxUnits(const IdxOptions& opts, std::uint64_t unit_bytes) : opts_(opts) {
    IdxStream images(opts.images);
    ih_ = read_header(images);
    check_plain_size(images, ih_);
    if (!opts.labels.empty()) {
      IdxStream labels(opts.labels);
      lh_ = open_labels(labels, ih_, opts.images);
    }
    const std::uint64_t record = std::max<std::uint64_t>(ih_.record_bytes(), 1);
    if (unit_bytes == 0) unit_bytes = auto_unit_bytes(ih_.records * record);
    per_unit_ = std::max<std::uint64_t>(1, unit_bytes / record);
    units_ = std::max<std::uint64_t>(1, (ih_.records + per_unit_ - 1) / per_unit_);
    header_.cols = static_cast<std::int64_t>(ih_.record_elems);
    header_.has_labels = lh_.has_value();
    if (header_.has_labels) header_.label_name = "label";
    header_.feature_names.reserve(ih_.record_elems);
    for (std::uint64_t i = 0; i < ih_.record_elems; ++i)
      header_.feature_names.push_back(fmt::format("pixel{}", i));
  }

  std::int64_t units() const override { return static_cast<std::int64_t>(units_); }
  std::uint64_t unit_bytes() const override { return per_unit_ * ih_.record_bytes(); }
  const Table& header() const override { return header_; }

  UnitParse parse(std::int64_t unit, Table& t, const std::function<bool()>& keep_going) override {
    UnitParse out;
    const auto u = static_cast<std::uint64_t>(unit);
    const detail::Range r{std::min(ih_.records, u * per_unit_),
                          std::min(ih_.records, (u + 1) * per_unit_)};
    const bool last = u + 1 == units_;
    try {
      if (!read_unit(images_, opts_.images, ih_, r, last, t.features, keep_going)) {
        out.abandoned = true;
        return out;
      }
      if (lh_ && !read_unit(labels_, opts_.labels, *lh_, r, last, t.labels, keep_going))
        out.abandoned = true;
    } catch (const Error& e) {
      out.error = UnitError{e.kind(), e.what()};
    } catch (const std::exception& e) {
      out.error = UnitError{ErrorKind::internal, e.what()};
    }
    return out;
  }

  std::string describe(const UnitError& e, std::int64_t) const override { return e.message; }

 private:
  // Reads records r of one file through `stream`, opened on first use and reopened when r lies
  // before its position (gzip only moves forward).
  template <class T>
  static bool read_unit(std::optional<IdxStream>& stream, const std::string& path,
                        const IdxHeader& h, detail::Range r, bool last, std::vector<T>& out,
                        const std::function<bool()>& keep_going) {
    if (!stream || stream->pos() > h.header_bytes + r.begin * h.record_bytes()) stream.emplace(path);
    if (!read_records(*stream, h, r, out, &keep_going)) return false;
    if (last) stream->expect_end(fmt::format("shape {}", shape_text(h.dims)));
    return true;
  }

  IdxOptions opts_;
  IdxHeader ih_;
  std::optional<IdxHeader> lh_;
  std::uint64_t per_unit_ = 1, units_ = 1;
  Table header_;
  std::optional<IdxStream> images_, labels_;
};

}  // namespace

std::uint64_t auto_unit_bytes(std::uint64_t input_bytes) {
  constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
  return std::clamp<std::uint64_t>(input_bytes / 64, kMiB, 16 * kMiB);
}

std::unique_ptr<UnitSource> open_idx_units(const mpi::Comm& comm, const IdxOptions& opts,
                                           std::uint64_t unit_bytes) {
  std::unique_ptr<UnitSource> src;
  mpi::agree_on(comm, [&] { src = std::make_unique<IdxUnits>(opts, unit_bytes); });
  return src;
}

Table read_idx(const mpi::Comm& comm, const IdxOptions& opts) {
  Table t;
  mpi::agree_on(comm, [&] { t = read_local(comm.size(), comm.rank(), opts); });
  return t;
}

}  // namespace locus::io
