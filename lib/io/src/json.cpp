// The JSON writer: string escaping with UTF-8 validation, round-trip number formatting, and
// the comma/indentation bookkeeping of JsonWriter.
#include "locus/io/json.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>

#include "locus/comm/error.hpp"

namespace locus::io {

namespace {

// Length of the well-formed UTF-8 sequence starting at s[i] (Unicode 15, table 3-7), or 0
// when the bytes there are not one; overlong forms and surrogates count as malformed.
std::size_t utf8_sequence_length(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  std::size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  if (b(1) < lo || b(1) > hi) return 0;
  for (std::size_t k = 2; k < len; ++k)
    if (b(k) < 0x80 || b(k) > 0xBF) return 0;
  return len;
}

}  // namespace

std::string json_string(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      const std::size_t len = utf8_sequence_length(s, i);
      if (len == 0) {
        out += "\\ufffd";  // keep the document valid even for a binary CSV header
        ++i;
      } else {
        out.append(s.substr(i, len));
        i += len;
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
          out += buf;
        } else {
          out.push_back(static_cast<char>(c));
        }
    }
    ++i;
  }
  out.push_back('"');
  return out;
}

std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form
  LOCUS_ASSERT(r.ec == std::errc(), "to_chars(double) cannot overflow 32 characters");
  return std::string(buf, r.ptr);
}

void JsonWriter::newline_indent(std::size_t depth) {
  if (indent_ <= 0) return;
  out_.push_back('\n');
  out_.append(depth * static_cast<std::size_t>(indent_), ' ');
}

void JsonWriter::before_value() {
  LOCUS_ASSERT(!done_, "JSON document already complete");
  if (stack_.empty()) return;
  Level& top = stack_.back();
  if (top.object) {
    LOCUS_ASSERT(top.key_pending, "JSON object member needs key() before its value");
    top.key_pending = false;
    return;  // key() already wrote the comma and indentation
  }
  if (!top.empty) out_.push_back(',');
  top.empty = false;
  newline_indent(stack_.size());
}

JsonWriter& JsonWriter::key(std::string_view k) {
  LOCUS_ASSERT(!stack_.empty() && stack_.back().object && !stack_.back().key_pending,
               "JSON key() outside an object or twice in a row");
  Level& top = stack_.back();
  if (!top.empty) out_.push_back(',');
  top.empty = false;
  newline_indent(stack_.size());
  out_ += json_string(k);
  out_ += indent_ > 0 ? ": " : ":";
  top.key_pending = true;
  return *this;
}

JsonWriter& JsonWriter::open(bool object, char c) {
  before_value();
  out_.push_back(c);
  stack_.push_back(Level{object});
  return *this;
}

JsonWriter& JsonWriter::close(bool object, char c) {
  LOCUS_ASSERT(!stack_.empty() && stack_.back().object == object && !stack_.back().key_pending,
               "unbalanced JSON end_object()/end_array()");
  const bool empty = stack_.back().empty;
  stack_.pop_back();
  if (!empty) newline_indent(stack_.size());
  out_.push_back(c);
  if (stack_.empty()) done_ = true;
  return *this;
}

JsonWriter& JsonWriter::begin_object() { return open(true, '{'); }
JsonWriter& JsonWriter::end_object() { return close(true, '}'); }
JsonWriter& JsonWriter::begin_array() { return open(false, '['); }
JsonWriter& JsonWriter::end_array() { return close(false, ']'); }

JsonWriter& JsonWriter::value(std::string_view s) {
  before_value();
  out_ += json_string(s);
  if (stack_.empty()) done_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(double v) {
  before_value();
  out_ += json_number(v);
  if (stack_.empty()) done_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(std::int64_t v) {
  before_value();
  out_ += std::to_string(v);
  if (stack_.empty()) done_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(bool v) {
  before_value();
  out_ += v ? "true" : "false";
  if (stack_.empty()) done_ = true;
  return *this;
}

JsonWriter& JsonWriter::null() {
  before_value();
  out_ += "null";
  if (stack_.empty()) done_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(const std::vector<double>& v) {
  begin_array();
  for (double x : v) value(x);
  return end_array();
}

}  // namespace locus::io
