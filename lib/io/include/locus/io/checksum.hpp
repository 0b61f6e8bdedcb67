// Parallel CRC-32 of an input file, recorded in the dataset's provenance (SourceFile).
#pragma once

#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/io/table.hpp"

namespace locus::io {

// Collective over comm. Size and zlib CRC-32 of the file's bytes as stored (compressed bytes
// for a .gz). Each rank checksums its balanced byte range with pread, then the partial CRCs
// are combined in rank order with crc32_combine, so the result equals zlib's crc32 of the
// whole file and is identical on every rank. Throws DataError (on every rank) when the file
// cannot be opened or read.
SourceFile checksum_file(const mpi::Comm& comm, const std::string& path);

}  // namespace locus::io
