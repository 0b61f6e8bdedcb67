// MPI start-up, scratch files and the error verdict for the fuzz targets.
#include "fuzz_support.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

namespace locus::fuzz {

const mpi::Comm& world() {
  // libFuzzer leaves through exit(): MPI is finalized by an atexit handler, which runs before
  // LeakSanitizer's final check (registered earlier), so Open MPI's threads are gone by then
  // (LeakSanitizer cannot stop them and fails otherwise).
  static const mpi::Comm* comm = [] {
    // Open MPI's own SIGABRT/SIGSEGV/SIGBUS/SIGFPE handlers would replace libFuzzer's, and a
    // crash would then leave no input behind: handle no signal.
    ::setenv("OMPI_MCA_opal_signal", "", 0);
    int argc = 0;
    char** argv = nullptr;
    static mpi::Environment env(argc, argv);
    std::atexit([] { MPI_Finalize(); });
    return new mpi::Comm(mpi::Comm::world());
  }();
  return *comm;
}

ScratchFile::ScratchFile(std::string_view tag) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::is_directory("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
  path_ = (dir / fmt::format("locus-fuzz-{}-{}", ::getpid(), tag)).string();
}

ScratchFile::~ScratchFile() { remove(); }

void ScratchFile::remove() const { ::unlink(path_.c_str()); }

void ScratchFile::write(const void* data, std::size_t size) const {
  const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) unexpected("cannot create the scratch file", path_);
  const auto* p = static_cast<const char*>(data);
  for (std::size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, p + done, size - done);
    if (n <= 0) unexpected("cannot write the scratch file", path_);
    done += static_cast<std::size_t>(n);
  }
  ::close(fd);
}

bool expected_kind(ErrorKind k) {
  return k == ErrorKind::config || k == ErrorKind::data || k == ErrorKind::hdf5;
}

void unexpected(std::string_view what, std::string_view message) {
  std::fprintf(stderr, "locus fuzz: %.*s: %.*s\n", static_cast<int>(what.size()), what.data(),
               static_cast<int>(message.size()), message.data());
  std::abort();
}

}  // namespace locus::fuzz
