// The JSON documents locus writes (gate reports, inference reports, metrics lines) are built as
// nlohmann::ordered_json -- members stay in insertion order, the order docs/FORMATS.md shows --
// and turned into text by dump_json, so every file follows the same rules.
#pragma once

#include <nlohmann/json.hpp>

#include <string>

namespace locus::io {

using Json = nlohmann::ordered_json;

// j as text: on one line ("key":value, no spaces) for indent <= 0, else pretty-printed with
// indent spaces per level ("key": value). Strings are UTF-8 as given, with '"', '\' and
// control characters escaped; invalid UTF-8 bytes (a binary CSV header, a file path in another
// encoding) become U+FFFD so the document always parses. Doubles are written in a form that
// reads back to exactly the same value, always with a '.' or an exponent (4.0, 1e-05), and as
// null when NaN or infinite (JSON has no non-finite numbers).
std::string dump_json(const Json& j, int indent = 0);

}  // namespace locus::io
