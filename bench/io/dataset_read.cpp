// Collective read throughput of locus datasets, side by side: every rank reads its balanced
// share of /features and /labels (io::read_rows, one collective transfer per rank, as the
// loader's in-memory modes and locus-infer's units read), files alternated rep by rep so load
// spikes on a shared machine hit each alike. Warm page cache (an untimed read first): what is
// timed is HDF5, MPI-IO and, for a compressed file, the decompression. Prints, per file, the
// median and min..max of MB/s of values (uncompressed float32 + int32 bytes) and its size.
//   mpirun -n 2 locus_dataset_read --reps 7 plain.h5 deflate.h5
#include <sys/stat.h>

#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <fmt/format.h>
#include <mpi.h>

#include "../common/bench_cli.hpp"
#include "locus/comm/app.hpp"
#include "locus/io/compression.hpp"
#include "locus/io/dataset_file.hpp"

namespace po = boost::program_options;
using namespace locus;

namespace {

double read_once(const mpi::Comm& comm, const std::string& path, std::uint64_t& bytes) {
  comm.barrier();
  const double t0 = MPI_Wtime();
  h5::File f = h5::File::open(comm, path, h5::File::Mode::read);
  const io::DatasetMeta meta = io::read_meta(f);
  const h5::RowRange mine =
      h5::partition_rows(static_cast<std::uint64_t>(meta.rows), comm.rank(), comm.size());
  const io::Table t = io::read_rows(f, meta, mine);
  f.close();
  comm.barrier();
  const double s = MPI_Wtime() - t0;
  bytes = static_cast<std::uint64_t>(meta.rows) *
          (static_cast<std::uint64_t>(meta.cols) * 4 + (meta.has_labels ? 4 : 0));
  if (t.features.size() != mine.count * static_cast<std::uint64_t>(meta.cols))
    throw InternalError("short read");
  return s;
}

int run(mpi::Comm& world, int argc, char** argv) {
  int reps = 7;
  std::vector<std::string> files;
  po::options_description desc("locus_dataset_read [--reps N] FILE...");
  desc.add_options()("help", "this text")("reps", po::value(&reps)->default_value(7),
                                          "timed reads of each file")(
      "files", po::value(&files)->required(), "locus datasets to read");
  po::positional_options_description pos;
  pos.add("files", -1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).positional(pos).run(), vm);
    if (vm.count("help") != 0) {
      if (world.is_root()) std::cout << desc << "\n";
      return exit_code::ok;
    }
    po::notify(vm);
  } catch (const po::error& e) {
    throw ConfigError(fmt::format("{}: see locus_dataset_read --help", e.what()));
  }
  std::vector<std::vector<double>> secs(files.size());
  std::vector<std::uint64_t> bytes(files.size());
  for (std::size_t i = 0; i < files.size(); ++i) read_once(world, files[i], bytes[i]);  // warm
  for (int r = 0; r < reps; ++r)
    for (std::size_t i = 0; i < files.size(); ++i)
      secs[i].push_back(read_once(world, files[i], bytes[i]));
  std::vector<std::string> compression;
  for (const std::string& path : files) {
    h5::File f = h5::File::open(world, path, h5::File::Mode::read);
    compression.push_back(io::to_string(io::compression_of(h5::Dataset::open(f, "/features").id())));
  }
  if (!world.is_root()) return exit_code::ok;
  fmt::print("{:<40} {:>12} {:>10} {:>10} {:>16}\n", "file (" + std::to_string(world.size()) +
             " ranks, warm cache)", "compression", "MB", "median MB/s", "min..max MB/s");
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::vector<double> mbps;
    for (double s : secs[i]) mbps.push_back(static_cast<double>(bytes[i]) / 1e6 / s);
    std::sort(mbps.begin(), mbps.end());
    const double med = mbps.size() % 2 ? mbps[mbps.size() / 2]
                                       : (mbps[mbps.size() / 2 - 1] + mbps[mbps.size() / 2]) / 2;
    struct stat st {};
    ::stat(files[i].c_str(), &st);
    fmt::print("{:<40} {:>12} {:>10.1f} {:>10.0f} {:>8.0f}..{:<.0f}\n", files[i],
               compression[i], static_cast<double>(st.st_size) / 1e6,
               med, mbps.front(), mbps.back());
  }
  fmt::print("load average {:.2f}\n", bench::loadavg());
  return exit_code::ok;
}

}  // namespace

int main(int argc, char** argv) {
  ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  return run_app(argc, argv, [&](mpi::Comm& world) { return run(world, argc, argv); });
}
