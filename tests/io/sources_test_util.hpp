// Helpers for the input-source tests: a shared temporary directory (rank 0 creates, every
// rank reads), crafted files written by rank 0 only, and the check that an error was thrown,
// agreed and identical on every rank.
#pragma once

#include <gtest/gtest.h>
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <string_view>

#include "locus/comm/error.hpp"
#include "locus/comm/mpi.hpp"

namespace locus::test {

// Collective over comm: a fresh directory visible to every rank, removed on destruction.
class SharedTempDir {
 public:
  explicit SharedTempDir(const mpi::Comm& comm) : comm_(comm) {
    std::string path;
    if (comm.is_root()) {
      const char* base = std::getenv("TMPDIR");
      std::string tmpl = std::string(base != nullptr ? base : "/tmp") + "/locus-src-XXXXXX";
      if (::mkdtemp(tmpl.data()) != nullptr) path = tmpl;
    }
    path_ = comm.bcast(path);
    if (path_.empty()) throw std::runtime_error("mkdtemp failed on rank 0");
  }
  SharedTempDir(const SharedTempDir&) = delete;
  SharedTempDir& operator=(const SharedTempDir&) = delete;
  ~SharedTempDir() {
    comm_.barrier();
    std::error_code ec;
    if (comm_.is_root()) std::filesystem::remove_all(path_, ec);
  }
  std::string file(std::string_view name) const { return path_ + "/" + std::string(name); }

 private:
  const mpi::Comm& comm_;
  std::string path_;
};

// Collective over comm: rank 0 writes the bytes (gzip-compressed when gzip), then a barrier,
// so every rank can read the file afterwards. (EXPECT, not ASSERT: rank 0 must reach the
// barrier.)
inline void write_shared(const mpi::Comm& comm, const std::string& path, std::string_view bytes,
                         bool gzip = false) {
  if (comm.is_root()) {
    if (gzip) {
      gzFile f = gzopen(path.c_str(), "wb6");
      EXPECT_NE(f, nullptr);
      if (f != nullptr && !bytes.empty()) {
        EXPECT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
                  static_cast<int>(bytes.size()));
      }
      if (f != nullptr) {
        EXPECT_EQ(gzclose(f), Z_OK);
      }
    } else {
      std::ofstream out(path, std::ios::binary);
      out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      EXPECT_TRUE(out.good()) << path;
    }
  }
  comm.barrier();
}

// Reads a whole file (every rank, for references computed independently of the library).
inline std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs fn on every rank and checks that it threw E on every rank, marked agreed, with the
// same message everywhere. Returns the message (empty when nothing was thrown).
template <class E>
std::string expect_agreed_error(const mpi::Comm& comm, const std::function<void()>& fn) {
  std::string msg;
  int threw = 0;
  try {
    fn();
  } catch (const E& e) {
    threw = 1;
    msg = e.what();
    EXPECT_TRUE(e.agreed()) << msg;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
  EXPECT_EQ(threw, 1) << "rank " << comm.rank() << " did not throw";
  EXPECT_EQ(comm.allreduce(threw, MPI_MIN), 1) << "some rank did not throw";
  EXPECT_EQ(comm.bcast(msg), msg) << "rank " << comm.rank() << " has a different message";
  return msg;
}

inline void expect_contains(const std::string& text, std::string_view part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

}  // namespace locus::test
