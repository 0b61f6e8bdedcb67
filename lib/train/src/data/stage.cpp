// Node-local staging: the staged file's name and manifest, reuse (manifest match and the CRC-32
// of the staged bytes, recomputed by the node's ranks), and a rebuild in which every rank of a
// node copies its share of the node's rows (independent reads of the source, pwrite into the
// copy), published by a rename once complete. See locus/train/data/stage.hpp.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "data/loader_source.hpp"
#include "data/stage_copy.hpp"
#include "locus/comm/agree.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/h5.hpp"

namespace locus::train {

namespace {

constexpr std::int64_t kStageVersion = 1;
constexpr std::uint64_t kCopyBytes = 32ULL << 20;  // rows copied per round by each rank

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ULL;
  for (const unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

std::string real_path(const std::string& path) {
  char* r = ::realpath(path.c_str(), nullptr);
  if (r == nullptr) return path;
  std::string out(r);
  std::free(r);
  return out;
}

std::string host_name() {
  std::array<char, 256> h{};
  if (::gethostname(h.data(), h.size() - 1) != 0) return "?";
  return h.data();
}

}  // namespace

std::string staged_file_path(const LoaderOptions& opts, int node_index) {
  const std::string key = real_path(opts.path) + "\n" + opts.features + "\n" + opts.labels;
  std::string dir = opts.stage_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  return fmt::format("{}/locus-stage-{:016x}-node{}.h5", dir, fnv1a(key), node_index);
}

std::string StageReport::describe() const {
  if (!staged) return "";
  const double mib = static_cast<double>(node_bytes) / (1 << 20);
  const int rebuilt = nodes - reused_nodes;
  std::string what;
  if (reused_nodes > 0) {
    what = fmt::format("{} of {} node{} reused {} staged copy (checksum verified)", reused_nodes,
                       nodes, nodes == 1 ? "" : "s", reused_nodes == 1 ? "its" : "their");
  }
  if (rebuilt > 0) {
    what += fmt::format("{}{} of {} node{} staged it afresh ({:.1f} MiB read from the source)",
                        what.empty() ? "" : ", ", rebuilt, nodes, nodes == 1 ? "" : "s",
                        static_cast<double>(source_bytes_read) / (1 << 20));
  }
  return fmt::format("data staged in {:.2f} s: {}; node 0: {} ({:.1f} MiB{})", seconds, what,
                     path, mib, reason.empty() ? ", reused" : ", rebuilt: " + reason);
}

namespace detail {

std::uint64_t StagedCopy::to_staged(std::uint64_t row, std::uint64_t count) const {
  std::uint64_t offset = 0;
  for (const h5::RowRange& r : ranges) {
    if (row >= r.begin && row + count <= r.end()) return offset + (row - r.begin);
    offset += r.count;
  }
  throw InternalError(fmt::format("rows [{}, {}) are not in the staged copy {}", row,
                                  row + count, path));
}

namespace {

struct Identity {
  std::string source;
  std::int64_t size = 0, mtime_ns = 0, inode = 0;
};

Identity identify(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw DataError(fmt::format("cannot stat the training data '{}': {}", path,
                                std::strerror(errno)));
  }
  return {real_path(path), static_cast<std::int64_t>(st.st_size),
          static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000000000LL + st.st_mtim.tv_nsec,
          static_cast<std::int64_t>(st.st_ino)};
}

// The node's rows: all of them under global shuffle, else its ranks' partitions (merged).
std::vector<h5::RowRange> node_ranges(std::uint64_t n, Shuffle shuffle,
                                      const comm::Topology& topo) {
  if (shuffle == Shuffle::global) return {{0, n}};
  std::vector<h5::RowRange> v;
  const auto& node_of = topo.node_of_rank();
  const int p = static_cast<int>(node_of.size());
  for (int r = 0; r < p; ++r) {
    if (node_of[static_cast<std::size_t>(r)] != topo.node_index()) continue;
    const h5::RowRange part = h5::partition_rows(n, r, p);
    if (part.count == 0) continue;
    if (!v.empty() && v.back().end() == part.begin) {
      v.back().count += part.count;
    } else {
      v.push_back(part);
    }
  }
  return v;
}

std::vector<std::int64_t> flat(const std::vector<h5::RowRange>& ranges) {
  std::vector<std::int64_t> v;
  for (const auto& r : ranges) {
    v.push_back(static_cast<std::int64_t>(r.begin));
    v.push_back(static_cast<std::int64_t>(r.count));
  }
  return v;
}

// What this node's copy must be: compared with a staged file's manifest.
struct Plan {
  Identity id;
  std::uint64_t rows = 0, cols = 0, staged_rows = 0;
  bool labels = false;
  std::string features, labels_name, shuffle;
  std::vector<h5::RowRange> ranges;
  std::uint64_t x_bytes() const { return staged_rows * cols * sizeof(float); }
  std::uint64_t y_bytes() const { return labels ? staged_rows * sizeof(std::int32_t) : 0; }
};

// A staged file's data offsets and recorded checksums (from its manifest).
struct Layout {
  std::int64_t x_offset = -1, y_offset = -1;
  std::int64_t x_crc = 0, y_crc = 0;
};

// Leader only, serial HDF5: "" when `path` holds a copy matching the plan (layout filled in),
// else why not. Never throws: a damaged file is a reason to rebuild.
std::string inspect_existing(const std::string& path, const Plan& plan, Layout& layout) {
  if (::access(path.c_str(), F_OK) != 0) return "no staged copy yet";
  std::lock_guard<std::mutex> lock(hdf5_mutex());
  h5::init();
  const hid_t f = H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT);
  if (f < 0) {
    H5Eclear2(H5E_DEFAULT);
    return "the staged file is not readable HDF5 (damaged)";
  }
  h5::Id file(f);
  try {
    using h5::read_attr;
    if (!h5::has_attr(f, "locus_stage") || read_attr<std::int64_t>(f, "locus_stage") != kStageVersion)
      return "the staged file has another format version";
    if (read_attr<std::string>(f, "source") != plan.id.source ||
        read_attr<std::int64_t>(f, "source_size") != plan.id.size ||
        read_attr<std::int64_t>(f, "source_mtime_ns") != plan.id.mtime_ns ||
        read_attr<std::int64_t>(f, "source_inode") != plan.id.inode)
      return "the source file changed (path, size, mtime or inode)";
    if (read_attr<std::string>(f, "features") != plan.features ||
        read_attr<std::string>(f, "labels") != (plan.labels ? plan.labels_name : "") ||
        read_attr<std::int64_t>(f, "source_rows") != static_cast<std::int64_t>(plan.rows) ||
        read_attr<std::int64_t>(f, "cols") != static_cast<std::int64_t>(plan.cols))
      return "it holds other datasets of the source";
    if (read_attr<std::vector<std::int64_t>>(f, "row_ranges") != flat(plan.ranges))
      return "it holds other rows (shuffle mode or world layout changed)";
    if (!h5::has_attr(f, "features_crc32")) return "its checksum was never recorded (incomplete)";
    layout.x_crc = read_attr<std::int64_t>(f, "features_crc32");
    layout.y_crc = read_attr<std::int64_t>(f, "labels_crc32");
    const auto offset = [&](const char* name) -> std::int64_t {
      h5::Id d(LOCUS_H5_CHECK(H5Dopen2(f, name, H5P_DEFAULT)));
      h5::Id space(LOCUS_H5_CHECK(H5Dget_space(d.get())));
      std::array<hsize_t, 2> dims{0, 0};
      LOCUS_H5_CHECK(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr));
      if (dims[0] != plan.staged_rows) return -2;
      const haddr_t a = H5Dget_offset(d.get());
      return a == HADDR_UNDEF ? -1 : static_cast<std::int64_t>(a);
    };
    layout.x_offset = offset("/features");
    if (plan.labels) layout.y_offset = offset("/labels");
    if (layout.x_offset == -2 || layout.y_offset == -2) return "its datasets have other shapes";
    if (plan.staged_rows > 0 && (layout.x_offset < 0 || (plan.labels && layout.y_offset < 0)))
      return "its datasets are not stored contiguously";
  } catch (const std::exception&) {
    H5Eclear2(H5E_DEFAULT);
    return "its manifest is unreadable (damaged)";
  }
  return "";
}

// pread/pwrite of a whole span; false (errno set) on failure or a short read.
bool pread_all(int fd, void* buf, std::uint64_t n, std::uint64_t off) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t k = ::pread(fd, p, n, static_cast<off_t>(off));
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      if (k == 0) errno = EIO;
      return false;
    }
    p += k, off += static_cast<std::uint64_t>(k), n -= static_cast<std::uint64_t>(k);
  }
  return true;
}
bool pwrite_all(int fd, const void* buf, std::uint64_t n, std::uint64_t off) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t k = ::pwrite(fd, p, n, static_cast<off_t>(off));
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return false;
    p += k, off += static_cast<std::uint64_t>(k), n -= static_cast<std::uint64_t>(k);
  }
  return true;
}

std::uint32_t crc_of(std::uint32_t crc, const void* p, std::uint64_t n) {
  const auto* b = static_cast<const Bytef*>(p);
  while (n > 0) {
    const auto k = static_cast<uInt>(std::min<std::uint64_t>(n, 1u << 30));
    crc = static_cast<std::uint32_t>(crc32(crc, b, k));
    b += k, n -= k;
  }
  return crc;
}

// This rank's part of the copy's checksum: crc and length of its share of /features and
// /labels. Combined over the node's ranks in rank order, the shares being consecutive.
struct ShareCrc {
  std::uint64_t v[4] = {0, 0, 0, 0};  // x crc, x bytes, y crc, y bytes
};

std::array<std::uint32_t, 2> combine(const mpi::Comm& node, const ShareCrc& mine) {
  std::vector<std::uint64_t> all(4 * static_cast<std::size_t>(node.size()));
  LOCUS_MPI_CHECK(MPI_Allgather(mine.v, 4, MPI_UINT64_T, all.data(), 4, MPI_UINT64_T,
                                node.get()));
  std::array<std::uint32_t, 2> crc{static_cast<std::uint32_t>(crc32(0, nullptr, 0)),
                                   static_cast<std::uint32_t>(crc32(0, nullptr, 0))};
  for (int r = 0; r < node.size(); ++r) {
    const std::uint64_t* s = all.data() + 4 * static_cast<std::size_t>(r);
    for (int k = 0; k < 2; ++k) {
      crc[k] = static_cast<std::uint32_t>(
          crc32_combine(crc[k], static_cast<uLong>(s[2 * k]), static_cast<z_off_t>(s[2 * k + 1])));
    }
  }
  return crc;
}

// Reads back this rank's share of an existing copy and checksums it; false on a read error.
bool checksum_share(const std::string& path, const Plan& plan, const Layout& layout,
                    h5::RowRange share, ShareCrc& out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  std::vector<char> buf;
  bool ok = true;
  std::uint32_t cx = static_cast<std::uint32_t>(crc32(0, nullptr, 0)), cy = cx;
  const auto sum = [&](std::int64_t base, std::uint64_t row_bytes, std::uint32_t& crc) {
    std::uint64_t off = static_cast<std::uint64_t>(base) + share.begin * row_bytes;
    std::uint64_t left = share.count * row_bytes;
    while (ok && left > 0) {
      const std::uint64_t n = std::min(left, kCopyBytes);
      buf.resize(n);
      ok = pread_all(fd, buf.data(), n, off);
      if (ok) crc = crc_of(crc, buf.data(), n);
      off += n, left -= n;
    }
  };
  if (share.count > 0) {
    sum(layout.x_offset, plan.cols * sizeof(float), cx);
    if (plan.labels) sum(layout.y_offset, sizeof(std::int32_t), cy);
  }
  ::close(fd);
  out.v[0] = cx, out.v[1] = share.count * plan.cols * sizeof(float);
  out.v[2] = cy, out.v[3] = plan.labels ? share.count * sizeof(std::int32_t) : 0;
  return ok;
}

// Leader only: removes `final` and temporary files of earlier builds of it.
void remove_stale(const std::string& dir, const std::string& final_path) {
  ::unlink(final_path.c_str());
  const std::string base = final_path.substr(final_path.rfind('/') + 1) + ".tmp.";
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return;
  while (const dirent* e = ::readdir(d)) {
    if (std::strncmp(e->d_name, base.c_str(), base.size()) == 0) {
      ::unlink((dir + "/" + e->d_name).c_str());
    }
  }
  ::closedir(d);
}

void check_stage_dir(const std::string& dir, int node) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw ConfigError(fmt::format(
        "data.stage_dir '{}' is not a directory on node {} ({}): create it on every node "
        "(a node-local SSD or /dev/shm), or unset data.stage_dir to read the training data "
        "from its source", dir, node, host_name()));
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    throw IoError(fmt::format("data.stage_dir '{}' is not writable on node {} ({}): {}; make it "
                              "writable or point data.stage_dir at a writable node-local "
                              "directory", dir, node, host_name(), std::strerror(errno)));
  }
}

// Leader only: checks the free space and creates the temporary file with its manifest (the
// checksums come last); returns the data offsets.
Layout create_copy(const std::string& dir, const std::string& tmp, const Plan& plan,
                   const comm::Topology& topo) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) {
    throw IoError(fmt::format("cannot statvfs data.stage_dir '{}' on node {}: {}", dir,
                              topo.node_index(), std::strerror(errno)));
  }
  const std::uint64_t need = plan.x_bytes() + plan.y_bytes() + (1ULL << 20);
  std::uint64_t avail = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  // Test only: a stage_dir this small, without having to fill a file system.
  if (const char* t = std::getenv("LOCUS_TEST_STAGE_FREE_BYTES")) avail = std::strtoull(t, nullptr, 10);
  if (avail < need) {
    throw IoError(fmt::format(
        "data.stage_dir '{}' on node {} ({}) has {:.1f} MiB free but this node stages {:.1f} "
        "MiB ({} rows of '{}'): free space there, point data.stage_dir at a larger node-local "
        "file system, or unset it to read from the source", dir, topo.node_index(), host_name(),
        static_cast<double>(avail) / (1 << 20), static_cast<double>(need) / (1 << 20),
        plan.staged_rows, plan.id.source));
  }
  std::lock_guard<std::mutex> lock(hdf5_mutex());
  h5::init();
  h5::Id file(LOCUS_H5_WRITE_CHECK(tmp, H5Fcreate(tmp.c_str(), H5F_ACC_EXCL, H5P_DEFAULT,
                                                  H5P_DEFAULT)));
  const hid_t f = file.get();
  Layout layout;
  const auto make = [&](const char* name, hid_t type, int rank, std::uint64_t width) {
    const std::array<hsize_t, 2> dims{plan.staged_rows, width};
    h5::Id space(LOCUS_H5_CHECK(H5Screate_simple(rank, dims.data(), nullptr)));
    h5::Id dcpl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
    // Space now, no fill: the ranks write every byte with pwrite at the dataset's offset.
    LOCUS_H5_CHECK(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS));
    LOCUS_H5_CHECK(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY));
    LOCUS_H5_CHECK(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER));
    h5::Id d(LOCUS_H5_WRITE_CHECK(tmp, H5Dcreate2(f, name, type, space.get(), H5P_DEFAULT,
                                                  dcpl.get(), H5P_DEFAULT)));
    const haddr_t a = H5Dget_offset(d.get());
    return a == HADDR_UNDEF ? std::int64_t{-1} : static_cast<std::int64_t>(a);
  };
  layout.x_offset = make("/features", H5T_NATIVE_FLOAT, 2, plan.cols);
  if (plan.labels) layout.y_offset = make("/labels", H5T_NATIVE_INT32, 1, 0);
  h5::write_attr(f, "locus_stage", kStageVersion);
  h5::write_attr(f, "source", plan.id.source);
  h5::write_attr(f, "source_size", plan.id.size);
  h5::write_attr(f, "source_mtime_ns", plan.id.mtime_ns);
  h5::write_attr(f, "source_inode", plan.id.inode);
  h5::write_attr(f, "source_rows", static_cast<std::int64_t>(plan.rows));
  h5::write_attr(f, "cols", static_cast<std::int64_t>(plan.cols));
  h5::write_attr(f, "features", plan.features);
  h5::write_attr(f, "labels", plan.labels ? plan.labels_name : std::string());
  h5::write_attr(f, "shuffle", plan.shuffle);
  h5::write_attr(f, "row_ranges", std::span<const std::int64_t>(flat(plan.ranges)));
  std::vector<std::int64_t> ranks;
  for (std::size_t r = 0; r < topo.node_of_rank().size(); ++r) {
    if (topo.node_of_rank()[r] == topo.node_index()) ranks.push_back(static_cast<std::int64_t>(r));
  }
  h5::write_attr(f, "world_size", static_cast<std::int64_t>(topo.node_of_rank().size()));
  h5::write_attr(f, "nodes", static_cast<std::int64_t>(topo.nodes()));
  h5::write_attr(f, "node_index", static_cast<std::int64_t>(topo.node_index()));
  h5::write_attr(f, "node_ranks", std::span<const std::int64_t>(ranks));
  LOCUS_H5_WRITE_CHECK(tmp, H5Fclose(file.release()));
  return layout;
}

// This rank's share of the rebuild: reads its staged rows from the source (independent reads)
// and writes them into the temporary file at the datasets' offsets.
ShareCrc copy_share(Source& src, const StagedCopy& copy, const Plan& plan, const Layout& layout,
                    const std::string& tmp, h5::RowRange share) {
  ShareCrc out;
  std::uint32_t cx = static_cast<std::uint32_t>(crc32(0, nullptr, 0)), cy = cx;
  if (share.count > 0) {
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC);
    const auto fail = [&](const char* what) {
      const int err = errno;
      if (fd >= 0) ::close(fd);
      throw IoError(fmt::format("{} the staged copy {} failed: {}; free space in data.stage_dir "
                                "or point it elsewhere", what, tmp, std::strerror(err)));
    };
    if (fd < 0) fail("opening");
    const std::uint64_t row_bytes = plan.cols * sizeof(float);
    const std::uint64_t chunk = std::max<std::uint64_t>(1, kCopyBytes / row_bytes);
    std::vector<float> x;
    std::vector<std::int32_t> y;
    for (std::uint64_t s = share.begin; s < share.end(); s += chunk) {
      const std::uint64_t n = std::min(chunk, share.end() - s);
      // Staged rows [s, s + n) as source runs (the held ranges in order).
      std::vector<h5::RowRange> runs;
      std::uint64_t base = 0;
      for (const h5::RowRange& r : copy.ranges) {
        const std::uint64_t lo = std::max(s, base), hi = std::min(s + n, base + r.count);
        if (lo < hi) runs.push_back({r.begin + (lo - base), hi - lo});
        base += r.count;
      }
      x.resize(n * plan.cols);
      y.resize(plan.labels ? n : 0);
      src.read_runs(runs, x.data(), y.data());
      if (!pwrite_all(fd, x.data(), n * row_bytes,
                      static_cast<std::uint64_t>(layout.x_offset) + s * row_bytes))
        fail("writing");
      cx = crc_of(cx, x.data(), n * row_bytes);
      if (plan.labels) {
        if (!pwrite_all(fd, y.data(), n * sizeof(std::int32_t),
                        static_cast<std::uint64_t>(layout.y_offset) + s * sizeof(std::int32_t)))
          fail("writing");
        cy = crc_of(cy, y.data(), n * sizeof(std::int32_t));
      }
    }
    if (::fdatasync(fd) != 0) fail("syncing");
    ::close(fd);
  }
  out.v[0] = cx, out.v[1] = share.count * plan.cols * sizeof(float);
  out.v[2] = cy, out.v[3] = plan.labels ? share.count * sizeof(std::int32_t) : 0;
  return out;
}

// Leader only: records the checksums, syncs, and renames the temporary file into place.
void publish(const std::string& tmp, const std::string& final_path, const std::string& dir,
             const std::array<std::uint32_t, 2>& crc) {
  {
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    h5::Id file(LOCUS_H5_WRITE_CHECK(tmp, H5Fopen(tmp.c_str(), H5F_ACC_RDWR, H5P_DEFAULT)));
    h5::write_attr(file.get(), "features_crc32", static_cast<std::int64_t>(crc[0]));
    h5::write_attr(file.get(), "labels_crc32", static_cast<std::int64_t>(crc[1]));
    LOCUS_H5_WRITE_CHECK(tmp, H5Fclose(file.release()));
  }
  const auto sync = [](const std::string& p) {
    const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    const bool ok = ::fsync(fd) == 0 || errno == EINVAL;  // directories: best effort
    ::close(fd);
    return ok;
  };
  if (!sync(tmp) || ::rename(tmp.c_str(), final_path.c_str()) != 0) {
    throw IoError(fmt::format("publishing the staged copy {} as {} failed: {}; check "
                              "data.stage_dir", tmp, final_path, std::strerror(errno)));
  }
  static_cast<void>(sync(dir));
}

}  // namespace

std::unique_ptr<StagedCopy> stage_dataset(const mpi::Comm& comm, const LoaderOptions& opts) {
  const auto t0 = std::chrono::steady_clock::now();
  auto copy = std::make_unique<StagedCopy>(comm);
  const comm::Topology& topo = copy->topo;
  const mpi::Comm& node = topo.node();
  std::string dir = opts.stage_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  copy->path = staged_file_path(opts, topo.node_index());

  mpi::agree_on(comm, [&] { check_stage_dir(dir, topo.node_index()); });
  LoaderOptions source_opts = opts;
  source_opts.stage_dir.clear();
  Source src(comm, source_opts);  // validates the source; agreed
  Plan plan;
  std::string tmp;
  try {
    mpi::agree_on(comm, [&] { plan.id = identify(opts.path); });
    plan.rows = src.rows();
    plan.cols = src.cols();
    plan.labels = src.has_labels();
    plan.features = opts.features;
    plan.labels_name = opts.labels;
    plan.shuffle = to_string(opts.shuffle);
    plan.ranges = node_ranges(plan.rows, opts.shuffle, topo);
    for (const auto& r : plan.ranges) plan.staged_rows += r.count;
    copy->ranges = plan.ranges;
    copy->source_rows = plan.rows;
    copy->staged_rows = plan.staged_rows;
    copy->has_labels = plan.labels;
    const h5::RowRange share = h5::partition_rows(plan.staged_rows, node.rank(), node.size());

    // 1. Reuse: the leader reads the manifest, the node's ranks checksum their shares.
    Layout layout;
    std::string reason;
    if (topo.is_leader()) reason = inspect_existing(copy->path, plan, layout);
    reason = node.bcast(reason);
    std::array<std::int64_t, 4> lv{layout.x_offset, layout.y_offset, layout.x_crc, layout.y_crc};
    node.bcast(std::span<std::int64_t>(lv));
    layout = {lv[0], lv[1], lv[2], lv[3]};
    if (reason.empty()) {
      ShareCrc mine;
      const int ok = checksum_share(copy->path, plan, layout, share, mine) ? 1 : 0;
      const std::array<std::uint32_t, 2> crc = combine(node, mine);
      if (node.allreduce(ok, MPI_MIN) == 0) {
        reason = "the staged file cannot be read back";
      } else if (crc[0] != static_cast<std::uint32_t>(layout.x_crc) ||
                 crc[1] != static_cast<std::uint32_t>(layout.y_crc)) {
        reason = fmt::format("checksum mismatch (crc32 {:08x}/{:08x}, manifest {:08x}/{:08x}): "
                             "the staged copy is damaged", crc[0], crc[1], layout.x_crc,
                             layout.y_crc);
      }
    }
    const bool rebuild = !reason.empty();

    // 2. Rebuild: the leader makes the temporary file, every rank copies its share, the
    //    leader publishes it. Each step agreed over comm (nodes that reuse only take part).
    if (rebuild && topo.is_leader()) tmp = fmt::format("{}.tmp.{}", copy->path, ::getpid());
    mpi::agree_on(comm, [&] {
      if (!rebuild || !topo.is_leader()) return;
      remove_stale(dir, copy->path);
      layout = create_copy(dir, tmp, plan, topo);
    });
    if (rebuild) {
      tmp = node.bcast(tmp);
      std::array<std::int64_t, 2> off{layout.x_offset, layout.y_offset};
      node.bcast(std::span<std::int64_t>(off));
      layout.x_offset = off[0], layout.y_offset = off[1];
    }
    ShareCrc mine;
    mpi::agree_on(comm, [&] {
      if (rebuild) mine = copy_share(src, *copy, plan, layout, tmp, share);
    });
    std::array<std::uint32_t, 2> crc{};
    if (rebuild) crc = combine(node, mine);
    mpi::agree_on(comm, [&] {
      if (rebuild && topo.is_leader()) publish(tmp, copy->path, dir, crc);
    });
    tmp.clear();

    // 3. The report: node 0's view (world rank 0 leads node 0) and sums over the nodes.
    StageReport& rep = copy->report;
    rep.staged = true;
    rep.path = copy->path;
    rep.nodes = topo.nodes();
    std::array<std::uint64_t, 2> sums{topo.is_leader() && !rebuild ? 1u : 0u,
                                      rebuild ? share.count * (plan.cols * 4 + (plan.labels ? 4 : 0))
                                              : 0};
    comm.allreduce_inplace(std::span<std::uint64_t>(sums), MPI_SUM);
    rep.reused_nodes = static_cast<int>(sums[0]);
    rep.source_bytes_read = sums[1];
    rep.reason = comm.bcast(reason);
    std::array<std::uint64_t, 1> bytes{plan.x_bytes() + plan.y_bytes()};
    comm.bcast(std::span<std::uint64_t>(bytes));
    rep.node_bytes = bytes[0];
    rep.path = comm.bcast(copy->path);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rep.seconds = comm.allreduce(s, MPI_MAX);
  } catch (const Error& e) {
    if (!e.agreed()) {
      src.abandon();
      throw;
    }
    if (!tmp.empty()) ::unlink(tmp.c_str());  // leader of a node that was rebuilding
    try {
      src.close();
    } catch (const Error&) {
      src.abandon();
    }
    throw;
  }
  src.close();
  return copy;
}

}  // namespace detail

bool remove_staged_copy(const mpi::Comm& comm, const LoaderOptions& opts) {
  if (opts.stage_dir.empty() || opts.stage_keep) return false;
  const comm::Topology topo(comm);
  comm.barrier();  // every rank is done with its node's copy
  int removed = 0;
  if (topo.is_leader()) removed = ::unlink(staged_file_path(opts, topo.node_index()).c_str()) == 0;
  return comm.allreduce(removed, MPI_MAX) != 0;
}

}  // namespace locus::train
