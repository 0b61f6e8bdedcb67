// CSV reader: header and column selection, the per-rank line range, field parsing with
// std::from_chars, and error messages that carry the global line number.
#include "locus/io/csv.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cfloat>
#include <cmath>
#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "locus/comm/agree.hpp"
#include "locus/io/unit_source.hpp"
#include "csv_fields.hpp"
#include "source_file.hpp"

namespace locus::io {

namespace detail {

bool is_blank(char c) { return c == ' ' || c == '\t'; }

std::string_view trim(std::string_view s) {
  while (!s.empty() && is_blank(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_blank(s.back())) s.remove_suffix(1);
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

std::string_view strip_cr(std::string_view s) {
  if (!s.empty() && s.back() == '\r') s.remove_suffix(1);
  return s;
}

void split(std::string_view line, char delim, std::vector<std::string_view>& out) {
  out.clear();
  for (;;) {
    const std::size_t at = line.find(delim);
    out.push_back(trim(line.substr(0, at)));
    if (at == std::string_view::npos) return;
    line.remove_prefix(at + 1);
  }
}

std::string shown(std::string_view v) {
  if (v.size() > 40) return fmt::format("'{}...'", v.substr(0, 40));
  return fmt::format("'{}'", v);
}

namespace {

std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const char ca = static_cast<char>(std::tolower(static_cast<unsigned char>(a[i - 1])));
      const char cb = static_cast<char>(std::tolower(static_cast<unsigned char>(b[j - 1])));
      const std::size_t next = std::min({row[j] + 1, row[j - 1] + 1, diag + (ca != cb)});
      diag = row[j];
      row[j] = next;
    }
  }
  return row[b.size()];
}

}  // namespace

[[noreturn]] void throw_missing_column(const std::string& path, const std::string& name,
                                       const char* option, const std::vector<std::string>& names) {
  std::string hint;
  std::size_t best = std::string::npos;
  for (const auto& n : names) {
    const std::size_t d = edit_distance(name, n);
    if (d < best && d <= std::max<std::size_t>(2, name.size() / 2)) {
      best = d;
      hint = fmt::format("did you mean '{}'? ", n);
    }
  }
  const std::size_t shown_max = 20;
  std::string list = fmt::format(
      "{}", fmt::join(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(
                                                         std::min(shown_max, names.size())),
                      ", "));
  if (names.size() > shown_max) list += fmt::format(", ... ({} more)", names.size() - shown_max);
  throw DataError(fmt::format("'{}' has no column '{}' (named by [ingest] {}); {}the header has "
                              "{} columns: {}; fix the name in [ingest]",
                              path, name, option, hint, names.size(), list));
}

bool parse_float(std::string_view s, float& out) {
  const char* b = s.data();
  const char* e = b + s.size();
  if (b != e && *b == '+' && e - b > 1 && b[1] != '-' && b[1] != '+') ++b;
  const auto [ptr, ec] = std::from_chars(b, e, out);
  if (ptr != e) return false;
  if (ec == std::errc()) return true;
  if (ec != std::errc::result_out_of_range) return false;
  double d = 0;
  const auto [dptr, dec] = std::from_chars(b, e, d);
  if (dec != std::errc() || dptr != e || !(std::fabs(d) <= FLT_MAX)) return false;
  out = static_cast<float>(d);
  return true;
}

}  // namespace detail

namespace {

using detail::is_blank;
using detail::parse_float;
using detail::shown;
using detail::split;
using detail::strip_cr;
using detail::throw_missing_column;

constexpr int kSkip = -1;   // column not selected: not parsed at all
constexpr int kLabel = -2;  // the label column
constexpr int kJoinKey = -3;  // ingest.join_key: looked up in the join table, not a feature
constexpr std::uint64_t kPollBytes = std::uint64_t{1} << 20;  // keep_going() period

// What is wrong with one data row (the line number is added by the caller).
struct RowError {
  std::string detail;
};

// A parse failure on one line of this rank; the global line number is added after an
// exclusive scan of the ranks' line counts.
struct LineError {
  std::int64_t local_line = 0;  // 0-based among this rank's lines
  std::string detail;
};

struct CsvLayout {
  std::vector<std::string> names;  // header columns
  std::unordered_map<std::string, std::size_t> index;  // name -> column (wide files: no O(M^2))
  std::vector<int> slot;           // per header column: feature index, kLabel, kJoinKey or kSkip
  std::vector<std::string> feature_names;  // the input's selected columns, then the joined ones
  std::size_t joined_at = 0;       // the first joined feature (= the input's feature count)
  std::uint64_t data_begin = 0;    // file offset of the first line after the header
};

std::size_t find_column(const CsvLayout& l, const std::string& path, const std::string& name,
                        const char* option) {
  const auto it = l.index.find(name);
  if (it == l.index.end()) throw_missing_column(path, name, option, l.names);
  return it->second;
}

void check_options(const CsvOptions& opts) {
  if (opts.delimiter == '\n' || opts.delimiter == '\r' || opts.delimiter == '"') {
    throw ConfigError(fmt::format("[ingest] CSV delimiter {:?} is not allowed; use ',', ';', "
                                  "'\\t' or another character that separates fields",
                                  opts.delimiter));
  }
  for (std::size_t i = 0; i < opts.feature_columns.size(); ++i) {
    const std::string& f = opts.feature_columns[i];
    if (!opts.label_column.empty() && f == opts.label_column) {
      throw ConfigError(fmt::format("[ingest] label column '{}' is also listed in "
                                    "feature_columns; a column is either the label or a "
                                    "feature: remove it from feature_columns", f));
    }
    if (std::find(opts.feature_columns.begin(), opts.feature_columns.begin() +
                  static_cast<std::ptrdiff_t>(i), f) != opts.feature_columns.begin() +
                  static_cast<std::ptrdiff_t>(i)) {
      throw ConfigError(fmt::format("[ingest] feature_columns lists '{}' twice; list each "
                                    "column once", f));
    }
  }
}

// Column names from the header line, unique and non-empty, and their index.
void read_header_names(std::string_view line, const CsvOptions& opts, CsvLayout& l) {
  if (line.starts_with("\xEF\xBB\xBF")) line.remove_prefix(3);  // UTF-8 byte order mark
  std::vector<std::string_view> fields;
  split(strip_cr(line), opts.delimiter, fields);
  l.names.assign(fields.begin(), fields.end());
  l.index.reserve(l.names.size());
  for (std::size_t i = 0; i < l.names.size(); ++i) {
    if (l.names[i].empty()) {
      throw DataError(fmt::format("'{}' line 1 (the header): column {} has no name; the first "
                                  "line must name every column (is the header missing?)",
                                  opts.path, i + 1));
    }
    const auto [it, fresh] = l.index.emplace(l.names[i], i);
    if (!fresh) {
      throw DataError(fmt::format("'{}' line 1 (the header): column '{}' appears twice "
                                  "(columns {} and {}); column names must be unique: rename "
                                  "one", opts.path, l.names[i], it->second + 1, i + 1));
    }
  }
}

// The join key is a column of its own: neither the label nor a feature.
void check_join_key(const CsvOptions& opts, const JoinTable& join) {
  if (join.key() == opts.label_column) {
    throw ConfigError(fmt::format("ingest.join_key '{}' is also the label column; the key "
                                  "selects the join table's row: name another column",
                                  join.key()));
  }
  if (std::find(opts.feature_columns.begin(), opts.feature_columns.end(), join.key()) !=
      opts.feature_columns.end()) {
    throw ConfigError(fmt::format("ingest.csv_features lists the join key '{}'; the key is "
                                  "compared as text and is not a feature: remove it from "
                                  "ingest.csv_features", join.key()));
  }
}

// The joined features follow the input's, in ingest.join_columns order; no name twice.
void add_join_columns(const CsvOptions& opts, const JoinTable& join, CsvLayout& l) {
  for (const std::string& name : join.columns()) {
    if (std::find(l.feature_names.begin(), l.feature_names.end(), name) != l.feature_names.end()) {
      throw ConfigError(fmt::format("join column '{}' of '{}' has the name of a feature column "
                                    "of '{}'; feature names must be unique: leave it out of "
                                    "ingest.join_columns or of ingest.csv_features",
                                    name, join.path(), opts.path));
    }
    l.feature_names.push_back(name);
  }
}

// Reads the header line and decides which column goes where. Local; no communication.
CsvLayout read_layout(const detail::InputFile& file, const CsvOptions& opts,
                      const JoinTable* join = nullptr) {
  check_options(opts);
  detail::LineReader reader(file, 0, file.size());
  std::string_view line;
  std::uint64_t start = 0;
  if (!reader.next(line, start)) {
    throw DataError(fmt::format("'{}' is empty: no header and no data rows; a CSV needs a header "
                                "line with the column names and at least one data row",
                                opts.path));
  }
  CsvLayout l;
  l.data_begin = line.size() + 1;  // header bytes + '\n' (past the end when there is none)
  read_header_names(line, opts, l);
  l.slot.assign(l.names.size(), kSkip);
  if (!opts.label_column.empty())
    l.slot[find_column(l, opts.path, opts.label_column, "label_column")] = kLabel;
  if (join != nullptr) check_join_key(opts, *join);
  if (join != nullptr) l.slot[find_column(l, opts.path, join->key(), "join_key")] = kJoinKey;
  if (opts.feature_columns.empty()) {
    for (std::size_t c = 0; c < l.names.size(); ++c) {
      if (l.slot[c] == kLabel || l.slot[c] == kJoinKey) continue;
      l.slot[c] = static_cast<int>(l.feature_names.size());
      l.feature_names.push_back(l.names[c]);
    }
  } else {
    for (const auto& name : opts.feature_columns) {
      l.slot[find_column(l, opts.path, name, "feature_columns")] =
          static_cast<int>(l.feature_names.size());
      l.feature_names.push_back(name);
    }
  }
  if (l.feature_names.empty()) {
    throw DataError(fmt::format("'{}' has no feature columns: its only column is the label '{}'; "
                                "a table needs at least one feature", opts.path,
                                opts.label_column));
  }
  l.joined_at = l.feature_names.size();
  if (join != nullptr) add_join_columns(opts, *join, l);
  return l;
}

bool parse_label(std::string_view s, std::int32_t& out) {
  const char* b = s.data();
  const char* e = b + s.size();
  if (b != e && *b == '+' && e - b > 1 && b[1] != '-' && b[1] != '+') ++b;
  const auto [ptr, ec] = std::from_chars(b, e, out);
  return ec == std::errc() && ptr == e;
}

// Parses one data line into features (D floats) and the label; throws a detail message.
void parse_row(const std::vector<std::string_view>& fields, const CsvLayout& l,
               const CsvOptions& opts, float* features, std::int32_t* label,
               std::string_view* key) {
  if (fields.size() != l.names.size()) {
    throw RowError{fmt::format(
        "the row has {} fields but the header has {} columns; every row needs one value per "
        "header column (look for a missing or extra {:?})",
        fields.size(), l.names.size(), opts.delimiter)};
  }
  for (std::size_t c = 0; c < fields.size(); ++c) {
    const int slot = l.slot[c];
    if (slot == kSkip) continue;
    const std::string_view v = fields[c];
    if (v.empty()) {
      throw RowError{fmt::format("column '{}' is empty; every selected column needs a value "
                                 "(write nan for a missing feature value)", l.names[c])};
    }
    if (slot == kJoinKey) {
      *key = v;
    } else if (slot == kLabel) {
      if (!parse_label(v, *label)) {
        throw RowError{fmt::format("label column '{}' has value {}, which is not an integer; "
                                   "labels must be whole numbers within int32 range (e.g. 3, "
                                   "not 3.0 or a class name)", l.names[c], shown(v))};
      }
    } else if (!parse_float(v, features[slot])) {
      throw RowError{fmt::format("column '{}' has value {}, which is not a number (or is "
                                 "outside float32 range); fix the row, or leave the column "
                                 "out of [ingest] feature_columns", l.names[c], shown(v))};
    }
  }
}

[[noreturn]] void throw_no_rows(const std::string& path, std::size_t columns) {
  throw DataError(fmt::format("'{}' has no data rows: only the header line ({} columns); a CSV "
                              "needs at least one data row after the header", path, columns));
}

struct LocalParse {
  std::int64_t lines = 0;  // physical lines that start in this rank's range
  bool stopped = false;    // keep_going said stop
  std::optional<LineError> line_error;
  std::optional<mpi::Failure> other_error;  // I/O failure, not tied to a line
  std::int64_t join_missing = 0;            // rows left out: the join table lacks their key
  std::optional<JoinMiss> first_missing;
};

// Parses the lines that start in [range.begin, range.end) into t. Never throws, so every
// rank reaches the collectives that follow.
// keep_going (when given) is asked about every MiB of input; parsing stops when it says false
// (LocalParse::stopped).
// With a join table, each row gets the values of its key appended; a row whose key the table
// lacks is left out and counted (the join_missing gate decides).
LocalParse parse_range(const detail::InputFile& file, std::uint64_t limit, const CsvLayout& l,
                       const CsvOptions& opts, detail::Range range, bool first_rank, Table& t,
                       const std::function<bool()>* keep_going = nullptr,
                       const JoinTable* join = nullptr) {
  LocalParse out;
  try {
    if (range.count() == 0) return out;
    // Starting one byte early and dropping that partial line finds the first line start >= begin.
    detail::LineReader reader(file, first_rank ? range.begin : range.begin - 1, limit);
    std::string_view line;
    std::uint64_t start = 0;
    if (!first_rank) reader.next(line, start);
    std::vector<std::string_view> fields;
    const auto d = static_cast<std::size_t>(t.cols);
    std::uint64_t next_poll = range.begin + kPollBytes;
    while (reader.next(line, start) && start < range.end) {
      if (keep_going != nullptr && start >= next_poll) {
        next_poll = start + kPollBytes;
        if (!(*keep_going)()) {
          out.stopped = true;
          return out;
        }
      }
      ++out.lines;
      line = strip_cr(line);
      if (std::all_of(line.begin(), line.end(), is_blank)) continue;
      split(line, opts.delimiter, fields);
      const std::size_t row = t.features.size() / d;
      t.features.resize(t.features.size() + d);
      if (t.has_labels) t.labels.resize(row + 1);
      std::string_view key;
      try {
        parse_row(fields, l, opts, t.features.data() + row * d,
                  t.has_labels ? t.labels.data() + row : nullptr, &key);
      } catch (RowError& e) {
        out.line_error = LineError{out.lines - 1, std::move(e.detail)};
        return out;
      }
      if (join == nullptr) continue;
      if (const float* v = join->find(key)) {
        std::copy_n(v, join->width(), t.features.data() + row * d + l.joined_at);
        continue;
      }
      if (out.join_missing++ == 0) out.first_missing = JoinMiss{out.lines - 1, std::string(key)};
      t.features.resize(row * d);
      if (t.has_labels) t.labels.resize(row);
    }
  } catch (const Error& e) {
    out.other_error = mpi::Failure{e.kind(), e.what()};
  } catch (const std::exception& e) {
    out.other_error = mpi::Failure{ErrorKind::internal, e.what()};
  }
  return out;
}

// The lines of fixed byte ranges, each rank parsing the units it is handed.
class CsvUnits final : public UnitSource {
 public:
  CsvUnits(const CsvOptions& opts, detail::InputFile file, CsvLayout layout, std::uint64_t limit,
           std::uint64_t unit_bytes, std::shared_ptr<const JoinTable> join)
      : opts_(opts), file_(std::move(file)), layout_(std::move(layout)), limit_(limit),
        join_(std::move(join)) {
    begin_ = std::min(layout_.data_begin, limit_);
    const std::uint64_t data = limit_ - begin_;
    unit_bytes_ = unit_bytes == 0 ? auto_unit_bytes(data) : unit_bytes;
    units_ = std::max<std::uint64_t>(1, (data + unit_bytes_ - 1) / unit_bytes_);
    header_.cols = static_cast<std::int64_t>(layout_.feature_names.size());
    header_.has_labels = !opts.label_column.empty();
    header_.label_name = opts.label_column;
    header_.feature_names = layout_.feature_names;
  }

  std::int64_t units() const override { return static_cast<std::int64_t>(units_); }
  std::uint64_t unit_bytes() const override { return unit_bytes_; }
  const Table& header() const override { return header_; }

  UnitParse parse(std::int64_t unit, Table& t, const std::function<bool()>& keep_going) override {
    const auto u = static_cast<std::uint64_t>(unit);
    const detail::Range range{std::min(limit_, begin_ + u * unit_bytes_),
                              std::min(limit_, begin_ + (u + 1) * unit_bytes_)};
    const LocalParse p =
        parse_range(file_, limit_, layout_, opts_, range, u == 0, t, &keep_going, join_.get());
    UnitParse out;
    out.lines = p.lines;
    out.abandoned = p.stopped;
    out.join_missing = p.join_missing;
    out.first_missing = p.first_missing;
    if (p.other_error) out.error = UnitError{p.other_error->kind, p.other_error->message};
    if (p.line_error) out.error = UnitError{ErrorKind::data, p.line_error->detail, p.line_error->local_line};
    return out;
  }

  std::string describe(const UnitError& e, std::int64_t lines_before) const override {
    if (e.line < 0) return e.message;
    // Line 1 is the header.
    return fmt::format("'{}' line {}: {}", opts_.path, 2 + lines_before + e.line, e.message);
  }

  void check_total_rows(std::int64_t rows) const override {
    if (rows == 0) throw_no_rows(opts_.path, layout_.names.size());
  }

 private:
  CsvOptions opts_;
  detail::InputFile file_;
  CsvLayout layout_;
  std::uint64_t limit_ = 0, begin_ = 0, unit_bytes_ = 1, units_ = 1;
  Table header_;
  std::shared_ptr<const JoinTable> join_;  // null without ingest.join
};

}  // namespace

std::unique_ptr<UnitSource> open_csv_units(const mpi::Comm& comm, const CsvOptions& opts,
                                           std::uint64_t unit_bytes,
                                           std::shared_ptr<const JoinTable> join) {
  std::optional<detail::InputFile> file;
  CsvLayout layout;
  mpi::agree_on(comm, [&] {
    file.emplace(opts.path);
    layout = read_layout(*file, opts, join.get());
  });
  // Rank 0's size ends the last unit, so every rank cuts the same units.
  std::uint64_t limit = file->size();
  comm.bcast(std::span<std::uint64_t>(&limit, 1));
  return std::make_unique<CsvUnits>(opts, std::move(*file), std::move(layout), limit, unit_bytes,
                                    std::move(join));
}

Table read_csv(const mpi::Comm& comm, const CsvOptions& opts) {
  std::optional<detail::InputFile> file;
  CsvLayout layout;
  mpi::agree_on(comm, [&] {
    file.emplace(opts.path);
    layout = read_layout(*file, opts);
  });
  // Rank 0's size decides the partition, so every rank splits the same byte count.
  std::uint64_t limit = file->size();
  comm.bcast(std::span<std::uint64_t>(&limit, 1));
  const std::uint64_t begin = std::min(layout.data_begin, limit);
  detail::Range range = detail::partition(limit - begin, comm.size(), comm.rank());
  range = {range.begin + begin, range.end + begin};

  Table t;
  t.cols = static_cast<std::int64_t>(layout.feature_names.size());
  t.has_labels = !opts.label_column.empty();
  t.label_name = opts.label_column;
  t.feature_names = layout.feature_names;
  const LocalParse local =
      parse_range(*file, limit, layout, opts, range, comm.rank() == 0, t);
  // Line 1 is the header; the lines of lower ranks come before this rank's first line.
  const std::int64_t first_line = 2 + comm.exscan_sum(local.lines);
  mpi::agree_on(comm, [&] {
    if (local.other_error) throw_error(local.other_error->kind, local.other_error->message, false);
    if (local.line_error) {
      throw DataError(fmt::format("'{}' line {}: {}", opts.path,
                                  first_line + local.line_error->local_line,
                                  local.line_error->detail));
    }
  });
  const std::int64_t total = comm.allreduce<std::int64_t>(t.rows(), MPI_SUM);
  mpi::agree_on(comm, [&] {
    if (total == 0) throw_no_rows(opts.path, layout.names.size());
  });
  return t;
}

}  // namespace locus::io
