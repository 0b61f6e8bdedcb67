// Compression of the dataset files locus-ingest writes (ingest.compression): none, or HDF5's
// shuffle filter followed by deflate (zlib) at a level 1-9. Parsing, the check that this HDF5
// build can encode with both filters, and reading a dataset's filter pipeline back.
#pragma once

#include <hdf5.h>

#include <string>
#include <string_view>

namespace locus::io {

struct Compression {
  int deflate_level = 0;  // 0: none (no filters); 1-9: shuffle + deflate at this zlib level
  bool enabled() const noexcept { return deflate_level > 0; }
  friend bool operator==(const Compression&, const Compression&) = default;
};

inline constexpr int kDefaultDeflateLevel = 4;  // h5py's gzip default; see docs/FORMATS.md

// What ingest.compression accepts, for messages: "none, deflate or deflate:1 ... deflate:9".
extern const char* const kCompressionAllowed;

// "none", "deflate" (level kDefaultDeflateLevel) or "deflate:L" with L in 1..9. Throws
// ConfigError naming `key` (the option the text came from), the value and the allowed values.
Compression parse_compression(std::string_view text, std::string_view key = "ingest.compression");

// "none" or "deflate:L" (parse_compression's inverse).
std::string to_string(const Compression& c);

// Throws ConfigError naming `key` unless this HDF5 build has the shuffle and deflate filters
// with encoding enabled (H5Zfilter_avail, H5Zget_filter_info). Local; no-op for none.
void check_compression_available(const Compression& c,
                                 std::string_view key = "ingest.compression");

// The compression of an open dataset, read from its filter pipeline: none when it has no
// filters, deflate:L for shuffle + deflate(L) (in that order). Any other pipeline (e.g. h5py's
// gzip without shuffle, or fletcher32) is reported with deflate_level = -1. Local.
Compression compression_of(hid_t dset);

}  // namespace locus::io
