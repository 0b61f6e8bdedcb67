// dump_json, the one function that turns locus's JSON documents into text: what the files
// promise (docs/FORMATS.md) -- member order as inserted, the compact and the indented layout,
// doubles that read back exactly and stay doubles, null for NaN and infinities, escapes, and
// valid JSON whatever bytes a string holds -- checked against the text itself, nlohmann's
// strict parser and Python's json module (the suite's readers).
#include <gtest/gtest.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "locus/io/json.hpp"

using locus::io::dump_json;
using locus::io::Json;

namespace {

// Python's json module reads `text` and `check` (a statement over the document d) holds.
// Without /usr/bin/python3 there is nothing to ask: the C++ checks stand alone.
bool python_accepts(const std::string& text, const std::string& check) {
  if (access("/usr/bin/python3", X_OK) != 0) return true;
  const std::string cmd =
      "/usr/bin/python3 -c 'import json,sys; d=json.load(sys.stdin); " + check + "'";
  FILE* p = popen(cmd.c_str(), "w");
  if (p == nullptr) return false;
  const bool written = std::fwrite(text.data(), 1, text.size(), p) == text.size();
  return pclose(p) == 0 && written;
}

// True when s is well-formed UTF-8 (no overlong forms, surrogates or truncated sequences).
bool valid_utf8(const std::string& s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t len = 1;
    unsigned lo = 0x80, hi = 0xBF;
    if (c < 0x80) len = 1;
    else if (c >= 0xC2 && c <= 0xDF) len = 2;
    else if (c >= 0xE0 && c <= 0xEF) { len = 3; lo = c == 0xE0 ? 0xA0 : 0x80; hi = c == 0xED ? 0x9F : 0xBF; }
    else if (c >= 0xF0 && c <= 0xF4) { len = 4; lo = c == 0xF0 ? 0x90 : 0x80; hi = c == 0xF4 ? 0x8F : 0xBF; }
    else return false;
    if (i + len > s.size()) return false;
    for (std::size_t k = 1; k < len; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return false;
    }
    i += len;
  }
  return true;
}

const std::string kReplacement = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

}  // namespace

TEST(Json, DoublesReadBackExactlyAndStayDoubles) {
  std::vector<double> nums = {0.1, -0.0, 1e300, 5e-324, 2.2250738585072014e-308, 1.0 / 3.0,
                              784, 4, 32000, 1e15, 1e16, 1e-5, -2.5e-8,
                              std::numeric_limits<double>::max()};
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200; ++i) nums.push_back(std::ldexp(static_cast<double>(rng() >> 11), -30));
  while (nums.size() < 2000) {  // arbitrary bit patterns: every exponent and mantissa
    const double v = std::bit_cast<double>(rng());
    if (std::isfinite(v)) nums.push_back(v);
  }
  for (double v : nums) {
    const std::string text = dump_json(Json(v));
    EXPECT_EQ(std::strtod(text.c_str(), nullptr), v) << text;
    EXPECT_EQ(std::signbit(std::strtod(text.c_str(), nullptr)), std::signbit(v)) << text;
    // A double field reads back as a float in Python (4.0, not the integer 4).
    EXPECT_NE(text.find_first_of(".e"), std::string::npos) << text;
    EXPECT_EQ(Json::parse(text).get<double>(), v) << text;
  }
  EXPECT_EQ(dump_json(Json(4.0)), "4.0");
  EXPECT_EQ(dump_json(Json(0.1)), "0.1");
  EXPECT_EQ(dump_json(Json(1e-5)), "1e-05");
  EXPECT_TRUE(python_accepts(dump_json(Json(nums)),
                             "assert d[0] == 0.1 and d[2] == 1e300 and d[3] == 5e-324 and "
                             "all(isinstance(x, float) for x in d) and len(d) == " +
                                 std::to_string(nums.size())));
}

TEST(Json, NonFiniteNumbersAreNull) {
  Json j;
  j["loss"] = std::numeric_limits<double>::quiet_NaN();
  j["hi"] = std::numeric_limits<double>::infinity();
  j["lo"] = -std::numeric_limits<double>::infinity();
  j["ok"] = 0.5;
  EXPECT_EQ(dump_json(j), R"({"loss":null,"hi":null,"lo":null,"ok":0.5})");
  EXPECT_TRUE(python_accepts(dump_json(j, 2), "assert d == {\"loss\": None, \"hi\": None, "
                                              "\"lo\": None, \"ok\": 0.5}"));
}

TEST(Json, IntegersAreExact) {
  Json j = Json::array({std::numeric_limits<std::int64_t>::min(),
                        std::numeric_limits<std::int64_t>::max(), std::int64_t{-9007199254740993},
                        0, 784});
  EXPECT_EQ(dump_json(j),
            "[-9223372036854775808,9223372036854775807,-9007199254740993,0,784]");
}

TEST(Json, MembersKeepInsertionOrderInBothLayouts) {
  Json j;
  j["type"] = "step";
  j["step"] = 7;
  j["epoch"] = 0;
  j["b"] = Json::array({1, 2});
  j["a"] = Json::object();
  j["empty"] = Json::array();
  j["z"] = nullptr;
  j["t"] = true;
  // Compact: one line, no spaces (the metrics lines; `grep '^{"type":"step","step":'` works).
  EXPECT_EQ(dump_json(j),
            R"({"type":"step","step":7,"epoch":0,"b":[1,2],"a":{},"empty":[],"z":null,"t":true})");
  EXPECT_EQ(dump_json(j, 0), dump_json(j));
  EXPECT_EQ(dump_json(j, -1), dump_json(j));
  // Indented (the reports): one member or element per line, "key": value, empty containers
  // closed on the same line.
  EXPECT_EQ(dump_json(j, 2),
            "{\n"
            "  \"type\": \"step\",\n"
            "  \"step\": 7,\n"
            "  \"epoch\": 0,\n"
            "  \"b\": [\n"
            "    1,\n"
            "    2\n"
            "  ],\n"
            "  \"a\": {},\n"
            "  \"empty\": [],\n"
            "  \"z\": null,\n"
            "  \"t\": true\n"
            "}");
}

TEST(Json, StringsAreEscaped) {
  EXPECT_EQ(dump_json(Json("a\"b\\c\n\x1f\t\r\b\f/")),
            "\"a\\\"b\\\\c\\n\\u001f\\t\\r\\b\\f/\"");
  EXPECT_EQ(dump_json(Json("\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80")),
            "\"\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");  // valid UTF-8 stays as it is
  EXPECT_EQ(dump_json(Json{{"k\"ey", "v"}}), R"({"k\"ey":"v"})");
}

// Invalid UTF-8 (a file path in Latin-1, a binary CSV header) must not throw -- nlohmann's
// default would, at serialization -- and must give a document every reader accepts.
TEST(Json, InvalidUtf8BecomesReplacementCharacter) {
  EXPECT_EQ(dump_json(Json("bad\xff")), "\"bad" + kReplacement + "\"");
  EXPECT_EQ(dump_json(Json("caf\xe9.h5")), "\"caf" + kReplacement + ".h5\"");  // Latin-1 é
  EXPECT_EQ(dump_json(Json("end\xc3")), "\"end" + kReplacement + "\"");        // truncated
  EXPECT_EQ(dump_json(Json("\xc0\xaf")), "\"" + kReplacement + kReplacement + "\"");  // overlong
  const std::string surrogate = dump_json(Json("\xed\xa0\x80x"));  // U+D800, encoded
  EXPECT_TRUE(valid_utf8(surrogate) && surrogate.ends_with(kReplacement + "x\"")) << surrogate;

  const std::string tricky = "q\"b\\n\nt\tc\x01 \xc3\xa9 bad\xff\xc3 \xe2\x82 \xf4\x90\x80\x80 ok";
  Json j;
  j["path"] = tricky;
  j[std::string("key\xfe")] = Json::array({"\x80", tricky});
  for (int indent : {0, 2}) {
    std::string text;
    ASSERT_NO_THROW(text = dump_json(j, indent));
    EXPECT_TRUE(valid_utf8(text)) << text;
    Json back;
    ASSERT_NO_THROW(back = Json::parse(text)) << text;  // strict: rejects invalid UTF-8
    const std::string path = back["path"].get<std::string>();
    EXPECT_EQ(path.rfind("q\"b\\n\nt\tc\x01 \xc3\xa9 bad" + kReplacement, 0), 0u) << path;
    EXPECT_EQ(path.substr(path.size() - 3), " ok") << path;
    EXPECT_TRUE(back.contains("key" + kReplacement)) << text;
    EXPECT_TRUE(python_accepts(text, "assert d[\"path\"].startswith(\"q\\\"b\\\\n\\nt\\tc\\x01 "
                                     "\\xe9 bad\\ufffd\") and d[\"path\"].endswith(\" ok\") and "
                                     "d[\"key\\ufffd\"][0] == \"\\ufffd\""))
        << text;
  }
}
