// HDF5 collective write (with fsync) and read bandwidth of a float32 [N, D] dataset beside
// `dd conv=fsync` and `cat` of the same byte count in the same directory, alternated rep by
// rep so load spikes on a shared machine hit both sides. Every read is verified.
// Reads are timed two ways: the whole share into one buffer (what a caller holding the dataset
// in memory pays), and streamed in pieces through one small reused buffer (how locus-infer and
// the out-of-core loader read, and how cat reads).
//   mpirun -n 2 locus_h5_bandwidth --bytes 1GiB --dir /tmp/x --reps 5
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <boost/program_options.hpp>
#include <fmt/format.h>

#include "../common/bench_cli.hpp"
#include "locus/comm/app.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "locus/io/publish.hpp"
#include "raw_baseline.hpp"

namespace po = boost::program_options;
using namespace locus;

namespace {

struct Options {
  std::uint64_t bytes = std::uint64_t{1} << 30;
  std::uint64_t stream_bytes = std::uint64_t{2} << 20;  // piece of a streamed read; 0: none
  std::uint64_t cols = 1024;
  std::string dir = ".";
  int reps = 5;
  int warmup = 1;                // untimed reps first (first touches of fresh memory are slow)
  std::uint64_t chunk_rows = 0;  // 0: the library's default (about 1 MiB per chunk)
  bool extendible = false;       // the layout locus-ingest writes (unlimited rows)
  bool cold = true;              // also time reads after evicting the file from the cache
  bool raw = true;               // also run dd and cat
  bool keep = false;             // leave the last rep's files for inspection (h5ls, h5py)
  bool help = false;
};

std::uint64_t parse_size(const std::string& option, const std::string& text) {
  std::size_t used = 0;
  std::uint64_t v = 0;
  try {
    v = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  const std::string unit = text.substr(used);
  if (used > 0 && (unit.empty() || unit == "B")) return v;
  if (used > 0 && (unit == "K" || unit == "KiB")) return v << 10;
  if (used > 0 && (unit == "M" || unit == "MiB")) return v << 20;
  if (used > 0 && (unit == "G" || unit == "GiB")) return v << 30;
  throw ConfigError(fmt::format("--{} '{}' is not a size: give bytes, or a number with "
                                "K/KiB, M/MiB or G/GiB", option, text));
}

Options parse(int argc, char** argv) {
  Options o;
  std::string bytes = "1GiB", stream_bytes = "2MiB";
  po::options_description desc("locus_h5_bandwidth options");
  desc.add_options()("help,h", "print this help")
      ("bytes", po::value(&bytes)->default_value(bytes), "dataset size (multiple of 16 MiB)")
      ("stream-bytes", po::value(&stream_bytes)->default_value(stream_bytes),
       "piece size per rank of the streamed read (0: no streamed read)")
      ("cols", po::value(&o.cols)->default_value(o.cols), "float32 columns D of [N, D]")
      ("dir", po::value(&o.dir)->default_value(o.dir), "directory for the test files")
      ("reps", po::value(&o.reps)->default_value(o.reps), "repetitions (medians are reported)")
      ("warmup", po::value(&o.warmup)->default_value(o.warmup), "untimed repetitions first")
      ("chunk-rows", po::value(&o.chunk_rows)->default_value(o.chunk_rows),
       "HDF5 chunk rows (0: library default)")
      ("extendible", po::bool_switch(&o.extendible), "unlimited rows, as locus-ingest writes")
      ("no-cold", "skip the cold-cache reads")
      ("no-raw", "skip dd and cat (HDF5 only)")
      ("keep", po::bool_switch(&o.keep), "leave the last rep's files in --dir");
  po::variables_map vm;
  o.help = bench::parse_command_line(desc, argc, argv, "locus_h5_bandwidth", vm);
  o.cold = vm.count("no-cold") == 0;
  o.raw = vm.count("no-raw") == 0;
  o.bytes = parse_size("bytes", bytes);
  o.stream_bytes = parse_size("stream-bytes", stream_bytes);
  const std::uint64_t row_bytes = o.cols * sizeof(float);
  if (o.cols == 0 || o.bytes == 0 || o.bytes % (std::uint64_t{16} << 20) != 0 ||
      o.bytes % row_bytes != 0 || o.reps < 1 || o.warmup < 0) {
    throw ConfigError(fmt::format("--bytes {} / --cols {} / --reps {}: give a size that is a "
                                  "multiple of 16 MiB and of a row ({} bytes), and reps >= 1",
                                  o.bytes, o.cols, o.reps, row_bytes));
  }
  return o;
}

// Small integers are exact in float32, so the check is exact.
float value_at(std::uint64_t row, std::uint64_t col, std::uint64_t cols) {
  return static_cast<float>((row * cols + col) % 16777213u);
}

const char* mode_name(H5D_mpio_actual_io_mode_t m) {
  switch (m) {
    case H5D_MPIO_NO_COLLECTIVE: return "independent";
    case H5D_MPIO_CHUNK_INDEPENDENT: return "chunk-independent";
    case H5D_MPIO_CHUNK_COLLECTIVE: return "chunk-collective";
    case H5D_MPIO_CHUNK_MIXED: return "chunk-mixed";
    case H5D_MPIO_CONTIGUOUS_COLLECTIVE: return "contiguous-collective";
  }
  return "?";
}

// Wall seconds of fn between two idle barriers: the slowest rank's time.
template <class Fn> double timed(const mpi::Comm& comm, Fn&& fn) {
  bench::idle_barrier(comm);
  const double t0 = MPI_Wtime();
  fn();
  bench::idle_barrier(comm);
  return MPI_Wtime() - t0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n == 0 ? 0.0 : (n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2);
}

// Rank 0's local split of one timed HDF5 operation into phases (for the notes, not the ratio).
class Phases {
 public:
  explicit Phases(std::vector<std::vector<double>>& into) : into_(into), t_(MPI_Wtime()) {}
  void mark() {
    const double now = MPI_Wtime();
    if (into_.size() <= k_) into_.resize(k_ + 1);
    into_[k_++].push_back(now - t_);
    t_ = now;
  }

 private:
  std::vector<std::vector<double>>& into_;
  double t_;
  std::size_t k_ = 0;
};

struct Series {
  const char* label;
  const char* key;
  std::vector<double> seconds;
};

// The measured series, HDF5 beside its raw counterpart. pread_warm is a diagnostic beside
// cat: every rank pread(2)s its share of the raw file into the buffer HDF5 reads into, so the
// destination is the same; cat's destination is one cache-resident 128 KiB buffer, as is
// h5_stream_warm's (one --stream-bytes piece per rank, reused).
enum Kind : std::size_t {
  h5_write, dd_write, h5_warm, cat_warm, h5_cold, cat_cold, pread_warm, h5_stream_warm
};

class Bench {
 public:
  Bench(const mpi::Comm& comm, const Options& o)
      : comm_(comm), o_(o), rows_(o.bytes / (o.cols * sizeof(float))),
        mine_(h5::partition_rows(rows_, comm.rank(), comm.size())),
        h5_path_(o.dir + "/locus_h5_bandwidth.h5"),
        raw_path_(o.dir + "/locus_h5_bandwidth.raw"),
        out_(mine_.count * o.cols), in_(mine_.count * o.cols, -1.0f),
        stream_rows_(std::max<std::uint64_t>(1, o.stream_bytes / (o.cols * sizeof(float)))),
        piece_(o.stream_bytes > 0 ? stream_rows_ * o.cols : 0, -1.0f) {
    // Every rank takes part in every collective piece, the ranks with fewer rows in empty ones.
    pieces_ = comm.allreduce<std::uint64_t>((mine_.count + stream_rows_ - 1) / stream_rows_,
                                            MPI_MAX);
    // -1, not 0: a zero-filled vector may come from calloc untouched, and the first read
    // would then pay for page faults that later reps do not.
    for (std::uint64_t r = 0; r < mine_.count; ++r)
      for (std::uint64_t c = 0; c < o.cols; ++c)
        out_[r * o.cols + c] = value_at(mine_.begin + r, c, o.cols);
  }

  void rep(int i) {
    // Alternate which side goes first so a drift in load or cache state favours neither.
    if (i % 2 == 0) {
      hdf5_side();
      if (o_.raw) raw_side();
    } else {
      if (o_.raw) raw_side();
      hdf5_side();
    }
  }

  void cleanup() {
    bench::on_root(comm_, [&] {
      bench::remove_file(h5_path_);
      bench::remove_file(raw_path_);
    });
  }

  std::vector<Series> series = {
      {"hdf5 write+close+fsync", "h5_write", {}}, {"dd conv=fsync", "dd_write", {}},
      {"hdf5 read warm", "h5_read_warm", {}},     {"cat warm", "cat_warm", {}},
      {"hdf5 read cold", "h5_read_cold", {}},     {"cat cold", "cat_cold", {}},
      {"pread warm (same buffer)", "pread_warm", {}},
      {"hdf5 read warm, streamed", "h5_stream_warm", {}}};  // by Kind
  long wrong = 0;
  H5D_mpio_actual_io_mode_t write_mode = H5D_MPIO_NO_COLLECTIVE;
  H5D_mpio_actual_io_mode_t read_mode = H5D_MPIO_NO_COLLECTIVE;
  H5D_mpio_actual_io_mode_t stream_mode = H5D_MPIO_NO_COLLECTIVE;
  double cold_resident = 0;  // largest resident fraction seen before a cold read
  std::vector<std::vector<double>> write_phases;  // create, write_rows, close, fsync
  std::vector<std::vector<double>> warm_phases;   // open, read_rows, close
  std::vector<std::vector<double>> cold_phases;

  std::uint64_t rows() const { return rows_; }

 private:
  template <class Fn> void measure(Kind k, Fn&& fn) {
    series[k].seconds.push_back(timed(comm_, std::forward<Fn>(fn)));
  }

  void hdf5_side() {
    bench::on_root(comm_, [&] { bench::remove_file(h5_path_); });
    measure(h5_write, [&] { hdf5_write(); });
    measure(h5_warm, [&] { hdf5_read(warm_phases); });
    verify();
    if (o_.stream_bytes > 0) {
      measure(h5_stream_warm, [&] { hdf5_stream_read(false); });
      hdf5_stream_read(true);  // the same reads again, untimed, checking every value
    }
    if (!o_.cold) return;
    evict(h5_path_);
    measure(h5_cold, [&] { hdf5_read(cold_phases); });
    verify();
  }

  // dd and cat run on rank 0 alone while the other ranks sleep in the barrier.
  void raw_side() {
    bench::on_root(comm_, [&] { bench::remove_file(raw_path_); });
    const std::string dd = bench::dd_write_command(raw_path_, o_.bytes);
    const std::string cat = bench::cat_read_command(raw_path_);
    auto shell = [&](const std::string& cmd) {
      return [&, cmd] { bench::on_root(comm_, [&] { bench::run_shell(cmd); }); };
    };
    measure(dd_write, shell(dd));
    measure(cat_warm, shell(cat));
    measure(pread_warm, [&] { pread_share(raw_path_); });
    if (!o_.cold) return;
    evict(raw_path_);
    measure(cat_cold, shell(cat));
  }

  // Timed: create → collective write → close → fsync (the durability dd conv=fsync gives).
  void hdf5_write() {
    Phases ph(write_phases);
    h5::File f = h5::File::create(comm_, h5_path_);
    {
      h5::Dataset ds = h5::Dataset::create(
          f, {.name = "/features", .dtype = h5::Dtype::f32, .rows = rows_, .cols = o_.cols,
              .chunk_rows = o_.chunk_rows, .extendible = o_.extendible});
      ph.mark();
      ds.write_rows<float>(mine_.begin, out_);
      write_mode = ds.last_transfer().mode;
      ph.mark();
    }
    f.close();
    ph.mark();
    // One fsync flushes the file's pages whoever wrote them (one node, one page cache), as
    // io::Publication::commit does before its rename.
    bench::on_root(comm_, [&] { io::fsync_path(h5_path_, false); });
    ph.mark();
  }

  // Timed: open → collective read → close.
  void hdf5_read(std::vector<std::vector<double>>& phases) {
    Phases ph(phases);
    h5::File f = h5::File::open(comm_, h5_path_, h5::File::Mode::read);
    {
      h5::Dataset ds = h5::Dataset::open(f, "/features");
      ph.mark();
      ds.read_rows<float>(mine_.begin, in_);
      read_mode = ds.last_transfer().mode;
      ph.mark();
    }
    f.close();
    ph.mark();
  }

  // Timed: open → this rank's rows in collective pieces of stream_rows_ into one reused
  // buffer → close. With check, every piece is compared with what was written.
  void hdf5_stream_read(bool check) {
    h5::File f = h5::File::open(comm_, h5_path_, h5::File::Mode::read);
    {
      h5::Dataset ds = h5::Dataset::open(f, "/features");
      long bad = 0;
      for (std::uint64_t k = 0; k < pieces_; ++k) {
        const std::uint64_t first = std::min(mine_.count, k * stream_rows_);
        const std::uint64_t n = std::min(stream_rows_, mine_.count - first);
        ds.read_rows<float>(mine_.begin + first, std::span(piece_).first(n * o_.cols));
        if (!check) continue;
        bad += mismatches(std::span(piece_).first(n * o_.cols), first);
        std::fill(piece_.begin(), piece_.end(), -1.0f);
      }
      if (check) wrong += comm_.allreduce(bad, MPI_SUM);
      else stream_mode = ds.last_transfer().mode;
    }
    f.close();
  }

  // This rank's byte share of a raw file of o_.bytes into in_ (whose size it is).
  void pread_share(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw IoError(fmt::format("cannot open {}: {}", path, std::strerror(errno)));
    auto* at = reinterpret_cast<char*>(in_.data());
    const std::uint64_t bytes = in_.size() * sizeof(float);
    const std::uint64_t offset = mine_.begin * o_.cols * sizeof(float);
    for (std::uint64_t done = 0; done < bytes;) {
      const ssize_t n = ::pread(fd, at + done, std::min<std::uint64_t>(bytes - done, 1u << 30),
                                static_cast<off_t>(offset + done));
      if (n <= 0) {
        ::close(fd);
        throw IoError(fmt::format("pread of {} failed at byte {}: {}", path, offset + done,
                                  n == 0 ? "unexpected end of file" : std::strerror(errno)));
      }
      done += static_cast<std::uint64_t>(n);
    }
    ::close(fd);
  }

  void verify() {
    wrong += comm_.allreduce(mismatches(in_, 0), MPI_SUM);
    std::fill(in_.begin(), in_.end(), -1.0f);  // the next read must bring its own data
  }

  // Values of `got` (this rank's rows from local row `first` on) that differ from out_.
  long mismatches(std::span<const float> got, std::uint64_t first) const {
    long bad = 0;
    const float* want = out_.data() + first * o_.cols;
    for (std::size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i] ? 1 : 0;
    return bad;
  }

  void evict(const std::string& path) {
    bench::on_root(comm_, [&] {
      bench::evict_from_page_cache(path);
      cold_resident = std::max(cold_resident, bench::resident_fraction(path));
    });
  }

  const mpi::Comm& comm_;
  const Options& o_;
  std::uint64_t rows_;
  h5::RowRange mine_;
  std::string h5_path_, raw_path_;
  std::vector<float> out_, in_;
  std::uint64_t stream_rows_;  // rows per streamed piece
  std::uint64_t pieces_ = 0;   // collective pieces of a streamed read (the most any rank needs)
  std::vector<float> piece_;
};

// Bandwidth ratio hdf5/raw of two series: of their medians, and the median of the per-rep
// ratios (each HDF5 run against the raw run of the same rep, which shares its load).
struct Ratio {
  double of_medians = 0;
  double paired = 0;
};

Ratio ratio(const Series& h5, const Series& raw) {
  Ratio r;
  if (h5.seconds.empty() || raw.seconds.size() != h5.seconds.size()) return r;
  r.of_medians = median(raw.seconds) / median(h5.seconds);
  std::vector<double> per_rep;
  for (std::size_t i = 0; i < h5.seconds.size(); ++i)
    per_rep.push_back(raw.seconds[i] / h5.seconds[i]);
  r.paired = median(per_rep);
  return r;
}

std::string phase_medians(const std::vector<std::vector<double>>& phases) {
  std::string t;
  for (const auto& v : phases) t += fmt::format("{}{:.3f}", t.empty() ? "" : "/", median(v));
  return t;
}

void print_results(const mpi::Comm& comm, const Options& o, const Bench& b) {
  const double mb = static_cast<double>(o.bytes) / 1e6;
  auto rate = [&](const Series& s) { return s.seconds.empty() ? 0.0 : mb / median(s.seconds); };
  const char* yield = std::getenv("OMPI_MCA_mpi_yield_when_idle");
  std::printf("# locus_h5_bandwidth: float32 [%llu, %llu] = %.1f MB, %d ranks, %d reps after "
              "%d warm-up, dir %s (%s), %s, chunk_rows %llu%s, mpi_yield_when_idle=%s\n",
              static_cast<unsigned long long>(b.rows()), static_cast<unsigned long long>(o.cols),
              mb, comm.size(), o.reps, o.warmup, o.dir.c_str(),
              bench::filesystem_type(o.dir).c_str(), o.extendible ? "extendible" : "fixed size",
              static_cast<unsigned long long>(o.chunk_rows), o.chunk_rows ? "" : " (default)",
              yield != nullptr ? yield : "unset");
  std::printf("# %-24s %9s %9s %9s %9s\n", "", "median_s", "MB/s", "min_MB/s", "max_MB/s");
  for (const Series& s : b.series) {
    if (s.seconds.empty()) continue;
    const auto [lo, hi] = std::minmax_element(s.seconds.begin(), s.seconds.end());
    std::printf("  %-24s %9.3f %9.1f %9.1f %9.1f\n", s.label, median(s.seconds), rate(s),
                mb / *hi, mb / *lo);
  }
  const auto& sr = b.series;
  const Ratio w = ratio(sr[h5_write], sr[dd_write]), warm = ratio(sr[h5_warm], sr[cat_warm]),
              cold = ratio(sr[h5_cold], sr[cat_cold]),
              same_buffer = ratio(sr[h5_warm], sr[pread_warm]),
              stream = ratio(sr[h5_stream_warm], sr[cat_warm]);
  if (o.raw) {
    std::printf("# hdf5/raw bandwidth, ratio of medians (median of per-rep ratios), target "
                ">= 0.90: write %.2f (%.2f), warm read %.2f (%.2f)",
                w.of_medians, w.paired, warm.of_medians, warm.paired);
    if (o.cold) std::printf(", cold read %.2f (%.2f)", cold.of_medians, cold.paired);
    if (o.stream_bytes > 0) {
      std::printf(", warm read streamed in %llu-byte pieces %.2f (%.2f)",
                  static_cast<unsigned long long>(o.stream_bytes), stream.of_medians,
                  stream.paired);
    }
    std::printf("; diagnostic: warm read vs pread into the same buffers %.2f (%.2f)\n",
                same_buffer.of_medians, same_buffer.paired);
  }
  std::printf("# transfer mode: write %s, read %s, streamed read %s; cold reads began with "
              "<= %.1f%% of the file cached; wrong values read back: %ld (%s)\n",
              mode_name(b.write_mode), mode_name(b.read_mode),
              o.stream_bytes > 0 ? mode_name(b.stream_mode) : "-", 100.0 * b.cold_resident,
              b.wrong, b.wrong == 0 ? "OK" : "FAILED");
  std::printf("# hdf5 phase medians on rank 0 (s): write create/write_rows/close/fsync %s; "
              "warm read open/read_rows/close %s; cold %s\n",
              phase_medians(b.write_phases).c_str(), phase_medians(b.warm_phases).c_str(),
              phase_medians(b.cold_phases).c_str());
  std::printf("summary ranks=%d", comm.size());
  for (const Series& s : sr) std::printf(" %s=%.1f", s.key, rate(s));
  std::printf(" write_ratio=%.3f warm_read_ratio=%.3f cold_read_ratio=%.3f write_paired=%.3f "
              "warm_read_paired=%.3f cold_read_paired=%.3f same_buffer_ratio=%.3f "
              "same_buffer_paired=%.3f stream_read_ratio=%.3f stream_read_paired=%.3f wrong=%ld "
              "write_mode=%s read_mode=%s stream_mode=%s\n",
              w.of_medians, warm.of_medians, cold.of_medians, w.paired, warm.paired, cold.paired,
              same_buffer.of_medians, same_buffer.paired, stream.of_medians, stream.paired,
              b.wrong, mode_name(b.write_mode), mode_name(b.read_mode),
              mode_name(b.stream_mode));
  std::fflush(stdout);
}

int run(mpi::Comm& world, int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.help) return 0;
  mpi::Comm comm = world.dup();
  Bench b(comm, o);
  for (int i = 0; i < o.warmup; ++i) b.rep(i);
  for (Series& s : b.series) s.seconds.clear();
  b.write_phases.clear();
  b.warm_phases.clear();
  b.cold_phases.clear();
  for (int i = 0; i < o.reps; ++i) b.rep(i);
  if (!o.keep) b.cleanup();
  if (comm.is_root()) print_results(comm, o, b);
  return b.wrong == 0 ? exit_code::ok : exit_code::data;
}

}  // namespace

int main(int argc, char** argv) {
  // As locus-train and locus-infer do: a rank waiting in a collective yields its core instead
  // of spinning, so on a shared node its peer (or dd/cat) gets the core. Set before MPI_Init,
  // which reads it; an explicit setting wins (OMPI_MCA_mpi_yield_when_idle=0 to compare).
  ::setenv("OMPI_MCA_mpi_yield_when_idle", "1", /*overwrite=*/0);
  return run_app(argc, argv, [&](mpi::Comm& world) { return run(world, argc, argv); });
}
