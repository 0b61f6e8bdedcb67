// The broadcast join of locus-ingest: a small dimension table (CSV with a header) read once by
// rank 0, broadcast to every rank, held as a hash map from its key to its numeric columns, and
// joined to each row of the large input as that row is parsed -- no shuffle of the large input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/io/table.hpp"

namespace locus::io {

struct JoinOptions {
  std::string path;                  // the dimension table; "" = no join
  std::string key;                   // a column of both tables, compared as text
  std::vector<std::string> columns;  // features added, in this order; empty: every column of
                                     // the table but the key, in file order
  std::uint64_t max_bytes = std::uint64_t{256} << 20;  // larger tables are refused
  char delimiter = ',';              // run_ingest uses the input's (ingest.csv_delimiter)
};

// The parsed dimension table, identical on every rank. Keys are compared as the text written
// in the file (trimmed and unquoted as every CSV field): "7", "07" and "7.0" are three keys.
class JoinTable {
 public:
  const std::string& path() const noexcept { return path_; }
  const std::string& key() const noexcept { return key_; }
  const std::vector<std::string>& columns() const noexcept { return columns_; }
  std::size_t width() const noexcept { return columns_.size(); }
  std::size_t rows() const noexcept { return rows_; }
  // The key's join_columns values (width() floats), or nullptr when the table lacks the key.
  const float* find(std::string_view key) const;
  // Path, size and CRC-32 of the bytes joined (for the dataset's provenance).
  const SourceFile& source() const noexcept { return source_; }

  // Local: parses the table's bytes. Throws DataError naming the file (and the line, the key,
  // the column and the value) for a missing header, key or join column, a duplicate key, a
  // ragged row, an empty or non-numeric value, no data rows; ConfigError for a join column
  // listed twice or naming the key.
  static JoinTable parse(std::string_view bytes, const JoinOptions& opts);

 private:
  // Open addressing with linear probing over a power-of-two table at most half full, each slot
  // holding its key's hash: a lookup is one hash, a masked index and (almost always) one key
  // comparison. (std::unordered_map's chained nodes and modulo by a prime cost 11% of a joined
  // ingest's samples under perf; see bench/RESULTS.md.)
  struct Slot {
    std::uint64_t hash = 0;
    std::uint32_t row = 0;  // 1-based; 0: empty
  };
  void build_index();

  std::string path_, key_;
  std::vector<std::string> columns_;
  std::size_t rows_ = 0;
  std::vector<float> values_;          // rows x width, in file order
  std::string keys_;                   // every key, back to back, in file order
  std::vector<std::size_t> key_at_{0};  // row r's key: keys_[key_at_[r], key_at_[r + 1])
  std::vector<Slot> slots_;
  SourceFile source_;
};

// Collective over comm. Rank 0 checks the file's size against opts.max_bytes (a ConfigError
// naming the file, its size and ingest.join_max_mb when larger) and reads it; one MPI_Bcast of
// the size, then one of the raw bytes; every rank parses the same bytes (JoinTable::parse).
// Errors are agreed: every rank throws the same one.
std::shared_ptr<const JoinTable> load_join_table(const mpi::Comm& comm, const JoinOptions& opts);

}  // namespace locus::io
