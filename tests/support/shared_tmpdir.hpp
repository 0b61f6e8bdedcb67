// A temporary directory shared by all ranks of a test: rank 0 creates it, everyone learns its
// name, rank 0 removes it when the last rank is done.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>

#include "locus/comm/mpi.hpp"

namespace locus::test {

class SharedTmpDir {
 public:
  explicit SharedTmpDir(const mpi::Comm& comm) : comm_(comm.view()) {
    std::string path;
    if (comm_.is_root()) {
      std::string tmpl = (std::filesystem::temp_directory_path() / "locus-test.XXXXXX").string();
      if (::mkdtemp(tmpl.data()) == nullptr) std::abort();
      path = tmpl;
    }
    path_ = comm_.bcast(path);
  }
  SharedTmpDir(const SharedTmpDir&) = delete;
  SharedTmpDir& operator=(const SharedTmpDir&) = delete;
  ~SharedTmpDir() {
    comm_.barrier();
    if (comm_.is_root()) {
      std::error_code ec;
      std::filesystem::remove_all(path_, ec);
    }
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  mpi::Comm comm_;
  std::string path_;
};

}  // namespace locus::test
