// MPI start-up, scratch files and the error verdict for the fuzz targets.
#include "fuzz_support.hpp"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

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

void close_open_h5_objects() {
  // Everything but files first (they hold the files open), then the files.
  for (const unsigned types : {H5F_OBJ_DATASET | H5F_OBJ_GROUP | H5F_OBJ_DATATYPE | H5F_OBJ_ATTR,
                               unsigned{H5F_OBJ_FILE}}) {
    const ssize_t n = H5Fget_obj_count(H5F_OBJ_ALL, types);
    if (n <= 0) continue;
    std::vector<hid_t> ids(static_cast<std::size_t>(n));
    const ssize_t got = H5Fget_obj_ids(H5F_OBJ_ALL, types, ids.size(), ids.data());
    for (ssize_t i = 0; i < got; ++i) {
      const hid_t id = ids[static_cast<std::size_t>(i)];
      if (H5Iget_type(id) == H5I_FILE ? H5Fclose(id) < 0 : H5Oclose(id) < 0 && H5Aclose(id) < 0)
        unexpected("cannot close a leftover HDF5 object", std::to_string(id));
    }
  }
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
