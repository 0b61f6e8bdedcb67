// Reads a whole locus dataset back (metadata and every row), collectively over comm: what the
// ingest suites compare against their expectations.
#pragma once

#include <cstdint>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/io/dataset_file.hpp"

namespace locus::test {

struct ReadBack {
  io::DatasetMeta meta;
  io::Table rows;
};

inline ReadBack read_back(const mpi::Comm& comm, const std::string& path) {
  h5::File f = h5::File::open(comm, path, h5::File::Mode::read);
  ReadBack b;
  b.meta = io::read_meta(f);
  b.rows = io::read_rows(f, b.meta, {0, static_cast<std::uint64_t>(b.meta.rows)});
  return b;
}

}  // namespace locus::test
