// Fuzzes the CSV reader (lib/io/src/csv.cpp): header (BOM, quotes, duplicate and empty names),
// column selection, delimiters, quoting, CRLF, blank and ragged rows, float and int32 fields.
// Input: an options line, then the CSV file. The options line is the delimiter character,
// the label column name up to a tab (empty: no labels), and after the tab the comma-separated
// feature columns (empty: every column but the label), e.g. ",label\tf1,f2\n".
#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "fuzz_support.hpp"
#include "locus/io/csv.hpp"

namespace {

std::vector<std::string> split_list(std::string_view s) {
  std::vector<std::string> out;
  while (!s.empty()) {
    const std::size_t at = std::min(s.find(','), s.size());
    out.emplace_back(s.substr(0, at));
    s.remove_prefix(std::min(at + 1, s.size()));
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  locus::fuzz::world();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const locus::fuzz::ScratchFile csv("input.csv");
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  const std::size_t nl = in.find('\n');
  if (in.empty() || nl == std::string_view::npos) return 0;
  std::string_view options = in.substr(1, nl - 1);
  locus::io::CsvOptions opts;
  opts.path = csv.path();
  opts.delimiter = in[0];
  const std::size_t tab = std::min(options.find('\t'), options.size());
  opts.label_column = std::string(options.substr(0, tab));
  if (tab < options.size()) opts.feature_columns = split_list(options.substr(tab + 1));
  csv.write(in.substr(nl + 1));
  locus::io::Table t;
  if (!locus::fuzz::parses([&] { t = locus::io::read_csv(locus::fuzz::world(), opts); }))
    return 0;
  const auto rows = static_cast<std::size_t>(t.rows());
  if (t.cols < 1 || rows < 1 || t.features.size() != rows * static_cast<std::size_t>(t.cols) ||
      (t.has_labels && t.labels.size() != rows) ||
      (!opts.feature_columns.empty() &&
       t.feature_names.size() != opts.feature_columns.size())) {
    locus::fuzz::unexpected("inconsistent table",
                            fmt::format("cols {} rows {} features {} labels {}", t.cols, rows,
                                        t.features.size(), t.labels.size()));
  }
  return 0;
}
