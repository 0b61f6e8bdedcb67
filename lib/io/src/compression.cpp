// ingest.compression: parsing, filter availability and the filter pipeline read back.
#include "locus/io/compression.hpp"

#include <charconv>

#include <fmt/format.h>

#include "locus/comm/error.hpp"
#include "locus/io/h5.hpp"

namespace locus::io {

const char* const kCompressionAllowed =
    "none, deflate or deflate:1 ... deflate:9 (shuffle + deflate at that zlib level; "
    "deflate alone means deflate:4)";

Compression parse_compression(std::string_view text, std::string_view key) {
  if (text == "none") return {};
  if (text == "deflate") return {kDefaultDeflateLevel};
  constexpr std::string_view prefix = "deflate:";
  if (text.substr(0, prefix.size()) == prefix) {
    const std::string_view digits = text.substr(prefix.size());
    int level = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), level);
    if (ec == std::errc() && end == digits.data() + digits.size() && level >= 1 && level <= 9)
      return {level};
  }
  throw ConfigError(fmt::format("option '{}' = '{}' is not allowed: use {}", key, text,
                                kCompressionAllowed));
}

std::string to_string(const Compression& c) {
  return c.enabled() ? fmt::format("deflate:{}", c.deflate_level) : "none";
}

namespace {
bool can_encode(H5Z_filter_t filter) {
  const htri_t avail = H5Zfilter_avail(filter);
  if (avail <= 0) return false;
  unsigned int info = 0;
  if (H5Zget_filter_info(filter, &info) < 0) return false;
  return (info & H5Z_FILTER_CONFIG_ENCODE_ENABLED) != 0;
}
}  // namespace

void check_compression_available(const Compression& c, std::string_view key) {
  if (!c.enabled()) return;
  h5::init();
  for (const auto& [filter, name] : {std::pair{H5Z_FILTER_SHUFFLE, "shuffle"},
                                     std::pair{H5Z_FILTER_DEFLATE, "deflate (zlib)"}}) {
    if (!can_encode(filter)) {
      H5Eclear2(H5E_DEFAULT);
      throw ConfigError(fmt::format("option '{}' = '{}' needs HDF5's {} filter, which this HDF5 "
                                    "library cannot encode with; set {} = none, or build locus "
                                    "against an HDF5 with zlib support",
                                    key, to_string(c), name, key));
    }
  }
}

Compression compression_of(hid_t dset) {
  h5::Id dcpl(LOCUS_H5_CHECK(H5Dget_create_plist(dset)));
  const int n = LOCUS_H5_CHECK(H5Pget_nfilters(dcpl.get()));
  if (n == 0) return {};
  if (n != 2) return {-1};
  unsigned flags = 0;
  std::size_t nvalues = 1;
  unsigned values[1] = {0};
  unsigned config = 0;
  const H5Z_filter_t first =
      LOCUS_H5_CHECK(H5Pget_filter2(dcpl.get(), 0, &flags, &nvalues, values, 0, nullptr, &config));
  nvalues = 1;
  values[0] = 0;
  const H5Z_filter_t second =
      LOCUS_H5_CHECK(H5Pget_filter2(dcpl.get(), 1, &flags, &nvalues, values, 0, nullptr, &config));
  if (first != H5Z_FILTER_SHUFFLE || second != H5Z_FILTER_DEFLATE || nvalues < 1) return {-1};
  return {static_cast<int>(values[0])};
}

}  // namespace locus::io
