// Atomic publish (temp name + rename after agreement) and parallel file copy.
#include "locus/io/publish.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <span>

#include <fmt/format.h>

#include "locus/comm/agree.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"

namespace locus::io {

namespace {

std::string dir_of(const std::string& path) {
  auto d = std::filesystem::path(path).parent_path();
  return d.empty() ? std::string(".") : d.string();
}

[[noreturn]] void io_fail(const std::string& what, const std::string& path) {
  throw IoError(fmt::format("{} '{}': {}", what, path, std::strerror(errno)));
}

// "<dir>/.<name><suffix>": a hidden file beside `final_path`. Built with append rather than
// `"." + name` (GCC 12 -O3 reports a false -Wrestrict there).
std::string hidden_beside(const std::string& final_path, const char* suffix) {
  std::filesystem::path p(final_path);
  std::string name(".");
  name.append(p.filename().string()).append(suffix);
  return (p.parent_path() / name).string();
}

}  // namespace

std::string temp_path_for(const std::string& final_path) {
  return hidden_beside(final_path, ".locus-tmp");
}

std::string lock_path_for(const std::string& final_path) {
  return hidden_beside(final_path, ".locus-lock");
}

bool output_exists(const mpi::Comm& comm, const std::string& path) {
  struct stat st {};
  std::int64_t present = comm.is_root() && !path.empty() && ::stat(path.c_str(), &st) == 0;
  comm.bcast(std::span<std::int64_t>(&present, 1));
  return present != 0;
}

OutputLock OutputLock::acquire(const mpi::Comm& comm, const std::string& path,
                               std::string_view key, const FileLock::Say& say, Writer writer) {
  OutputLock lock;
  lock.path_ = path;
  const FileLock::Say tell = say ? say : [](const std::string& line) {
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  };
  // Named for the watchdog, which counts a long wait for a predecessor (see FileLock::take).
  comm::progress("taking the lock of output {}", path);
  const std::string what = key.empty() ? fmt::format("output '{}'", path)
                                       : fmt::format("output '{}' ({})", path, key);
  mpi::agree_on(comm, [&] {
    if (writer == Writer::every_rank || comm.is_root()) h5::check_writable_dir(dir_of(path), path);
    if (!comm.is_root()) return;
    const comm::WatchdogSetting watchdog = comm::armed_watchdog();
    const LockRecord record{fmt::format("locus output lock: the job writing '{}'", path), "",
                            watchdog.timeout_s, watchdog.key};
    const std::string lock_file = lock_path_for(path);
    try {
      lock.lock_ = FileLock::take(lock_file, what, record, {requeue_wait_s()}, tell);
    } catch (const LockBusy& busy) {
      throw ConfigError(fmt::format(
          "{} is being written by another job ({}){}: two jobs writing one output would "
          "publish one's partial file as the other's result. Wait until {} ends and rerun, or "
          "write to another path (its lock on '{}' goes with its process, even if it is "
          "killed)", what, busy.holder().empty() ? "holder not recorded" : busy.holder(),
          busy.waited_s() > 0 ? fmt::format(", an earlier instance of this Slurm job that did "
                                            "not end within {:g} s", busy.waited_s())
                              : "",
          busy.holder_name(), lock_file));
    }
    if (!lock.lock_.warning().empty()) tell(lock.lock_.warning());
  });
  return lock;
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) io_fail("cannot open for fsync", path);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  errno = err;
  if (rc != 0) io_fail("fsync failed for", path);
}

Publication::Publication(const mpi::Comm& comm, std::string final_path)
    : own_lock_(OutputLock::acquire(comm, final_path)), comm_(comm.view()),
      final_(std::move(final_path)), temp_(temp_path_for(final_)) {
  remove_leftover();
}

Publication::Publication(const mpi::Comm& comm, std::string final_path, const OutputLock& held)
    : comm_(comm.view()), final_(std::move(final_path)), temp_(temp_path_for(final_)) {
  if (held.path() != final_) {
    throw InternalError(fmt::format("a publication of '{}' under the lock of '{}'", final_,
                                    held.path()));
  }
  remove_leftover();
}

Publication::Publication(const mpi::Comm& comm, std::string final_path, DirectoryLocked)
    : comm_(comm.view()), final_(std::move(final_path)), temp_(temp_path_for(final_)) {
  remove_leftover();
}

void Publication::remove_leftover() {
  mpi::agree_on(comm_, [&] {
    h5::check_writable_dir(dir_of(final_), final_);
    if (comm_.is_root() && ::unlink(temp_.c_str()) != 0 && errno != ENOENT)
      io_fail("cannot remove the leftover temporary file", temp_);
  });
}

Publication::~Publication() {
  if (!done_ && comm_.is_root()) ::unlink(temp_.c_str());
}

void Publication::abandon() {
  comm_.barrier();
  if (comm_.is_root()) ::unlink(temp_.c_str());
  done_ = true;
}

void Publication::commit() {
  mpi::agree_on(comm_, [] {});  // every rank arrived with its file closed
  mpi::agree_on(comm_, [&] {
    if (!comm_.is_root()) return;
    fsync_path(temp_, false);
    if (std::rename(temp_.c_str(), final_.c_str()) != 0)
      io_fail(fmt::format("cannot rename '{}' to", temp_), final_);
    fsync_path(dir_of(final_), true);
  });
  done_ = true;
}

void copy_file_parallel(const mpi::Comm& comm, const std::string& src, const std::string& dst) {
  std::uint64_t size = 0;
  mpi::agree_on(comm, [&] {
    struct stat st {};
    if (::stat(src.c_str(), &st) != 0) io_fail("cannot stat", src);
    size = static_cast<std::uint64_t>(st.st_size);
    if (comm.is_root()) {
      const int fd = ::open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd < 0) io_fail("cannot create", dst);
      const int rc = ::ftruncate(fd, static_cast<off_t>(size));
      ::close(fd);
      if (rc != 0) io_fail("cannot size", dst);
    }
  });
  mpi::agree_on(comm, [&] {
    const h5::RowRange mine = h5::partition_rows(size, comm.rank(), comm.size(), 1u << 20);
    const int in = ::open(src.c_str(), O_RDONLY);
    if (in < 0) io_fail("cannot open", src);
    const int out = ::open(dst.c_str(), O_WRONLY);
    if (out < 0) {
      ::close(in);
      io_fail("cannot open", dst);
    }
    auto off_in = static_cast<loff_t>(mine.begin);
    auto off_out = static_cast<loff_t>(mine.begin);
    std::uint64_t left = mine.count;
    bool ok = true;
    while (left > 0 && ok) {
      const ssize_t n = ::copy_file_range(in, &off_in, out, &off_out, left, 0);
      if (n <= 0) ok = false;
      else left -= static_cast<std::uint64_t>(n);
    }
    const int err = errno;
    if (ok && ::fsync(out) != 0) ok = false;
    ::close(in);
    ::close(out);
    errno = err;
    if (!ok) io_fail(fmt::format("cannot copy '{}' to", src), dst);
  });
}

}  // namespace locus::io
