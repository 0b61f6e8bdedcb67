// A tiny streaming JSON writer (objects, arrays, strings, numbers, booleans, null) for
// machine-readable reports; no third-party JSON library is available on the target systems.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace locus::io {

// Returns s as a quoted JSON string: '"' and '\' escaped, control characters as \n, \t, ...
// or \u00XX, and invalid UTF-8 bytes replaced by U+FFFD so the output always parses.
std::string json_string(std::string_view s);

// Shortest text that reads back to exactly v (std::to_chars), or "null" when v is NaN or
// infinite (JSON has no non-finite numbers).
std::string json_number(double v);

// Builds one JSON document. Commas and (with indent > 0) newlines and indentation are placed
// automatically; misuse (a value where a key is expected, unbalanced end_*) is a bug and fails
// an assertion. Example:
//   JsonWriter w;
//   w.begin_object().key("passed").value(false).key("rules").begin_array().end_array();
//   w.end_object();  // {"passed":false,"rules":[]}
class JsonWriter {
 public:
  explicit JsonWriter(int indent = 0) : indent_(indent) {}

  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  // Inside an object: the next member's name; must be followed by exactly one value.
  JsonWriter& key(std::string_view k);

  JsonWriter& value(std::string_view s);
  JsonWriter& value(const char* s) { return value(std::string_view(s)); }
  JsonWriter& value(const std::string& s) { return value(std::string_view(s)); }
  JsonWriter& value(double v);
  JsonWriter& value(std::int64_t v);
  JsonWriter& value(int v) { return value(static_cast<std::int64_t>(v)); }
  JsonWriter& value(bool v);
  JsonWriter& null();
  // Arrays of numbers, common enough in reports to deserve a shortcut.
  JsonWriter& value(const std::vector<double>& v);

  // True once the top-level value is complete.
  bool complete() const noexcept { return stack_.empty() && done_; }
  // The document so far; call after complete() for valid JSON.
  const std::string& str() const noexcept { return out_; }

 private:
  struct Level {
    bool object;
    bool empty = true;
    bool key_pending = false;
  };
  void before_value();  // commas, indentation, key/value checks
  void newline_indent(std::size_t depth);
  JsonWriter& open(bool object, char c);
  JsonWriter& close(bool object, char c);

  std::string out_;
  std::vector<Level> stack_;
  int indent_;
  bool done_ = false;
};

}  // namespace locus::io
