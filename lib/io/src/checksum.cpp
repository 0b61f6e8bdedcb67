// Parallel CRC-32: per-rank byte ranges checksummed with zlib, combined with crc32_combine.
#include "locus/io/checksum.hpp"

#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "locus/comm/agree.hpp"
#include "source_file.hpp"

namespace locus::io {

namespace {

constexpr std::size_t kChunk = std::size_t{1} << 20;

std::uint32_t crc_of_range(const detail::InputFile& file, detail::Range range) {
  std::vector<unsigned char> buf(std::min<std::uint64_t>(kChunk, range.count()));
  uLong crc = crc32(0L, Z_NULL, 0);
  for (std::uint64_t off = range.begin; off < range.end;) {
    const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, range.end - off));
    const std::size_t got = file.read_at(buf.data(), want, off);
    if (got != want) {
      throw DataError("'" + file.path() + "' became shorter while it was being checksummed; " +
                      "do not modify input files during ingest");
    }
    crc = crc32(crc, buf.data(), static_cast<uInt>(got));
    off += got;
  }
  return static_cast<std::uint32_t>(crc);
}

}  // namespace

SourceFile checksum_file(const mpi::Comm& comm, const std::string& path) {
  std::optional<detail::InputFile> file;
  mpi::agree_on(comm, [&] { file.emplace(path); });
  // Rank 0's size decides the partition, so every rank splits the same byte count.
  std::uint64_t bytes = file->size();
  comm.bcast(std::span<std::uint64_t>(&bytes, 1));
  const detail::Range mine = detail::partition(bytes, comm.size(), comm.rank());

  std::uint32_t local = 0;
  mpi::agree_on(comm, [&] { local = crc_of_range(*file, mine); });
  const std::vector<std::uint64_t> crcs = comm.allgather<std::uint64_t>(local);
  const std::vector<std::uint64_t> lens = comm.allgather<std::uint64_t>(mine.count());

  uLong crc = crc32(0L, Z_NULL, 0);
  for (std::size_t r = 0; r < crcs.size(); ++r)
    crc = crc32_combine(crc, static_cast<uLong>(crcs[r]), static_cast<z_off_t>(lens[r]));
  return SourceFile{path, bytes, static_cast<std::uint32_t>(crc)};
}

}  // namespace locus::io
