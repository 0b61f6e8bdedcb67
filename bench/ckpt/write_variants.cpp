// Prototype of checkpoint byte movers, measured side by side with `dd conv=fsync` of the same
// bytes (bench/RESULTS.md, "Checkpoints"): a checkpoint-shaped HDF5 file (contiguous float32
// datasets allocated at creation, every rank its balanced share of each tensor's rows, CRC-32
// per share, crc32 attributes, close, fsync by rank 0) written by each variant in turn:
//   h5-indep      H5Dwrite, independent, 8 MiB pieces (the checkpoint writer before this study)
//   h5-indep-1    H5Dwrite, independent, one call per share
//   h5-coll       H5Dwrite, collective (two-phase), one call per share
//   mpiio         MPI_File_write_at on HDF5's own MPI_File (H5Fget_vfd_handle), 8 MiB pieces
//   pwrite        pwrite(2) at H5Dget_offset on a POSIX fd of this rank, 8 MiB pieces
//   pwrite-sfr    pwrite + sync_file_range(WRITE) after every piece: the disk writes while
//                 the next piece is copied, so the final fsync has little left to do
//   pwrite-sfr-ds pwrite-sfr + an fdatasync on every rank before its fd closes
//   pwrite-nocrc  pwrite-sfr without the CRC pass (what the CRC costs)
//   raw           io::RawFile (lib/io): pwrite in 1 MiB pieces, write-back started every
//                 16 MiB, CRC-32 by carry-less multiplication; one RawFile per tensor
//   ddrank        not a checkpoint: dd's loop (read 1 MiB of dd's source, write it; fsync)
//                 run by rank 0 itself, i.e. dd's copy made by a rank's process
// "-pre" after a variant's name first does the checkpoint writer's preflight (rank 0 creates
// the file with ftruncate to its full size, before HDF5 truncates and creates it); ":P" after
// a name sets the piece size in MiB (8 by default), ":P:W" also the write-back batch of the
// pwrite-sfr variants (W MiB; one piece by default). HOG_MIB=N: every rank holds N MiB more
// (a training rank's footprint). Every timed write starts after its previous file is deleted,
// `sync` and 1 s of idle disk; rounds rotate the order of the variants and dd; rank 0 prints
// one JSON line per timing.
//   mpirun -n P locus_ckpt_write_variants DIR MiB [tensors] [rounds] [variants,...]
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "../common/bench_cli.hpp"
#include "../io/raw_baseline.hpp"
#include "locus/comm/app.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/h5.hpp"
#include "locus/io/raw_io.hpp"

namespace {

using namespace locus;
using Clock = std::chrono::steady_clock;
std::uint64_t kPiece = 8u << 20;   // per variant: "name:MiB" sets it
std::uint64_t kSfrEvery = 0;        // "name:MiB:MiB": sync_file_range every this many bytes

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Tensor {
  std::uint64_t rows = 0, cols = 0;
  h5::RowRange mine;
  std::vector<float> share;  // this rank's rows
};

// The fapl of h5::File::create (lib/io/src/file.cpp).
h5::Id fapl_of(const mpi::Comm& comm) {
  h5::Id fapl(LOCUS_H5_CHECK(H5Pcreate(H5P_FILE_ACCESS)));
  LOCUS_H5_CHECK(H5Pset_fapl_mpio(fapl.get(), comm.get(), MPI_INFO_NULL));
  LOCUS_H5_CHECK(H5Pset_all_coll_metadata_ops(fapl.get(), true));
  LOCUS_H5_CHECK(H5Pset_coll_metadata_write(fapl.get(), true));
  LOCUS_H5_CHECK(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_V110));
  LOCUS_H5_CHECK(H5Pset_meta_block_size(fapl.get(), hsize_t{1} << 20));
  return fapl;
}

h5::Id create_tensor(hid_t file, const std::string& name, const Tensor& t) {
  const hsize_t dims[2] = {t.rows, t.cols};
  h5::Id space(LOCUS_H5_CHECK(H5Screate_simple(2, dims, nullptr)));
  h5::Id dcpl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
  LOCUS_H5_CHECK(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS));
  LOCUS_H5_CHECK(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY));
  LOCUS_H5_CHECK(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER));
  return h5::Id(LOCUS_H5_CHECK(H5Dcreate2(file, name.c_str(), H5T_IEEE_F32LE, space.get(),
                                          H5P_DEFAULT, dcpl.get(), H5P_DEFAULT)));
}

std::uint32_t crc_of(const void* p, std::uint64_t n, std::uint32_t crc) {
  return static_cast<std::uint32_t>(::crc32_z(crc, static_cast<const Bytef*>(p), n));
}

// H5Dwrite of this rank's rows, in pieces of `piece` bytes (0: one call), independent or
// collective; returns the CRC.
std::uint32_t h5_write(hid_t ds, const Tensor& t, std::uint64_t piece, bool collective) {
  h5::Id fs(LOCUS_H5_CHECK(H5Dget_space(ds)));
  h5::Id xfer(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_XFER)));
  if (collective) LOCUS_H5_CHECK(H5Pset_dxpl_mpio(xfer.get(), H5FD_MPIO_COLLECTIVE));
  const std::uint64_t row_bytes = t.cols * sizeof(float);
  const std::uint64_t rows = t.mine.count;
  const std::uint64_t step = piece == 0 ? std::max<std::uint64_t>(rows, 1)
                                        : std::max<std::uint64_t>(1, piece / row_bytes);
  std::uint32_t crc = crc_of(nullptr, 0, 0);
  for (std::uint64_t r0 = 0; r0 < std::max<std::uint64_t>(rows, 1); r0 += step) {
    const std::uint64_t n = rows == 0 ? 0 : std::min(step, rows - r0);
    const hsize_t start[2] = {t.mine.begin + r0, 0}, count[2] = {n, t.cols};
    if (n == 0) {
      LOCUS_H5_CHECK(H5Sselect_none(fs.get()));
    } else {
      LOCUS_H5_CHECK(H5Sselect_hyperslab(fs.get(), H5S_SELECT_SET, start, nullptr, count, nullptr));
    }
    h5::Id ms(LOCUS_H5_CHECK(H5Screate_simple(2, count, nullptr)));
    if (n == 0) LOCUS_H5_CHECK(H5Sselect_none(ms.get()));
    const float* at = t.share.data() + r0 * t.cols;
    LOCUS_H5_CHECK(H5Dwrite(ds, H5T_NATIVE_FLOAT, ms.get(), fs.get(), xfer.get(), at));
    crc = crc_of(at, n * row_bytes, crc);
  }
  return crc;
}

struct PosixOptions {
  bool sfr = false;        // sync_file_range(WRITE) after every piece
  bool datasync = false;   // fdatasync before close
  bool crc = true;
};

std::uint32_t posix_write(int fd, std::uint64_t offset, const void* data, std::uint64_t bytes,
                          const PosixOptions& o) {
  std::uint32_t crc = crc_of(nullptr, 0, 0);
  const auto* p = static_cast<const char*>(data);
  for (std::uint64_t done = 0; done < bytes;) {
    const std::uint64_t n = std::min(kPiece, bytes - done);
    std::uint64_t put = 0;
    while (put < n) {
      const ssize_t w = ::pwrite(fd, p + done + put, n - put, static_cast<off_t>(offset + done + put));
      if (w < 0) throw IoError(fmt::format("pwrite: {}", std::strerror(errno)));
      put += static_cast<std::uint64_t>(w);
    }
    if (o.crc) crc = crc_of(p + done, n, crc);
    done += n;
    const std::uint64_t every = kSfrEvery == 0 ? kPiece : kSfrEvery;
    if (o.sfr && (done % every == 0 || done == bytes)) {
      const std::uint64_t from = (done - 1) / every * every;
      ::sync_file_range(fd, static_cast<off_t>(offset + from), static_cast<off_t>(done - from),
                        SYNC_FILE_RANGE_WRITE);
    }
  }
  return crc;
}

std::uint32_t mpiio_write(MPI_File fh, std::uint64_t offset, const void* data, std::uint64_t bytes) {
  std::uint32_t crc = crc_of(nullptr, 0, 0);
  const auto* p = static_cast<const char*>(data);
  for (std::uint64_t done = 0; done < bytes;) {
    const std::uint64_t n = std::min(kPiece, bytes - done);
    LOCUS_MPI_CHECK(MPI_File_write_at(fh, static_cast<MPI_Offset>(offset + done),
                                      const_cast<char*>(p + done), static_cast<int>(n), MPI_BYTE,
                                      MPI_STATUS_IGNORE));
    crc = crc_of(p + done, n, crc);
    done += n;
  }
  return crc;
}

double g_close_s = 0;  // rank 0: create .. close of the last write_file (the rest is the fsync)

// Collective: one checkpoint-shaped file written by `variant`; returns the seconds from the
// create to the end of rank 0's fsync (the slowest rank's view).
double write_file(const mpi::Comm& comm, const std::string& path, std::vector<Tensor>& tensors,
                  const std::string& name) {
  std::string variant = name.substr(0, name.find(':'));
  if (variant.size() > 4 && variant.ends_with("-pre")) variant.resize(variant.size() - 4);
  const auto colon = name.find(':'), colon2 = name.find(':', colon + 1);
  kPiece = colon == std::string::npos ? 8u << 20 : std::stoull(name.substr(colon + 1)) << 20;
  kSfrEvery = colon2 == std::string::npos ? 0 : std::stoull(name.substr(colon2 + 1)) << 20;
  comm.barrier();
  const auto t0 = Clock::now();
  if (name.find("-pre") != std::string::npos && comm.is_root()) {  // like the checkpoint's preflight
    std::uint64_t total = 0;
    for (const auto& t : tensors) total += t.rows * t.cols * sizeof(float);
    const int pf = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (pf < 0 || ::ftruncate(pf, static_cast<off_t>(total + (64u << 10))) != 0) throw IoError("preflight");
    ::close(pf);
  }
  comm.barrier();
  h5::Id fapl = fapl_of(comm);
  h5::Id file(LOCUS_H5_CHECK(H5Fcreate(path.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get())));
  std::vector<h5::Id> ds;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    ds.push_back(create_tensor(file.get(), fmt::format("/t{}", i), tensors[i]));
  }
  std::vector<std::uint32_t> crcs(tensors.size());
  const bool posix = variant.rfind("pwrite", 0) == 0;
  int fd = -1;
  if (posix) {
    fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) throw IoError(fmt::format("open '{}': {}", path, std::strerror(errno)));
  }
  PosixOptions po;
  po.sfr = variant != "pwrite";
  po.datasync = variant == "pwrite-sfr-ds";
  po.crc = variant != "pwrite-nocrc";
  MPI_File* fh = nullptr;
  if (variant == "mpiio") {
    LOCUS_H5_CHECK(H5Fget_vfd_handle(file.get(), H5P_DEFAULT, reinterpret_cast<void**>(&fh)));
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    const std::uint64_t row_bytes = t.cols * sizeof(float);
    const std::uint64_t at = t.mine.begin * row_bytes, bytes = t.mine.count * row_bytes;
    if (variant == "h5-indep") crcs[i] = h5_write(ds[i].get(), t, kPiece, false);
    else if (variant == "h5-indep-1") crcs[i] = h5_write(ds[i].get(), t, 0, false);
    else if (variant == "h5-coll") crcs[i] = h5_write(ds[i].get(), t, 0, true);
    else if (variant == "mpiio") crcs[i] = mpiio_write(*fh, H5Dget_offset(ds[i].get()) + at, t.share.data(), bytes);
    else if (posix) crcs[i] = posix_write(fd, H5Dget_offset(ds[i].get()) + at, t.share.data(), bytes, po);
    else if (variant == "raw") {
      io::RawFile f = io::RawFile::open(h5::file_name(ds[i].get()), io::RawFile::Mode::write);
      crcs[i] = f.write_at(*h5::raw_offset(ds[i].get(), H5T_NATIVE_FLOAT) + at,
                           std::as_bytes(std::span<const float>(t.share)));
      f.close();
    }
    else throw ConfigError("unknown variant " + variant);
  }
  if (fd >= 0) {
    if (po.datasync && ::fdatasync(fd) != 0) throw IoError("fdatasync");
    ::close(fd);
  }
  std::vector<std::uint32_t> all(crcs.size() * static_cast<std::size_t>(comm.size()));
  LOCUS_MPI_CHECK(MPI_Allgather(crcs.data(), static_cast<int>(crcs.size()), MPI_UINT32_T,
                                all.data(), static_cast<int>(crcs.size()), MPI_UINT32_T, comm.get()));
  for (std::size_t i = 0; i < ds.size(); ++i) {
    h5::Id space(LOCUS_H5_CHECK(H5Screate(H5S_SCALAR)));
    h5::Id a(LOCUS_H5_CHECK(H5Acreate2(ds[i].get(), "crc32", H5T_STD_I64LE, space.get(),
                                       H5P_DEFAULT, H5P_DEFAULT)));
    const std::int64_t v = all[i];
    LOCUS_H5_CHECK(H5Awrite(a.get(), H5T_NATIVE_INT64, &v));
  }
  ds.clear();
  LOCUS_H5_CHECK(H5Fclose(file.release()));
  comm.barrier();
  g_close_s = since(t0);
  if (comm.is_root()) {
    const int f = ::open(path.c_str(), O_RDONLY);
    if (f < 0 || ::fsync(f) != 0) throw IoError("fsync " + path);
    ::close(f);
  }
  return comm.allreduce(since(t0), MPI_MAX);
}

// Rank 0 (others idle): `dd if=src of=dst bs=1M conv=fsync`, timed.
double dd_copy(const mpi::Comm& comm, const std::string& src, const std::string& dst) {
  double s = 0;
  bench::on_root(comm, [&] {
    const auto t0 = Clock::now();
    bench::run_shell(fmt::format("dd if='{}' of='{}' bs=1M conv=fsync status=none", src, dst));
    s = since(t0);
  });
  return comm.allreduce(s, MPI_MAX);
}

// Rank 0 (others idle): dd's loop (read 1 MiB, write it, fsync) in this process, timed.
double copy_in_rank(const mpi::Comm& comm, const std::string& src, const std::string& dst) {
  double s = 0;
  bench::on_root(comm, [&] {
    const auto t0 = Clock::now();
    const int in = ::open(src.c_str(), O_RDONLY), out = ::open(dst.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    std::vector<char> buf(1u << 20);
    for (ssize_t n; (n = ::read(in, buf.data(), buf.size())) > 0;) {
      if (::write(out, buf.data(), static_cast<std::size_t>(n)) != n) throw IoError("write");
    }
    if (::fsync(out) != 0) throw IoError("fsync");
    ::close(in);
    ::close(out);
    s = since(t0);
  });
  return comm.allreduce(s, MPI_MAX);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string w; std::getline(in, w, ',');) out.push_back(w);
  return out;
}

int run(mpi::Comm& world, int argc, char** argv) {
  if (argc < 3) throw ConfigError("usage: locus_ckpt_write_variants DIR MiB [tensors] [rounds] [variants]");
  h5::init();
  const std::string dir = argv[1];
  const std::uint64_t total = std::strtoull(argv[2], nullptr, 10) << 20;
  const int ntensors = argc > 3 ? std::atoi(argv[3]) : 1;
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 3;
  const std::vector<std::string> variants = split(
      argc > 5 ? argv[5] : "h5-indep,h5-indep-1,h5-coll,mpiio,pwrite,pwrite-sfr,pwrite-sfr-ds,pwrite-nocrc");
  // HOG_MIB: memory each rank holds besides its share (a training job's footprint).
  std::vector<char> hog(std::getenv("HOG_MIB") ? std::strtoull(std::getenv("HOG_MIB"), nullptr, 10) << 20 : 0);
  std::memset(hog.data(), 1, hog.size());
  // Square-ish tensors of 4096 columns sharing the bytes.
  std::vector<Tensor> tensors(static_cast<std::size_t>(ntensors));
  std::uint64_t bytes = 0;
  for (int i = 0; i < ntensors; ++i) {
    Tensor& t = tensors[static_cast<std::size_t>(i)];
    t.cols = 4096;
    t.rows = total / static_cast<std::uint64_t>(ntensors) / (t.cols * sizeof(float));
    t.mine = h5::partition_rows(t.rows, world.rank(), world.size());
    t.share.resize(t.mine.count * t.cols);
    std::iota(t.share.begin(), t.share.end(), static_cast<float>(world.rank() * 1000 + i));
    bytes += t.rows * t.cols * sizeof(float);
  }
  auto report = [&](const std::string& what, int round, double s) {
    if (world.is_root()) {
      std::printf("{\"variant\":\"%s\",\"round\":%d,\"ranks\":%d,\"bytes\":%llu,\"s\":%.4f,"
                  "\"GBps\":%.4f,\"close_s\":%.4f,\"load\":%.2f}\n", what.c_str(), round,
                  world.size(), static_cast<unsigned long long>(bytes), s,
                  static_cast<double>(bytes) / 1e9 / s, what == "dd" ? 0.0 : g_close_s, bench::loadavg());
      std::fflush(stdout);
    }
  };
  const std::string dd_src = dir + "/dd-src.h5", dd_dst = dir + "/dd-dst.bin";
  write_file(world, dd_src, tensors, "pwrite");  // the dd source, like run_ckpt_bench.sh's
  std::vector<std::string> order = variants;
  order.push_back("dd");
  // Every timed write starts alike: the previous file deleted (as retention deletes old
  // checkpoints), nothing dirty, the disk idle for a second (the file system here is mounted
  // with `discard`, so a deletion keeps the disk busy for a while).
  for (int r = 0; r < rounds; ++r) {
    for (const std::string& v : order) {
      if (world.is_root()) {
        ::sync();
        ::sleep(1);
      }
      world.barrier();
      const std::string path = fmt::format("{}/{}.{}", dir, v.substr(0, v.find(':')),
                                           v.starts_with("dd") ? "bin" : "h5");
      report(v, r, v == "dd"       ? dd_copy(world, dd_src, path)
                   : v == "ddrank" ? copy_in_rank(world, dd_src, path)
                                   : write_file(world, path, tensors, v));
      if (world.is_root()) ::unlink(path.c_str());
    }
    std::rotate(order.begin(), order.begin() + 1, order.end());
  }
  if (world.is_root()) ::unlink(dd_src.c_str());
  return exit_code::ok;
}

}  // namespace

int main(int argc, char** argv) {
  return locus::run_app(argc, argv, [&](locus::mpi::Comm& world) { return run(world, argc, argv); });
}
