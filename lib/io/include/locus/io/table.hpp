// A rank's share of a labelled table: row-major float32 features plus optional int32 labels.
// Sources (IDX, CSV) produce it; gates, statistics and the HDF5 writer consume it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace locus::io {

struct Table {
  std::int64_t cols = 0;                    // feature count D
  std::vector<float> features;              // rows() × cols, row-major
  std::vector<std::int32_t> labels;         // rows() entries when has_labels
  bool has_labels = false;
  std::vector<std::string> feature_names;   // D names (CSV header; "pixel<i>" for IDX)
  std::string label_name;                   // CSV label column name ("label" for IDX)

  std::int64_t rows() const {
    return cols == 0 ? 0 : static_cast<std::int64_t>(features.size()) / cols;
  }
};

// Identity of one input file, recorded in the dataset's provenance.
struct SourceFile {
  std::string path;
  std::uint64_t bytes = 0;
  std::uint32_t crc32 = 0;  // zlib CRC-32 of the file's bytes as stored (compressed if .gz)
};

}  // namespace locus::io
