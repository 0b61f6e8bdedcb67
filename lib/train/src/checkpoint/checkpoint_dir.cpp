// The checkpoint directory: its ownership lock, file names, listing, the `latest` pointer
// (atomic replace), the commit of one checkpoint (temporary name, fsync, rename, directory
// fsync, pointer) and retention.
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>
#include <thread>

#include "checkpoint/checkpoint_detail.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/h5.hpp"
#include "locus/io/publish.hpp"
#include "locus/train/data/loader.hpp"

namespace locus::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kLatest = "latest";

std::string join_path(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / name).string();
}

// Local: the run_id attribute of a checkpoint, read with HDF5's serial driver ("" when the
// file cannot be read: a damaged or foreign file).
std::string run_of(const std::string& path) {
  std::lock_guard lock(hdf5_mutex());
  h5::init();
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) {
    H5Eclear2(H5E_DEFAULT);
    return "";
  }
  h5::Id file(f);
  try {
    return h5::read_attr<std::string>(file.get(), "run_id");
  } catch (const Error&) {
    H5Eclear2(H5E_DEFAULT);
    return "";
  }
}

// Local (rank 0): deletes what retention gives up; returns the deleted names. Failures to
// delete are ignored: retention is housekeeping, never a reason to fail a save.
std::vector<std::string> prune(const std::string& dir, const std::string& newest,
                               const CheckpointMeta& meta, const RetentionOptions& r) {
  std::vector<std::string> removed;
  std::int64_t kept = 1;  // the new checkpoint
  for (const CheckpointEntry& e : list_checkpoints(dir)) {
    if (e.name == newest) continue;
    bool drop = std::ranges::find(r.retire, e.name) != r.retire.end();
    if (drop) {
    } else if (run_of(e.path) != meta.run_id) {
      drop = true;  // another run's (or unreadable)
    } else if (e.step > meta.step) {
      drop = true;  // a branch abandoned by resuming from an older checkpoint
    } else {
      ++kept;
      drop = r.keep_last > 0 && kept > r.keep_last;
    }
    if (drop && ::unlink(e.path.c_str()) == 0) removed.push_back(e.name);
  }
  static const std::regex temp(R"(^\.ckpt-\d+\.h5\.locus-tmp$)");
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(dir, ec)) {
    const std::string name = d.path().filename().string();
    if (std::regex_match(name, temp) && ::unlink(d.path().c_str()) == 0) removed.push_back(name);
  }
  return removed;
}

// ---- The lock (<dir>/.lock) ----

constexpr const char* kLockName = ".lock";

[[noreturn]] void refuse(const std::string& dir, const io::LockBusy& busy) {
  throw ConfigError(fmt::format(
      "checkpoint.dir '{}' is in use by another training job ({}){}: two jobs in one checkpoint "
      "directory would delete each other's checkpoints. Set checkpoint.dir to another "
      "directory, or wait until {} ends and rerun (its lock on {} goes with its process, even "
      "if it is killed; --resume=auto then continues from its checkpoints)",
      dir, busy.holder().empty() ? "holder not recorded" : busy.holder(),
      busy.waited_s() > 0 ? fmt::format(", an earlier instance of this Slurm job that did not "
                                        "end within {:g} s", busy.waited_s())
                          : "",
      busy.holder_name(), (fs::path(dir) / kLockName).string()));
}

}  // namespace

std::string checkpoint_file_name(std::int64_t step) { return fmt::format("ckpt-{:08d}.h5", step); }

std::vector<CheckpointEntry> list_checkpoints(const std::string& dir) {
  static const std::regex pattern(R"(^ckpt-(\d+)\.h5$)");
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  for (const auto& d : fs::directory_iterator(dir, ec)) {
    const std::string name = d.path().filename().string();
    std::smatch m;
    if (!std::regex_match(name, m, pattern) || !d.is_regular_file(ec)) continue;
    out.push_back({name, d.path().string(), std::stoll(m[1].str())});
  }
  std::ranges::sort(out, [](const auto& a, const auto& b) {
    return a.step != b.step ? a.step > b.step : a.name > b.name;
  });
  return out;
}

LatestPointer read_latest(const std::string& dir) {
  LatestPointer p;
  std::ifstream in(join_path(dir, kLatest));
  std::string key, value, line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    key.clear();
    value.clear();
    words >> key >> value;
    if (key == "run") {
      p.run_id = value;
      p.present = !value.empty();
    } else if (key == "latest") {
      p.file = value == "-" ? "" : value;
    }
  }
  return p;
}

void write_latest(const std::string& dir, const LatestPointer& p) {
  const std::string final_path = join_path(dir, kLatest);
  const std::string temp = io::temp_path_for(final_path);
  {
    std::FILE* f = std::fopen(temp.c_str(), "w");
    if (f == nullptr) {
      throw IoError(fmt::format("cannot write the checkpoint pointer '{}': {}", temp,
                                std::strerror(errno)));
    }
    const std::string text = fmt::format(
        "# locus checkpoint pointer: the run and its newest committed checkpoint\nrun {}\n"
        "latest {}\n", p.run_id, p.file.empty() ? "-" : p.file);
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size() &&
                    std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
    const int err = errno;
    std::fclose(f);
    if (!ok) {
      ::unlink(temp.c_str());
      throw IoError(fmt::format("cannot write the checkpoint pointer '{}': {}", temp,
                                std::strerror(err)));
    }
  }
  if (std::rename(temp.c_str(), final_path.c_str()) != 0) {
    throw IoError(fmt::format("cannot rename '{}' to '{}': {}", temp, final_path,
                              std::strerror(errno)));
  }
  io::fsync_path(dir, true);
}

SaveResult save_checkpoint(const mpi::Comm& comm, const std::string& dir,
                           const CheckpointData& data, const WriteOptions& write,
                           const RetentionOptions& retention) {
  const auto t0 = std::chrono::steady_clock::now();
  SaveResult r;
  r.step = data.meta.step;
  const std::string name = checkpoint_file_name(data.meta.step);
  r.path = join_path(dir, name);
  mpi::agree_on(comm, [&] {
    std::error_code ec;
    if (comm.is_root()) fs::create_directories(dir, ec);
    if (ec) {
      throw IoError(fmt::format("cannot create checkpoint.dir '{}': {}; choose another "
                                "directory or fix the permissions", dir, ec.message()));
    }
  });
  io::Publication pub(comm, r.path, io::Publication::DirectoryLocked{});  // under the .lock
  if (write_checkpoint_file(comm, pub.temp_path(), data, write) == WriteOutcome::abandoned) {
    pub.abandon();
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return r;
  }
  comm::progress("checkpoint commit of {}", r.path);
  test_hook("ckpt-before-rename");
  pub.commit();
  test_hook("ckpt-before-latest");
  mpi::agree_on(comm, [&] {
    if (comm.is_root()) write_latest(dir, {true, data.meta.run_id, name});
  });
  r.committed = true;
  if (comm.is_root()) {
    std::error_code ec;
    r.bytes = static_cast<std::uint64_t>(fs::file_size(r.path, ec));
    r.removed = prune(dir, name, data.meta, retention);
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

CheckpointDirLock CheckpointDirLock::acquire(const mpi::Comm& comm, const std::string& dir,
                                             const std::string& run_id, const LockWait& wait,
                                             const std::function<void(const std::string&)>& say) {
  CheckpointDirLock lock;
  // Named for the watchdog, which keeps counting while rank 0 waits for a predecessor and the
  // other ranks wait for rank 0: a wait longer than this job's own train.watchdog_s ends it
  // (exit 70) with this line. With the predecessor's watchdog this job's outlives it: it was
  // armed later.
  comm::progress("taking the lock of checkpoint.dir {}", dir);
  mpi::agree_on(comm, [&] {
    if (!comm.is_root()) return;
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) {
      throw IoError(fmt::format("cannot create checkpoint.dir '{}': {}; choose another "
                                "directory or fix the permissions", dir, ec.message()));
    }
    const io::LockRecord record{"locus checkpoint directory lock: a training job's rank 0",
                                run_id, wait.watchdog_s, "train.watchdog_s"};
    try {
      lock.lock_ = io::FileLock::take(join_path(dir, kLockName),
                                      fmt::format("checkpoint.dir '{}'", dir), record,
                                      {wait.same_job_s}, say);
    } catch (const io::LockBusy& busy) {
      refuse(dir, busy);
    }
  });
  return lock;
}

std::string read_lock_holder(const std::string& dir) {
  return io::describe_lock_holder(join_path(dir, kLockName));
}

}  // namespace locus::train
