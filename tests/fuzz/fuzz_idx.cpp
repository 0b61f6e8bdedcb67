// Fuzzes the IDX reader (lib/io/src/idx.cpp): header, dimensions, every dtype, plain and gzip
// (detected by magic, so one input format covers both), with and without a labels file.
// Input: byte 0 bit 0 = a labels file follows; then, with labels, a 4-byte little-endian
// length L of the images file, the images file (L bytes) and the labels file (the rest);
// without labels the rest is the images file.
#include <cstdint>
#include <cstring>

#include <fmt/format.h>

#include "fuzz_support.hpp"
#include "locus/io/idx.hpp"

namespace {

using locus::fuzz::ScratchFile;

void check_table(const locus::io::Table& t, bool labels) {
  const auto rows = static_cast<std::size_t>(t.rows());
  if (t.cols < 1 || t.features.size() != rows * static_cast<std::size_t>(t.cols) ||
      t.feature_names.size() != static_cast<std::size_t>(t.cols) || t.has_labels != labels ||
      (labels && t.labels.size() != rows)) {
    locus::fuzz::unexpected("inconsistent table",
                            fmt::format("cols {} features {} names {} labels {}", t.cols,
                                        t.features.size(), t.feature_names.size(),
                                        t.labels.size()));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  locus::fuzz::world();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const ScratchFile images("images.idx"), labels("labels.idx");
  if (size < 1) return 0;
  const bool with_labels = (data[0] & 1) != 0;
  ++data, --size;
  std::size_t image_bytes = size;
  if (with_labels) {
    if (size < 4) return 0;
    std::uint32_t n = 0;
    std::memcpy(&n, data, 4);  // little-endian hosts only (x86-64, aarch64)
    data += 4, size -= 4;
    image_bytes = std::min<std::size_t>(n, size);
  }
  images.write(data, image_bytes);
  if (with_labels) labels.write(data + image_bytes, size - image_bytes);
  const locus::io::IdxOptions opts{images.path(), with_labels ? labels.path() : ""};
  locus::io::Table t;
  if (locus::fuzz::parses([&] { t = locus::io::read_idx(locus::fuzz::world(), opts); }))
    check_table(t, with_labels);
  return 0;
}
