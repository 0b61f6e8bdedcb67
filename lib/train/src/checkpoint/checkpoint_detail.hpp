// Private to the checkpoint sources: tensor naming, digests (zlib CRC-32 combined across
// ranks), FNV-1a fingerprints and the agreed-IoError wrapper of write phases.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"
#include "locus/comm/mpi.hpp"
#include "locus/io/file.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"

namespace locus::train::detail {

inline constexpr const char* kCrcAttr = "crc32";

// Every tensor dataset of a checkpoint, in file order: /model/<name> for the parameters, then
// /optimizer/<state>/<name> per optimizer state buffer.
struct TensorSlot {
  std::string path;       // "/model/layers.0.weight"
  TensorInfo tensor;      // offset/shape in the parameter layout
  int state = -1;         // -1: the parameters; else index into the optimizer state names
};
std::vector<TensorSlot> tensor_slots(const ParamLayout& layout,
                                     const std::vector<std::string>& state_names);

// zlib CRC-32 of bytes (any length).
std::uint32_t crc32_of(std::span<const std::byte> bytes);

// Collective over the file's communicator: the root attributes of m, meta_crc32 last.
void write_meta(hid_t root, const CheckpointMeta& m);
// Local: the metadata of an open checkpoint (root and /model attributes); DataError naming the
// file for anything missing, malformed, newer than this build or not matching meta_crc32.
CheckpointMeta read_meta(h5::File& file);

// 64-bit FNV-1a, as 16 hex digits.
std::uint64_t fnv1a(std::string_view bytes, std::uint64_t h = 0xcbf29ce484222325ull);
std::string hex64(std::uint64_t v);

// Collective over comm: runs fn; any failure on any rank becomes an agreed IoError naming the
// checkpoint path and the phase (so a full disk or a file size limit reads as such).
template <class Fn>
void write_phase(const mpi::Comm& comm, const std::string& path, const char* phase, Fn&& fn) {
  mpi::agree_on(comm, [&] {
    try {
      fn();
    } catch (const IoError&) {
      throw;
    } catch (const std::exception& e) {
      throw IoError(fmt::format("cannot write checkpoint '{}' ({}): {}; the previous checkpoint "
                                "is untouched: free space or raise the file size limit, or set "
                                "checkpoint.dir to another file system",
                                path, phase, e.what()));
    }
  });
}

}  // namespace locus::train::detail
