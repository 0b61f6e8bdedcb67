// Private field-level helpers of the CSV reader (csv.cpp), shared with the join table's parser
// (join.cpp) so both tables split, trim and parse fields the same way and word their errors
// alike.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace locus::io::detail {

bool is_blank(char c);
// Whitespace trimmed, then one pair of surrounding double quotes stripped.
std::string_view trim(std::string_view s);
std::string_view strip_cr(std::string_view s);
// Splits a line at the delimiter into reused storage, each field trimmed.
void split(std::string_view line, char delim, std::vector<std::string_view>& out);
// A value as shown in messages: quoted, shortened when long.
std::string shown(std::string_view v);
// std::from_chars with a leading '+' allowed; float underflow gives a denormal or zero.
bool parse_float(std::string_view s, float& out);
// Throws DataError: `path` has no column `name` (named by [ingest] `option`), listing the
// header's columns and suggesting the closest name.
[[noreturn]] void throw_missing_column(const std::string& path, const std::string& name,
                                       const char* option, const std::vector<std::string>& names);

}  // namespace locus::io::detail
