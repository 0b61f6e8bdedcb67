// Small file helpers for tests of locks and publication: a file's bytes, everything about a
// directory a job could change, and rank 0's pid (as a lock's holder record names it).
#pragma once

#include <unistd.h>

#include <fmt/format.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <span>
#include <string>

#include "locus/comm/mpi.hpp"

namespace locus::test {

inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Every file of a directory: name -> contents and modification time.
inline std::map<std::string, std::string> dir_snapshot(const std::string& dir) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    out[e.path().filename().string()] =
        fmt::format("{}|{}", slurp(e.path().string()),
                    fs::last_write_time(e.path()).time_since_epoch().count());
  }
  return out;
}

// Collective: rank 0's pid on every rank.
inline long root_pid(const mpi::Comm& comm) {
  std::int64_t pid = ::getpid();
  comm.bcast(std::span<std::int64_t>(&pid, 1));
  return static_cast<long>(pid);
}

}  // namespace locus::test
