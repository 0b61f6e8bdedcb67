// dd/cat baselines, page-cache eviction and residency, idle waits (see raw_baseline.hpp).
#include "raw_baseline.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"

namespace locus::bench {

namespace {

constexpr std::uint64_t kDdBlock = std::uint64_t{16} << 20;

std::string quoted(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw IoError(fmt::format("{} '{}': {}", what, path, std::strerror(errno)));
}

}  // namespace

void idle_barrier(const mpi::Comm& comm) {
  MPI_Request req = MPI_REQUEST_NULL;
  LOCUS_MPI_CHECK(MPI_Ibarrier(comm.get(), &req));
  int done = 0;
  for (;;) {
    LOCUS_MPI_CHECK(MPI_Test(&req, &done, MPI_STATUS_IGNORE));
    if (done != 0) return;
    ::usleep(100);  // a 0.1 ms poll: far below the seconds being measured
  }
}

void on_root(const mpi::Comm& comm, const std::function<void()>& fn) {
  std::optional<mpi::Failure> local;
  if (comm.is_root()) {
    try {
      fn();
    } catch (const Error& e) {
      local = mpi::Failure{e.kind(), e.what()};
    } catch (const std::exception& e) {
      local = mpi::Failure{ErrorKind::internal, e.what()};
    }
  }
  idle_barrier(comm);
  if (auto f = mpi::agree(comm, local)) throw_error(f->kind, f->message, /*agreed=*/true);
}

// posix_spawn, not std::system: fork() would copy the page tables of this process's
// gigabyte of buffers into every dd/cat, a cost charged to the raw side only.
void run_shell(const std::string& command) {
  const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
  pid_t pid = 0;
  int rc = ::posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char* const*>(argv),
                         environ);
  int status = 0;
  if (rc == 0 && ::waitpid(pid, &status, 0) != pid) rc = errno;
  if (rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    throw IoError(fmt::format("command failed ({}): {}; run it by hand to see why (disk full? "
                              "dd or cat missing?)",
                              rc != 0 ? std::strerror(rc)
                                      : fmt::format("status {}", WIFEXITED(status)
                                                                     ? WEXITSTATUS(status)
                                                                     : status),
                              command));
  }
}

std::string dd_write_command(const std::string& path, std::uint64_t bytes) {
  LOCUS_ASSERT(bytes % kDdBlock == 0, fmt::format("{} bytes is not a multiple of 16 MiB", bytes));
  return fmt::format("dd if=/dev/zero of={} bs=16M count={} conv=fsync status=none", quoted(path),
                     bytes / kDdBlock);
}

std::string cat_read_command(const std::string& path) {
  return fmt::format("cat {} > /dev/null", quoted(path));
}

void evict_from_page_cache(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) io_fail("cannot open to evict from the page cache", path);
  // Only clean pages can be dropped: write back anything still dirty first.
  int rc = ::fdatasync(fd);
  if (rc == 0) rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  const int err = rc > 0 ? rc : errno;
  ::close(fd);
  errno = err;
  if (rc != 0) io_fail("cannot evict from the page cache", path);
}

double resident_fraction(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) io_fail("cannot open", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size == 0) {
    ::close(fd);
    return 0.0;
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) io_fail("cannot mmap", path);
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> vec((size + page - 1) / page);
  const int rc = ::mincore(map, size, vec.data());
  ::munmap(map, size);
  if (rc != 0) io_fail("mincore failed for", path);
  std::size_t resident = 0;
  for (unsigned char v : vec) resident += v & 1u;
  return static_cast<double>(resident) / static_cast<double>(vec.size());
}

std::string filesystem_type(const std::string& dir) {
  struct statfs s {};
  if (::statfs(dir.c_str(), &s) != 0) io_fail("cannot statfs", dir);
  switch (static_cast<unsigned long>(s.f_type)) {
    case 0xEF53: return "ext4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    case 0x6969: return "nfs";
    case 0x0BD00BD0: return "lustre";
    case 0x47504653: return "gpfs";
    case 0x794C7630: return "overlayfs";
    default: return fmt::format("statfs magic {:#x}", static_cast<unsigned long>(s.f_type));
  }
}

void remove_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) io_fail("cannot remove", path);
}

}  // namespace locus::bench
