// The dimension table of ingest.join: rank 0's read and size check, the two broadcasts, and
// the parse every rank does of the same bytes into a key -> values hash map.
#include "locus/io/join.hpp"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <optional>
#include <span>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"
#include "locus/io/raw_io.hpp"
#include "csv_fields.hpp"
#include "source_file.hpp"

namespace locus::io {

namespace {

// The lines of the bytes, each without its '\n' and '\r'; the last may lack the '\n'.
class Lines {
 public:
  explicit Lines(std::string_view bytes) : rest_(bytes) {}
  bool next(std::string_view& line) {
    if (done_) return false;
    const std::size_t at = rest_.find('\n');
    line = detail::strip_cr(rest_.substr(0, at));
    if (at == std::string_view::npos) {
      done_ = true;
      if (line.empty()) return false;  // the final '\n' ends the last line
    } else {
      rest_.remove_prefix(at + 1);
    }
    ++number_;
    return true;
  }
  std::int64_t number() const { return number_; }  // 1-based number of the last line returned

 private:
  std::string_view rest_;
  std::int64_t number_ = 0;
  bool done_ = false;
};

std::size_t column_of(const std::vector<std::string>& names, const std::string& path,
                      const std::string& name, const char* option) {
  const auto it = std::find(names.begin(), names.end(), name);
  if (it == names.end()) detail::throw_missing_column(path, name, option, names);
  return static_cast<std::size_t>(it - names.begin());
}

std::vector<std::string> header_names(std::string_view line, const JoinOptions& o) {
  if (line.starts_with("\xEF\xBB\xBF")) line.remove_prefix(3);  // UTF-8 byte order mark
  std::vector<std::string_view> fields;
  detail::split(line, o.delimiter, fields);
  std::vector<std::string> names(fields.begin(), fields.end());
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (names[i].empty()) {
      throw DataError(fmt::format("join table '{}' line 1 (the header): column {} has no name; "
                                  "the first line must name every column", o.path, i + 1));
    }
    const auto first = std::find(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(i),
                                 names[i]);
    if (first != names.begin() + static_cast<std::ptrdiff_t>(i)) {
      throw DataError(fmt::format("join table '{}' line 1 (the header): column '{}' appears "
                                  "twice; column names must be unique: rename one", o.path,
                                  names[i]));
    }
  }
  return names;
}

// Header column of each join column, in ingest.join_columns order.
std::vector<std::size_t> join_slots(const std::vector<std::string>& names, std::size_t key,
                                    const JoinOptions& o, std::vector<std::string>& columns) {
  std::vector<std::size_t> slots;
  if (o.columns.empty()) {
    for (std::size_t c = 0; c < names.size(); ++c) {
      if (c == key) continue;
      slots.push_back(c);
      columns.push_back(names[c]);
    }
    if (slots.empty()) {
      throw DataError(fmt::format("join table '{}' has only the key column '{}': nothing to "
                                  "join; add columns to it, or unset ingest.join", o.path, o.key));
    }
    return slots;
  }
  for (const std::string& name : o.columns) {
    if (name == o.key) {
      throw ConfigError(fmt::format("ingest.join_columns lists the join key '{}'; the key "
                                    "selects the row and is not joined as a feature: remove it "
                                    "from ingest.join_columns", name));
    }
    if (std::count(o.columns.begin(), o.columns.end(), name) > 1) {
      throw ConfigError(fmt::format("ingest.join_columns lists '{}' twice; list each column "
                                    "once", name));
    }
    slots.push_back(column_of(names, o.path, name, "join_columns"));
    columns.push_back(name);
  }
  return slots;
}

}  // namespace

const float* JoinTable::find(std::string_view key) const {
  const std::uint64_t h = std::hash<std::string_view>{}(key);
  const std::size_t mask = slots_.size() - 1;
  for (std::size_t i = h & mask;; i = (i + 1) & mask) {
    const Slot& s = slots_[i];
    if (s.row == 0) return nullptr;
    const std::size_t r = s.row - 1;
    if (s.hash == h &&
        std::string_view(keys_).substr(key_at_[r], key_at_[r + 1] - key_at_[r]) == key)
      return values_.data() + r * width();
  }
}

void JoinTable::build_index() {
  std::size_t size = 2;
  while (size < 2 * rows_) size *= 2;
  slots_.assign(size, Slot{});
  for (std::size_t r = 0; r < rows_; ++r) {
    const std::string_view k = std::string_view(keys_).substr(key_at_[r], key_at_[r + 1] - key_at_[r]);
    const std::uint64_t h = std::hash<std::string_view>{}(k);
    std::size_t i = h & (size - 1);
    while (slots_[i].row != 0) i = (i + 1) & (size - 1);  // keys are unique: no match to find
    slots_[i] = {h, static_cast<std::uint32_t>(r + 1)};
  }
}

JoinTable JoinTable::parse(std::string_view bytes, const JoinOptions& o) {
  JoinTable t;
  t.path_ = o.path;
  t.key_ = o.key;
  Lines lines(bytes);
  std::string_view line;
  if (!lines.next(line)) {
    throw DataError(fmt::format("join table '{}' is empty: it needs a header line naming its "
                                "columns (the key '{}' among them) and at least one data row",
                                o.path, o.key));
  }
  const std::vector<std::string> names = header_names(line, o);
  const std::size_t key = column_of(names, o.path, o.key, "join_key");
  const std::vector<std::size_t> slots = join_slots(names, key, o, t.columns_);
  const std::size_t w = slots.size();
  std::unordered_map<std::string_view, std::int64_t> first_line;  // key -> its line, for errors
  std::vector<std::string_view> fields;
  while (lines.next(line)) {
    if (std::all_of(line.begin(), line.end(), detail::is_blank)) continue;
    const std::int64_t n = lines.number();
    detail::split(line, o.delimiter, fields);
    const auto where = [&] { return fmt::format("join table '{}' line {}", o.path, n); };
    if (fields.size() != names.size()) {
      throw DataError(fmt::format("{}: the row has {} fields but the header has {} columns; every "
                                  "row needs one value per header column", where(),
                                  fields.size(), names.size()));
    }
    const std::string_view k = fields[key];
    if (k.empty()) {
      throw DataError(fmt::format("{}: the key column '{}' is empty; every row needs a key",
                                  where(), o.key));
    }
    const auto [it, fresh] = first_line.emplace(k, n);
    if (!fresh) {
      throw DataError(fmt::format("{}: key {} (column '{}') appears again, first on line {}; "
                                  "the keys of a join table must be unique: remove or merge "
                                  "the duplicate rows", where(), detail::shown(k), o.key,
                                  it->second));
    }
    t.values_.resize(t.values_.size() + w);
    float* out = t.values_.data() + t.values_.size() - w;
    for (std::size_t j = 0; j < w; ++j) {
      const std::string_view v = fields[slots[j]];
      if (v.empty() || !detail::parse_float(v, out[j])) {
        throw DataError(fmt::format("{}: join column '{}' has value {}, which is not a number "
                                    "(or is outside float32 range); joined columns become "
                                    "features and must be numeric (write nan for a missing "
                                    "value): fix the row, or leave the column out of "
                                    "ingest.join_columns", where(), names[slots[j]],
                                    detail::shown(v)));
      }
    }
    t.keys_ += k;
    t.key_at_.push_back(t.keys_.size());
    ++t.rows_;
  }
  if (t.rows_ == 0) {
    throw DataError(fmt::format("join table '{}' has no data rows: only the header line; it "
                                "needs one row per key", o.path));
  }
  if (t.rows_ >= UINT32_MAX) {
    throw ConfigError(fmt::format("join table '{}' has {} rows, more than the {} a join table "
                                  "may have; shrink it", o.path, t.rows_, UINT32_MAX - 1));
  }
  t.build_index();
  t.source_ = {o.path, bytes.size(),
               crc32_bytes(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())))};
  return t;
}

std::shared_ptr<const JoinTable> load_join_table(const mpi::Comm& comm, const JoinOptions& o) {
  std::vector<char> bytes;
  std::uint64_t size = 0;
  mpi::agree_on(comm, [&] {
    if (o.max_bytes > static_cast<std::uint64_t>(INT_MAX)) {
      throw ConfigError(fmt::format("ingest.join_max_mb = {} exceeds the {} MB one broadcast "
                                    "can carry; lower it", o.max_bytes >> 20, INT_MAX >> 20));
    }
    if (!comm.is_root()) return;
    const detail::InputFile file(o.path);
    size = file.size();
    if (size > o.max_bytes) {
      throw ConfigError(fmt::format(
          "join table '{}' is {:.1f} MiB, more than ingest.join_max_mb = {} allows: every rank "
          "holds a copy of it; raise ingest.join_max_mb if each rank has the memory, or shrink "
          "the table (fewer rows, or fewer columns than ingest.join_columns reads)",
          o.path, static_cast<double>(size) / (1 << 20), o.max_bytes >> 20));
    }
    bytes.resize(size);
    if (file.read_at(bytes.data(), size, 0) != size) {
      throw DataError(fmt::format("join table '{}' shrank while it was read; rerun once it is "
                                  "complete", o.path));
    }
  });
  comm.bcast(std::span<std::uint64_t>(&size, 1));
  bytes.resize(size);
  comm.bcast(std::span<char>(bytes));
  std::optional<JoinTable> t;
  mpi::agree_on(comm, [&] { t = JoinTable::parse(std::string_view(bytes.data(), size), o); });
  return std::make_shared<const JoinTable>(std::move(*t));
}

}  // namespace locus::io
