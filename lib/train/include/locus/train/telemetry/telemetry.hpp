// Per-rank telemetry at the log interval: what the process costs (RSS, CPU time, page faults,
// storage I/O) and, on a GPU, what the device does (utilization, memory, power, temperature,
// clocks, through NVML loaded at run time). Each interval one fixed-size MPI_Gather brings every
// rank's sample to rank 0, which writes a `"type":"telemetry"` metrics line and, optionally, a
// Prometheus text file (docs/FORMATS.md, "Telemetry lines" and "The Prometheus file").
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/train/metrics.hpp"

namespace locus::train::telemetry {

inline constexpr double kMissing = std::numeric_limits<double>::quiet_NaN();

// One rank's process at one instant. Counters (cpu_s, faults, bytes) run from the process's
// start. kMissing where the host does not tell (e.g. /proc/self/io unreadable).
struct ProcessSample {
  double rss_mib = kMissing, rss_peak_mib = kMissing;  // VmRSS, VmHWM
  double cpu_s = kMissing;                             // user + system (getrusage)
  double minor_faults = kMissing, major_faults = kMissing;
  double read_bytes = kMissing, write_bytes = kMissing;  // storage I/O (/proc/self/io)
};
ProcessSample sample_process();

// The parsers behind sample_process(), for tests: the value in kB of `key` ("VmRSS") in the
// text of /proc/<pid>/status, and a member ("read_bytes") of /proc/<pid>/io; kMissing when
// absent or malformed.
double status_kib(std::string_view status, std::string_view key);
double proc_io_value(std::string_view io, std::string_view key);

// One GPU at one instant (kMissing: not available).
struct GpuSample {
  double util_pct = kMissing;  // share of the last sample period a kernel ran
  double mem_used_mib = kMissing, mem_total_mib = kMissing;
  double power_w = kMissing, temp_c = kMissing;
  double sm_clock_mhz = kMissing, mem_clock_mhz = kMissing;
};

// NVML (libnvidia-ml.so.1, the driver's management library), loaded with dlopen at run time:
// builds need no NVML headers or library, and a host without the driver only loses the GPU
// figures. One device per rank.
class Nvml {
 public:
  // Loads `library` and initialises NVML; null (and *why says what failed) when the library
  // or one of its functions is missing or nvmlInit fails.
  static std::unique_ptr<Nvml> load(std::string* why,
                                    const std::string& library = "libnvidia-ml.so.1");
  ~Nvml();
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  // Chooses the device: by PCI bus id ("0000:3b:00.0", what CUDA calls the device, so that
  // CUDA_VISIBLE_DEVICES renumbering does not matter) when given, else by NVML index. False
  // (and *why) when there is no such device.
  bool select(const std::string& pci_bus_id, unsigned index, std::string* why);
  // Figures NVML cannot give for this device stay kMissing.
  GpuSample sample() const;
  const std::string& device_name() const noexcept { return name_; }

  struct Api;  // the resolved functions (telemetry/nvml.cpp)

 private:
  Nvml() = default;
  void* lib_ = nullptr;
  std::unique_ptr<Api> api_;
  void* device_ = nullptr;
  std::string name_;
};

// What one rank sends to rank 0 each interval.
struct RankSample {
  ProcessSample process;
  GpuSample gpu;
  static constexpr std::size_t kValues = 14;
  std::array<double, kValues> pack() const;
  static RankSample unpack(const double* v);
};

// The Prometheus text exposition (format 0.0.4) of one interval: the step's figures as job-wide
// gauges, every rank's sample as gauges and counters labelled {rank, host}, every series
// labelled locus_job="<job>" first (io::prometheus_job of the file's path); series whose value
// is missing are left out. `running` = 0 once the trainer is done.
std::string prometheus_text(std::string_view job, const StepMetrics* step,
                            const std::vector<RankSample>& ranks,
                            const std::vector<std::string>& hosts, double time, bool running);

// Replaces `path` with `text` the way node_exporter's textfile collector expects: a temporary
// file in the same directory, then rename(2), so a scrape never sees half a file. IoError
// naming the file on failure.
void write_file_atomically(const std::string& path, const std::string& text);

// Local: the IoError write_file_atomically would give unless this process may create files in
// the directory of the Prometheus file `path`; checked before the file's lock is taken (the
// lock file lies beside it).
void check_prometheus_dir(const std::string& path);

struct TelemetryOptions {
  bool enabled = true;     // train.telemetry: sample the ranks (telemetry lines, the per-rank
                           // series of the Prometheus file)
  std::string prometheus;  // train.prometheus: the file rank 0 rewrites (empty: none)
  bool gpu = false;        // sample this rank's GPU (the cuda backend)
  std::string nvml_library = "libnvidia-ml.so.1";
  std::string gpu_device;  // its PCI bus id (empty: the calling thread's current CUDA device)
};

// The observer: on every rank at each interval's end (on_step) it samples, gathers and, on
// rank 0, writes the telemetry line into `sink` and the Prometheus file. Without sampling
// (enabled = false) the Prometheus file still gets the job-wide figures; without either it does
// nothing, collectives included.
class Telemetry final : public TrainObserver {
 public:
  // Collective over comm. A Prometheus path that cannot be written is an IoError on every rank
  // (agreed), before training starts. `sink` may be null (no metrics file); it must outlive
  // this object.
  Telemetry(const mpi::Comm& comm, TelemetryOptions options, JsonlMetrics* sink);
  ~Telemetry() override;
  Telemetry(const Telemetry&) = delete;
  Telemetry& operator=(const Telemetry&) = delete;

  void on_step(const StepMetrics& m) override;
  // Where the telemetry lines go from now on (null: nowhere); must outlive this object.
  void attach(JsonlMetrics* sink) noexcept { sink_ = sink; }

  // Every rank's host name, in rank order (on every rank).
  const std::vector<std::string>& hosts() const noexcept { return hosts_; }
  // Why the GPU figures are missing on this rank ("" when they are there or not wanted).
  const std::string& gpu_note() const noexcept { return gpu_note_; }
  // The telemetry line of `step` (what on_step writes), for tests.
  static std::string to_json(std::int64_t step, double time, const std::vector<RankSample>& r);

 private:
  void write_prometheus(const StepMetrics* m, bool running);
  const mpi::Comm& comm_;
  TelemetryOptions opts_;
  JsonlMetrics* sink_;
  std::unique_ptr<Nvml> nvml_;
  std::string gpu_note_;
  std::vector<std::string> hosts_;
  std::vector<RankSample> last_;  // rank 0: the last interval's samples
  std::optional<StepMetrics> last_step_;
  bool prometheus_ok_ = true;
};

}  // namespace locus::train::telemetry
