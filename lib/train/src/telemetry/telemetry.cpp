// The telemetry observer: sampling (/proc, getrusage, NVML), one MPI_Gather per interval, the
// telemetry metrics line and the Prometheus file (rank 0).
#include "locus/train/telemetry/telemetry.hpp"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "locus/comm/agree.hpp"
#include "locus/comm/error.hpp"
#include "locus/config.hpp"
#include "locus/io/json.hpp"
#include "locus/io/progress_file.hpp"
#include "locus/io/text_file.hpp"
#if LOCUS_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace locus::train::telemetry {

namespace {

std::string read_small_file(const char* path) {
  std::ifstream in(path);
  if (!in) return {};
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The number after `key` + one of ": " at the start of a line of `text`; kMissing if none.
double value_after(std::string_view text, std::string_view key) {
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t end = std::min(text.find('\n', at), text.size());
    const std::string_view line = text.substr(at, end - at);
    if (line.size() > key.size() && line.substr(0, key.size()) == key && line[key.size()] == ':') {
      std::size_t p = key.size() + 1;
      while (p < line.size() && (line[p] == ' ' || line[p] == '\t')) ++p;
      std::uint64_t v = 0;
      const auto r = std::from_chars(line.data() + p, line.data() + line.size(), v);
      if (r.ec != std::errc() || r.ptr == line.data() + p) return kMissing;
      return static_cast<double>(v);
    }
    at = end + 1;
  }
  return kMissing;
}

#if LOCUS_WITH_CUDA
// The PCI bus id of the calling thread's current CUDA device ("" when there is none).
std::string current_cuda_pci_bus_id() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) return {};
  char id[32] = {};
  if (cudaDeviceGetPCIBusId(id, sizeof id, device) != cudaSuccess) return {};
  return id;
}
#endif

// Collective over comm: every rank's host name on every rank (fixed 64-byte slots).
std::vector<std::string> all_hosts(const mpi::Comm& comm) {
  constexpr int kSlot = 64;
  std::string mine = mpi::hostname().substr(0, kSlot - 1);
  mine.resize(kSlot, '\0');
  std::string all(static_cast<std::size_t>(kSlot * comm.size()), '\0');
  LOCUS_MPI_CHECK(MPI_Allgather(mine.data(), kSlot, MPI_CHAR, all.data(), kSlot, MPI_CHAR,
                                comm.get()));
  std::vector<std::string> out;
  for (int r = 0; r < comm.size(); ++r) out.emplace_back(all.c_str() + r * kSlot);
  return out;
}

}  // namespace

double status_kib(std::string_view status, std::string_view key) {
  return value_after(status, key);  // "VmRSS:\t  123456 kB"
}

double proc_io_value(std::string_view io, std::string_view key) { return value_after(io, key); }

ProcessSample sample_process() {
  ProcessSample s;
  const std::string status = read_small_file("/proc/self/status");
  if (const double kib = status_kib(status, "VmRSS"); !std::isnan(kib)) s.rss_mib = kib / 1024.0;
  if (const double kib = status_kib(status, "VmHWM"); !std::isnan(kib)) {
    s.rss_peak_mib = kib / 1024.0;
  }
  rusage u{};
  if (::getrusage(RUSAGE_SELF, &u) == 0) {
    auto sec = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
    s.cpu_s = sec(u.ru_utime) + sec(u.ru_stime);
    s.minor_faults = static_cast<double>(u.ru_minflt);
    s.major_faults = static_cast<double>(u.ru_majflt);
  }
  const std::string io = read_small_file("/proc/self/io");  // absent without task accounting
  s.read_bytes = proc_io_value(io, "read_bytes");
  s.write_bytes = proc_io_value(io, "write_bytes");
  return s;
}

std::array<double, RankSample::kValues> RankSample::pack() const {
  const ProcessSample& p = process;
  return {p.rss_mib,      p.rss_peak_mib,     p.cpu_s,         p.minor_faults,  p.major_faults,
          p.read_bytes,   p.write_bytes,      gpu.util_pct,    gpu.mem_used_mib,
          gpu.mem_total_mib, gpu.power_w,     gpu.temp_c,      gpu.sm_clock_mhz,
          gpu.mem_clock_mhz};
}

RankSample RankSample::unpack(const double* v) {
  RankSample r;
  r.process = {v[0], v[1], v[2], v[3], v[4], v[5], v[6]};
  r.gpu = {v[7], v[8], v[9], v[10], v[11], v[12], v[13]};
  return r;
}

namespace {

// The members of a telemetry line, in order: name and where the value comes from.
struct Field {
  const char* json;
  double (*get)(const RankSample&);
  bool gpu;
};
const Field kFields[] = {
    {"rss_mib", [](const RankSample& r) { return r.process.rss_mib; }, false},
    {"rss_peak_mib", [](const RankSample& r) { return r.process.rss_peak_mib; }, false},
    {"cpu_s", [](const RankSample& r) { return r.process.cpu_s; }, false},
    {"minor_faults", [](const RankSample& r) { return r.process.minor_faults; }, false},
    {"major_faults", [](const RankSample& r) { return r.process.major_faults; }, false},
    {"read_bytes", [](const RankSample& r) { return r.process.read_bytes; }, false},
    {"write_bytes", [](const RankSample& r) { return r.process.write_bytes; }, false},
    {"gpu_util_pct", [](const RankSample& r) { return r.gpu.util_pct; }, true},
    {"gpu_mem_used_mib", [](const RankSample& r) { return r.gpu.mem_used_mib; }, true},
    {"gpu_mem_total_mib", [](const RankSample& r) { return r.gpu.mem_total_mib; }, true},
    {"gpu_power_w", [](const RankSample& r) { return r.gpu.power_w; }, true},
    {"gpu_temp_c", [](const RankSample& r) { return r.gpu.temp_c; }, true},
    {"gpu_sm_clock_mhz", [](const RankSample& r) { return r.gpu.sm_clock_mhz; }, true},
    {"gpu_mem_clock_mhz", [](const RankSample& r) { return r.gpu.mem_clock_mhz; }, true},
};

bool any_gpu(const std::vector<RankSample>& ranks) {
  for (const auto& r : ranks) {
    if (!std::isnan(r.gpu.util_pct) || !std::isnan(r.gpu.mem_used_mib)) return true;
  }
  return false;
}

// A Prometheus sample value: Go's float syntax accepts what fmt's shortest round trip writes.
std::string prom_value(double v) { return fmt::format("{}", v); }

}  // namespace

std::string Telemetry::to_json(std::int64_t step, double time,
                               const std::vector<RankSample>& ranks) {
  io::Json j;
  j["type"] = "telemetry";
  j["step"] = step;
  j["time"] = time;
  const bool gpu = any_gpu(ranks);
  for (const Field& f : kFields) {
    if (f.gpu && !gpu) continue;
    io::Json a = io::Json::array();
    for (const RankSample& r : ranks) a.push_back(f.get(r));  // NaN is written as null
    j[f.json] = std::move(a);
  }
  return io::dump_json(j);
}

std::string prometheus_text(std::string_view job_name, const StepMetrics* step,
                            const std::vector<RankSample>& ranks,
                            const std::vector<std::string>& hosts, double time, bool running) {
  std::string out;
  const std::string job_label =
      fmt::format("locus_job=\"{}\"", io::prometheus_label_value(job_name));
  auto family = [&](const char* name, const char* type, const char* help) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  };
  auto job = [&](const char* name, const char* type, const char* help, double v) {
    if (!std::isfinite(v)) return;
    family(name, type, help);
    out += fmt::format("{}{{{}}} {}\n", name, job_label, prom_value(v));
  };
  job("locus_train_running", "gauge", "1 while locus-train trains, 0 once it has stopped.",
      running ? 1 : 0);
  job("locus_train_last_update_timestamp_seconds", "gauge",
      "Unix time rank 0 last rewrote this file.", time);
  if (step != nullptr) {
    job("locus_train_step", "gauge", "Optimizer steps taken.", static_cast<double>(step->step));
    job("locus_train_epoch", "gauge", "Epoch in progress (0-based).",
        static_cast<double>(step->epoch));
    job("locus_train_loss", "gauge", "Mean training loss over the last log interval.", step->loss);
    job("locus_train_accuracy", "gauge", "Training accuracy over the last log interval.",
        step->accuracy);
    job("locus_train_learning_rate", "gauge", "Learning rate of the last step.", step->lr);
    job("locus_train_samples_per_second", "gauge",
        "Global training throughput over the last log interval.", step->samples_per_s);
    job("locus_train_data_wait_ratio", "gauge",
        "Share of the last log interval rank 0 waited for its loader.", step->data_wait_fraction);
    job("locus_train_allreduce_seconds", "gauge",
        "Gradient all-reduce time over the last log interval (rank 0).", step->allreduce_s);
    job("locus_train_allreduce_hidden_ratio", "gauge",
        "Share of the gradient all-reduce hidden behind backward (last log interval).",
        step->hidden_fraction);
  }
  struct PerRank {
    const char* name;
    const char* type;
    const char* help;
    const char* extra;  // a further label, or ""
    double (*get)(const RankSample&);
  };
  const PerRank per_rank[] = {
      {"locus_rank_resident_memory_bytes", "gauge", "Resident set size of the rank's process.",
       "", [](const RankSample& r) { return r.process.rss_mib * 1048576.0; }},
      {"locus_rank_resident_memory_peak_bytes", "gauge", "Peak resident set size (VmHWM).", "",
       [](const RankSample& r) { return r.process.rss_peak_mib * 1048576.0; }},
      {"locus_rank_cpu_seconds_total", "counter", "User and system CPU time of the process.",
       "", [](const RankSample& r) { return r.process.cpu_s; }},
      {"locus_rank_page_faults_total", "counter", "Page faults of the process.",
       "kind=\"minor\"", [](const RankSample& r) { return r.process.minor_faults; }},
      {"locus_rank_page_faults_total", "counter", "", "kind=\"major\"",
       [](const RankSample& r) { return r.process.major_faults; }},
      {"locus_rank_storage_bytes_total", "counter",
       "Bytes the process read from or wrote to storage (/proc/self/io).", "direction=\"read\"",
       [](const RankSample& r) { return r.process.read_bytes; }},
      {"locus_rank_storage_bytes_total", "counter", "", "direction=\"write\"",
       [](const RankSample& r) { return r.process.write_bytes; }},
      {"locus_rank_gpu_utilization_ratio", "gauge", "Share of time a kernel ran on the GPU.", "",
       [](const RankSample& r) { return r.gpu.util_pct / 100.0; }},
      {"locus_rank_gpu_memory_used_bytes", "gauge", "GPU memory in use.", "",
       [](const RankSample& r) { return r.gpu.mem_used_mib * 1048576.0; }},
      {"locus_rank_gpu_memory_total_bytes", "gauge", "GPU memory in all.", "",
       [](const RankSample& r) { return r.gpu.mem_total_mib * 1048576.0; }},
      {"locus_rank_gpu_power_watts", "gauge", "GPU power draw.", "",
       [](const RankSample& r) { return r.gpu.power_w; }},
      {"locus_rank_gpu_temperature_celsius", "gauge", "GPU temperature.", "",
       [](const RankSample& r) { return r.gpu.temp_c; }},
      {"locus_rank_gpu_clock_hertz", "gauge", "GPU clocks.", "clock=\"sm\"",
       [](const RankSample& r) { return r.gpu.sm_clock_mhz * 1e6; }},
      {"locus_rank_gpu_clock_hertz", "gauge", "", "clock=\"memory\"",
       [](const RankSample& r) { return r.gpu.mem_clock_mhz * 1e6; }},
  };
  std::string open_family;  // one HELP/TYPE per metric name, its series together
  for (const PerRank& m : per_rank) {
    std::string lines;
    for (std::size_t r = 0; r < ranks.size(); ++r) {
      const double v = m.get(ranks[r]);
      if (!std::isfinite(v)) continue;
      lines += fmt::format("{}{{{},rank=\"{}\",host=\"{}\"{}{}}} {}\n", m.name, job_label, r,
                           io::prometheus_label_value(r < hosts.size() ? hosts[r] : ""),
                           *m.extra ? "," : "", m.extra, prom_value(v));
    }
    if (lines.empty()) continue;
    if (open_family != m.name) {
      const PerRank* first = &m;
      for (const PerRank& f : per_rank) {
        if (std::strcmp(f.name, m.name) == 0) {
          first = &f;
          break;
        }
      }
      family(m.name, m.type, first->help);
      open_family = m.name;
    }
    out += lines;
  }
  return out;
}

namespace {

[[noreturn]] void prometheus_fail(const std::string& path, int err) {
  throw IoError(fmt::format("cannot write the Prometheus file '{}': {}; set train.prometheus "
                            "to a writable path (a node_exporter textfile directory), or to "
                            "empty to disable it",
                            path, std::strerror(err)));
}

}  // namespace

void check_prometheus_dir(const std::string& path) {
  if (const int err = io::directory_writable(path)) prometheus_fail(path, err);
}

void write_file_atomically(const std::string& path, const std::string& text) {
  if (const int err = io::replace_file(path, text)) prometheus_fail(path, err);
}

Telemetry::Telemetry(const mpi::Comm& comm, TelemetryOptions options, JsonlMetrics* sink)
    : comm_(comm), opts_(std::move(options)), sink_(sink) {
  if (!opts_.enabled && opts_.prometheus.empty()) return;
  hosts_ = all_hosts(comm_);
  if (opts_.enabled && opts_.gpu) {
    nvml_ = Nvml::load(&gpu_note_, opts_.nvml_library);
    std::string pci = opts_.gpu_device;
#if LOCUS_WITH_CUDA
    if (pci.empty()) pci = current_cuda_pci_bus_id();
#endif
    if (nvml_ && pci.empty()) {
      gpu_note_ = "no current CUDA device to match with NVML; GPU telemetry is off";
      nvml_.reset();
    }
    if (nvml_ && !nvml_->select(pci, 0, &gpu_note_)) nvml_.reset();
  }
  if (!opts_.prometheus.empty()) {
    mpi::agree_on(comm_, [&] {
      if (!comm_.is_root()) return;
      write_file_atomically(opts_.prometheus,
                            prometheus_text(io::prometheus_job(opts_.prometheus), nullptr, {},
                                            hosts_, unix_seconds(), true));
    });
  }
}

Telemetry::~Telemetry() {
  // The job is over (or going): say so, with the last figures, so a dashboard does not show a
  // stopped job as running.
  if (comm_.is_root() && prometheus_ok_ && !opts_.prometheus.empty()) {
    try {
      write_file_atomically(opts_.prometheus,
                            prometheus_text(io::prometheus_job(opts_.prometheus),
                                            last_step_ ? &*last_step_ : nullptr, last_, hosts_,
                                            unix_seconds(), false));
    } catch (...) {  // a destructor reports nothing more than the run already did
    }
  }
}

void Telemetry::on_step(const StepMetrics& m) {
  if (opts_.enabled) {
    RankSample mine;
    mine.process = sample_process();
    if (nvml_) mine.gpu = nvml_->sample();
    const auto packed = mine.pack();
    std::vector<double> all(comm_.is_root() ? RankSample::kValues * comm_.size() : 0);
    LOCUS_MPI_CHECK(MPI_Gather(packed.data(), static_cast<int>(packed.size()), MPI_DOUBLE,
                               all.data(), static_cast<int>(packed.size()), MPI_DOUBLE, 0,
                               comm_.get()));
    if (comm_.is_root()) {
      last_.clear();
      for (int r = 0; r < comm_.size(); ++r) {
        last_.push_back(RankSample::unpack(all.data() + RankSample::kValues * r));
      }
    }
  }
  if (!comm_.is_root()) return;
  last_step_ = m;
  const double now = unix_seconds();
  if (opts_.enabled && sink_ != nullptr) sink_->write_record(to_json(m.step, now, last_));
  if (!opts_.prometheus.empty() && prometheus_ok_) {
    try {
      write_file_atomically(opts_.prometheus, prometheus_text(io::prometheus_job(opts_.prometheus),
                                                              &m, last_, hosts_, now, true));
    } catch (const Error& e) {
      // Only rank 0 writes: throwing would strand its peers in the next collective. Reported
      // once; training goes on.
      std::fprintf(stderr, "warning: %s; the Prometheus file is no longer updated\n", e.what());
      prometheus_ok_ = false;
    }
  }
}

}  // namespace locus::train::telemetry
