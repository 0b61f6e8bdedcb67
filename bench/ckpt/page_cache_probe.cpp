// What a buffered write into new page-cache pages costs here, with nothing else in the process:
// one process writes BYTES (default 1 GiB) from offset 0 of a new file in pieces of each given
// size, then fsyncs, ROUNDS times per size (sizes interleaved), and prints the copy time (the
// write calls) and the fsync time. Optionally it first holds HOLD_MIB of touched memory, or
// runs under mpirun after MPI_Init (--mpi), to see whether a rank's state slows the copy. The
// checkpoint benchmark's explanation rests on it (bench/RESULTS.md, "Checkpoints": pieces of
// 2 MiB and more get 2 MiB folios, which come from free blocks the VM has reported to its host).
//   locus_page_cache_probe --dir DIR [--pieces-kib 256,1024,2048,4096] [--rounds 2]
//                          [--hold-mib 0] [--bytes-mib 1024] [--settle 2] [--mpi]
//   mpirun -n 2 locus_page_cache_probe --dir DIR --mpi --hold-mib 4096   (rank 0 writes)
#include <fcntl.h>
#include <mpi.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <boost/program_options.hpp>

#include "../common/bench_cli.hpp"

namespace {

namespace po = boost::program_options;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string dir;
  std::string pieces_kib = "256,1024,2048,4096";
  int rounds = 2;
  std::size_t hold_mib = 0;
  std::size_t bytes_mib = 1024;
  double settle_s = 2;
  bool mpi = false;
};

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "locus_page_cache_probe: %s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(3);
}

// Writes bytes of `piece`-sized writes into a new `path` and fsyncs it: {copy s, fsync s}.
std::pair<double, double> write_file(const std::string& path, std::size_t bytes,
                                     const std::vector<char>& piece) {
  ::unlink(path.c_str());
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create " + path);
  const auto t0 = Clock::now();
  for (std::size_t done = 0; done < bytes; done += piece.size()) {
    if (::write(fd, piece.data(), piece.size()) != static_cast<ssize_t>(piece.size())) {
      fail("cannot write " + path);
    }
  }
  const double copy = seconds_since(t0);
  const auto t1 = Clock::now();
  if (::fsync(fd) != 0) fail("cannot fsync " + path);
  const double sync = seconds_since(t1);
  ::close(fd);
  return {copy, sync};
}

void probe(const Options& o) {
  std::vector<std::size_t> pieces;  // bytes, from "256,1024,..." KiB
  std::size_t kib = 0;
  for (char c : o.pieces_kib + ",") {
    if (c >= '0' && c <= '9') {
      kib = kib * 10 + static_cast<std::size_t>(c - '0');
    } else if (kib > 0) {
      pieces.push_back(kib << 10);
      kib = 0;
    }
  }
  const std::string path = o.dir + "/locus_page_cache_probe.bin";
  const std::size_t bytes = o.bytes_mib << 20;
  std::printf("# %zu MiB per write, %zu MiB held, %s, load %.2f\n", o.bytes_mib, o.hold_mib,
              o.mpi ? "after MPI_Init" : "no MPI", locus::bench::loadavg());
  std::printf("# %9s %6s %8s %8s %8s\n", "piece_KiB", "round", "copy_s", "fsync_s", "GB/s");
  for (int r = 0; r < o.rounds; ++r) {
    for (std::size_t piece : pieces) {
      ::unlink(path.c_str());
      ::sync();
      std::this_thread::sleep_for(std::chrono::duration<double>(o.settle_s));
      const std::vector<char> buf(piece, 7);
      const auto [copy, sync] = write_file(path, bytes, buf);
      std::printf("  %9zu %6d %8.3f %8.3f %8.2f\n", piece >> 10, r, copy, sync,
                  static_cast<double>(bytes) / 1e9 / (copy + sync));
      std::fflush(stdout);
    }
  }
  ::unlink(path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  po::options_description desc("locus_page_cache_probe --dir DIR [options]");
  desc.add_options()("help,h", "print this help")
      ("dir", po::value(&o.dir)->required(), "directory for the test file")
      ("pieces-kib", po::value(&o.pieces_kib)->default_value(o.pieces_kib),
       "comma-separated write sizes in KiB")
      ("rounds", po::value(&o.rounds)->default_value(o.rounds), "rounds over the sizes")
      ("hold-mib", po::value(&o.hold_mib)->default_value(o.hold_mib), "touched memory held")
      ("bytes-mib", po::value(&o.bytes_mib)->default_value(o.bytes_mib), "bytes per file")
      ("settle", po::value(&o.settle_s)->default_value(o.settle_s),
       "seconds after deleting the previous file")
      ("mpi", po::bool_switch(&o.mpi), "call MPI_Init first (run under mpirun)");
  po::variables_map vm;
  try {
    if (locus::bench::parse_command_line(desc, argc, argv, "locus_page_cache_probe", vm)) {
      return 0;
    }
  } catch (const locus::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  int rank = 0;
  if (o.mpi) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  }
  std::vector<char> held(o.hold_mib << 20);
  std::memset(held.data(), 1, held.size());  // touched and resident, as a rank's state is
  if (rank == 0) probe(o);                   // the other ranks only hold their memory
  if (o.mpi) {
    MPI_Barrier(MPI_COMM_WORLD);
    MPI_Finalize();
  }
  return 0;
}
