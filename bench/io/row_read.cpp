// Reading a 2-D float32 features dataset stripe by stripe into one buffer, as a locus-infer
// rank fills its read ring, side by side: H5Dread (what locus-infer did before io::RowReader),
// io::RowReader at each thread count, and a plain pread of the same number of bytes from the
// file's start (the page cache's copy speed, the `cat` of this benchmark). One process, no MPI;
// warm page cache (an untimed read of the whole file first); variants alternated within each
// round; the buffer on 2 MiB pages, touched before timing. Prints per variant the median and
// min..max GB/s of feature bytes and the ratio of medians to H5Dread.
//   locus_row_read --reps 7 --stripe_rows 8192 --threads 1,2,4,8 input.h5
#include <hdf5.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include "locus/comm/error.hpp"
#include "locus/io/h5.hpp"
#include "locus/io/row_reader.hpp"

namespace po = boost::program_options;
using namespace locus;

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Buffer {
  float* p = nullptr;
  std::size_t bytes = 0;
  explicit Buffer(std::size_t n) : bytes((n * sizeof(float) + (2u << 20) - 1) & ~((2u << 20) - 1)) {
    void* m = std::aligned_alloc(2u << 20, bytes);
    if (m == nullptr) throw std::bad_alloc();
    ::madvise(m, bytes, MADV_HUGEPAGE);
    std::memset(m, 0, bytes);
    p = static_cast<float*>(m);
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
};

void h5_read(hid_t d, std::uint64_t first, std::uint64_t n, std::uint64_t cols, float* out) {
  const std::array<hsize_t, 2> start{first, 0}, count{n, cols};
  h5::Id fs(LOCUS_H5_CHECK(H5Dget_space(d)));
  LOCUS_H5_CHECK(
      H5Sselect_hyperslab(fs.get(), H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr));
  h5::Id ms(LOCUS_H5_CHECK(H5Screate_simple(2, count.data(), nullptr)));
  LOCUS_H5_CHECK(H5Dread(d, H5T_NATIVE_FLOAT, ms.get(), fs.get(), H5P_DEFAULT, out));
}

int run(int argc, char** argv) {
  int reps = 7;
  std::uint64_t stripe_rows = 8192;
  std::string file, features = "/features", threads_list = "1,2,4,8";
  po::options_description desc("locus_row_read [options] FILE");
  desc.add_options()("help", "this text")("reps", po::value(&reps)->default_value(7),
                                          "timed rounds (every variant once per round)")(
      "stripe_rows", po::value(&stripe_rows)->default_value(8192), "rows per read")(
      "threads", po::value(&threads_list)->default_value("1,2,4,8"),
      "io::RowReader thread counts, comma-separated")(
      "features", po::value(&features)->default_value("/features"), "dataset to read")(
      "file", po::value(&file)->required(), "HDF5 file");
  po::positional_options_description pos;
  pos.add("file", 1);
  po::variables_map vm;
  po::store(po::command_line_parser(argc, argv).options(desc).positional(pos).run(), vm);
  if (vm.count("help") != 0) {
    std::cout << desc << "\n";
    return 0;
  }
  po::notify(vm);
  std::vector<int> threads;
  for (std::size_t at = 0; at < threads_list.size();) {
    const std::size_t comma = std::min(threads_list.find(',', at), threads_list.size());
    threads.push_back(std::stoi(threads_list.substr(at, comma - at)));
    at = comma + 1;
  }

  h5::init();
  h5::Id f(LOCUS_H5_CHECK(H5Fopen(file.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT)));
  h5::Id dapl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_ACCESS)));
  LOCUS_H5_CHECK(H5Pset_chunk_cache(dapl.get(), 0, 0, H5D_CHUNK_CACHE_W0_DEFAULT));
  h5::Id d(LOCUS_H5_CHECK(H5Dopen2(f.get(), features.c_str(), dapl.get())));
  std::vector<std::unique_ptr<io::RowReader>> readers;
  for (int t : threads) readers.push_back(std::make_unique<io::RowReader>(f.get(), d.get(), t));
  const std::uint64_t cols = readers.front()->cols();
  h5::Id space(LOCUS_H5_CHECK(H5Dget_space(d.get())));
  std::array<hsize_t, 2> dims{0, 0};
  LOCUS_H5_CHECK(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr));
  const std::uint64_t rows = dims[0], bytes = rows * cols * sizeof(float);
  Buffer buf(stripe_rows * cols);
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw DataError(fmt::format("cannot open '{}'", file));

  // Variant 0: H5Dread; 1: plain pread of the same bytes; 2+i: readers[i].
  const std::size_t variants = 2 + readers.size();
  auto pass = [&](std::size_t v) {
    const double t0 = now();
    for (std::uint64_t r = 0; r < rows; r += stripe_rows) {
      const std::uint64_t n = std::min(stripe_rows, rows - r);
      if (v == 0) {
        h5_read(d.get(), r, n, cols, buf.p);
      } else if (v == 1) {
        const std::uint64_t want = n * cols * sizeof(float);
        for (std::uint64_t got = 0; got < want;) {
          const ssize_t k = ::pread(fd, reinterpret_cast<char*>(buf.p) + got, want - got,
                                    static_cast<off_t>(r * cols * sizeof(float) + got));
          if (k <= 0) throw DataError(fmt::format("short read of '{}'", file));
          got += static_cast<std::uint64_t>(k);
        }
      } else {
        readers[v - 2]->read(r, std::span<float>(buf.p, n * cols));
      }
    }
    return now() - t0;
  };
  pass(1);  // warm the page cache
  std::vector<std::vector<double>> secs(variants);
  for (int rep = 0; rep < reps; ++rep)
    for (std::size_t v = 0; v < variants; ++v) secs[v].push_back(pass(v));
  ::close(fd);

  auto median = [](std::vector<double> s) {
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  };
  fmt::print("# {}: {} rows x {} floats ({:.2f} GB), stripes of {} rows, {} rounds, warm cache\n",
             file, rows, cols, static_cast<double>(bytes) / 1e9, stripe_rows, reps);
  fmt::print("{:<56} {:>10} {:>16} {:>10}\n", "variant", "median GB/s", "min..max GB/s",
             "/ H5Dread");
  const double base = median(secs[0]);
  for (std::size_t v = 0; v < variants; ++v) {
    const std::string name = v == 0   ? "H5Dread (HDF5, one thread)"
                             : v == 1 ? "pread, 1 thread, plain bytes (the copy bound)"
                                      : "RowReader: " + readers[v - 2]->method();
    const auto [lo, hi] = std::minmax_element(secs[v].begin(), secs[v].end());
    const double gb = static_cast<double>(bytes) / 1e9;
    fmt::print("{:<56} {:>10.2f} {:>7.2f}..{:<7.2f} {:>10.2f}\n", name, gb / median(secs[v]),
               gb / *hi, gb / *lo, base / median(secs[v]));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "locus_row_read: " << e.what() << "\n";
    return 1;
  }
}
