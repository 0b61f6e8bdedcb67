// Telemetry (lib/train/src/telemetry/): the /proc parsers and the process sampler, NVML through
// dlopen (a missing library, a failing nvmlInit, and a stand-in library with NVML's ABI:
// tests/train/fake_nvml.cpp), the Prometheus exposition checked line by line against the text
// format's grammar, the atomic rewrite, and the observer at 1 and 2 ranks: one telemetry line
// per interval with every rank's figures, the Prometheus file, an unwritable path refused on
// every rank.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "agreed_error.hpp"
#include "locus/io/json.hpp"
#include "locus/io/progress_file.hpp"
#include "locus/train/telemetry/telemetry.hpp"
#include "shared_tmpdir.hpp"

using namespace locus;
using namespace locus::train::telemetry;
namespace fs = std::filesystem;

namespace {

const mpi::Comm& world() {
  static const mpi::Comm w = mpi::Comm::world();
  return w;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Parses a Prometheus text exposition (format 0.0.4) strictly: every line a HELP, a TYPE or a
// sample; names and label names as the format allows; label values escaped; one HELP and one
// TYPE per family, before its samples, whose lines are contiguous; counters end in _total; no
// series twice. Returns sample name{labels} -> value; records a failure on any violation.
// job (escaped as in the file) non-empty: every sample's first label must be
// locus_job="<job>", which the returned keys leave out.
std::map<std::string, double> parse_prometheus(const std::string& text,
                                               std::string_view job = {}) {
  static const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) [^\n]+)");
  static const std::regex type(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (gauge|counter))");
  static const std::regex sample(
      R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")(,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\[\\"n])*")*\})? ([-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|NaN|[-+]Inf))");
  std::map<std::string, double> out;
  std::map<std::string, std::string> types;
  std::set<std::string> helped, closed;
  std::string current;
  EXPECT_TRUE(!text.empty() && text.back() == '\n') << "the exposition must end with a newline";
  std::istringstream in(text);
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    std::smatch m;
    if (std::regex_match(line, m, help)) {
      EXPECT_TRUE(helped.insert(m[1]).second) << "line " << n << ": second HELP: " << line;
      EXPECT_EQ(closed.count(m[1]), 0u) << "line " << n << ": HELP after samples: " << line;
    } else if (std::regex_match(line, m, type)) {
      EXPECT_TRUE(types.emplace(m[1], m[2]).second) << "line " << n << ": second TYPE: " << line;
      if (m[2] == "counter") {
        EXPECT_TRUE(std::string(m[1]).ends_with("_total")) << "line " << n << ": " << line;
      }
    } else if (std::regex_match(line, m, sample)) {
      const std::string name = m[1];
      EXPECT_TRUE(types.count(name) && helped.count(name))
          << "line " << n << ": a sample before its family's HELP and TYPE: " << line;
      if (name != current) {
        EXPECT_EQ(closed.count(name), 0u) << "line " << n << ": family " << name
                                          << " is not contiguous";
        if (!current.empty()) closed.insert(current);
        current = name;
      }
      std::string labels = m[2].str();
      if (!job.empty()) {
        const std::string first = "{locus_job=\"" + std::string(job) + "\"";
        EXPECT_TRUE(labels.starts_with(first)) << "line " << n << ": not " << first << ": " << line;
        if (labels.starts_with(first)) {
          labels = labels.size() > first.size() + 1 && labels[first.size()] == ','
                       ? "{" + labels.substr(first.size() + 1)
                       : "";
        }
      }
      const std::string key = name + labels;
      EXPECT_TRUE(out.emplace(key, std::stod(m[5])).second) << "line " << n << ": twice: " << line;
    } else {
      ADD_FAILURE() << "line " << n << " is not Prometheus text format: '" << line << "'";
    }
  }
  return out;
}

std::string fake_nvml() { return LOCUS_FAKE_NVML; }

}  // namespace

TEST(Telemetry, ProcParsers) {
  const std::string status = "Name:\tlocus-train\nVmPeak:\t  900000 kB\nVmHWM:\t  524288 kB\n"
                             "VmRSS:\t  262144 kB\nThreads:\t3\n";
  EXPECT_EQ(status_kib(status, "VmRSS"), 262144.0);
  EXPECT_EQ(status_kib(status, "VmHWM"), 524288.0);
  EXPECT_TRUE(std::isnan(status_kib(status, "VmSwap")));  // absent
  EXPECT_TRUE(std::isnan(status_kib(status, "VmRS")));    // a prefix is not the key
  EXPECT_TRUE(std::isnan(status_kib("VmRSS:\tlots kB\n", "VmRSS")));
  const std::string io = "rchar: 5000\nwchar: 300\nsyscr: 10\nsyscw: 3\nread_bytes: 4096\n"
                         "write_bytes: 8192\ncancelled_write_bytes: 0\n";
  EXPECT_EQ(proc_io_value(io, "read_bytes"), 4096.0);
  EXPECT_EQ(proc_io_value(io, "write_bytes"), 8192.0);
  EXPECT_TRUE(std::isnan(proc_io_value("", "read_bytes")));
}

TEST(Telemetry, ProcessSampleMovesWithTheProcess) {
  const ProcessSample a = sample_process();
  ASSERT_GT(a.rss_mib, 1.0);
  EXPECT_GE(a.rss_peak_mib, a.rss_mib);
  EXPECT_GT(a.minor_faults, 0.0);
  // 64 MiB touched page by page, and some CPU burnt: RSS, faults and CPU time follow.
  std::vector<char> block(64 << 20);
  for (std::size_t i = 0; i < block.size(); i += 4096) block[i] = static_cast<char>(i);
  volatile double x = 0;
  for (int i = 0; i < 20000000; ++i) x = x + std::sqrt(static_cast<double>(i));
  const ProcessSample b = sample_process();
  EXPECT_GT(b.rss_mib, a.rss_mib + 50) << "RSS " << a.rss_mib << " -> " << b.rss_mib;
  EXPECT_GT(b.minor_faults, a.minor_faults + 10000);
  EXPECT_GT(b.cpu_s, a.cpu_s);
  EXPECT_EQ(block[4096], static_cast<char>(4096));
  if (!std::isnan(a.read_bytes)) {
    EXPECT_GE(b.read_bytes, a.read_bytes);
  }
}

TEST(Telemetry, NvmlMissingOrFailing) {
  std::string why;
  EXPECT_EQ(Nvml::load(&why, "libnvidia-ml-does-not-exist.so.1"), nullptr);
  EXPECT_NE(why.find("libnvidia-ml-does-not-exist.so.1"), std::string::npos) << why;
  EXPECT_NE(why.find("GPU telemetry is off"), std::string::npos) << why;
  // A library without NVML's functions.
  EXPECT_EQ(Nvml::load(&why, "libz.so.1"), nullptr);
  EXPECT_NE(why.find("lacks nvmlInit_v2"), std::string::npos) << why;
  ::setenv("FAKE_NVML_INIT_FAIL", "1", 1);
  EXPECT_EQ(Nvml::load(&why, fake_nvml()), nullptr);
  ::unsetenv("FAKE_NVML_INIT_FAIL");
  EXPECT_NE(why.find("nvmlInit failed: Driver Not Loaded (NVML error 9)"), std::string::npos)
      << why;
}

TEST(Telemetry, NvmlThroughItsAbi) {
  std::string why;
  auto nvml = Nvml::load(&why, fake_nvml());
  ASSERT_NE(nvml, nullptr) << why;
  EXPECT_TRUE(std::isnan(nvml->sample().util_pct)) << "no device chosen yet";
  EXPECT_FALSE(nvml->select("0000:AF:00.0", 0, &why));
  EXPECT_NE(why.find("NVML has no device 0000:AF:00.0: Not Found"), std::string::npos) << why;
  ASSERT_TRUE(nvml->select("0000:3B:00.0", 0, &why)) << why;
  EXPECT_EQ(nvml->device_name(), "Fake H100");
  const GpuSample g = nvml->sample();
  EXPECT_EQ(g.util_pct, 87.0);
  EXPECT_EQ(g.mem_used_mib, 20.0 * 1024);
  EXPECT_EQ(g.mem_total_mib, 80.0 * 1024);
  EXPECT_EQ(g.power_w, 512.25);
  EXPECT_EQ(g.temp_c, 61.0);
  EXPECT_EQ(g.sm_clock_mhz, 1980.0);
  EXPECT_EQ(g.mem_clock_mhz, 2619.0);
  auto by_index = Nvml::load(&why, fake_nvml());
  ASSERT_NE(by_index, nullptr);
  EXPECT_TRUE(by_index->select("", 0, &why)) << why;
  EXPECT_FALSE(by_index->select("", 3, &why));
}

TEST(Telemetry, PrometheusTextFollowsTheFormat) {
  RankSample a, b;
  a.process = {100.0, 120.0, 3.5, 1000, 2, 4096, 0};
  b.process = {200.0, 220.0, 4.5, 2000, 0, kMissing, kMissing};
  b.gpu = {87, 20480, 81920, 512.25, 61, 1980, 2619};
  train::StepMetrics m;
  m.step = 300;
  m.epoch = 2;
  m.loss = 0.375;
  m.samples_per_s = 12345.5;
  m.data_wait_fraction = 0.01;
  m.lr = 1e-5;
  // The job label on every series, escaped as any label value.
  const std::string text =
      prometheus_text("run\"7", &m, {a, b}, {"node\"1", "n2"}, 1764045000.5, true);
  const auto got = parse_prometheus(text, R"(run\"7)");
  EXPECT_EQ(got.at("locus_train_step"), 300);
  EXPECT_EQ(got.at("locus_train_loss"), 0.375);
  EXPECT_EQ(got.at("locus_train_learning_rate"), 1e-5);
  EXPECT_EQ(got.at("locus_train_samples_per_second"), 12345.5);
  EXPECT_EQ(got.at("locus_train_running"), 1);
  EXPECT_EQ(got.at("locus_train_last_update_timestamp_seconds"), 1764045000.5);
  EXPECT_EQ(got.at(R"(locus_rank_resident_memory_bytes{rank="0",host="node\"1"})"), 100.0 * 1048576);
  EXPECT_EQ(got.at(R"(locus_rank_cpu_seconds_total{rank="1",host="n2"})"), 4.5);
  EXPECT_EQ(got.at(R"(locus_rank_page_faults_total{rank="0",host="node\"1",kind="major"})"), 2);
  EXPECT_EQ(got.at(R"(locus_rank_storage_bytes_total{rank="0",host="node\"1",direction="read"})"),
            4096);
  // Missing figures are left out, not written as NaN.
  EXPECT_EQ(got.count(R"(locus_rank_storage_bytes_total{rank="1",host="n2",direction="read"})"), 0u);
  EXPECT_EQ(got.count(R"(locus_rank_gpu_power_watts{rank="0",host="node\"1"})"), 0u);
  EXPECT_EQ(got.at(R"(locus_rank_gpu_power_watts{rank="1",host="n2"})"), 512.25);
  EXPECT_EQ(got.at(R"(locus_rank_gpu_utilization_ratio{rank="1",host="n2"})"), 0.87);
  EXPECT_EQ(got.at(R"(locus_rank_gpu_clock_hertz{rank="1",host="n2",clock="sm"})"), 1980e6);
  // Before the first interval and after the end.
  const auto idle = parse_prometheus(prometheus_text("job", nullptr, {}, {}, 1.0, false), "job");
  EXPECT_EQ(idle.at("locus_train_running"), 0);
  EXPECT_EQ(idle.count("locus_train_step"), 0u);
}

// The job label's value: the file's name without its directory and a trailing ".prom" (names in
// one directory are unique, so two jobs' files there never carry the same series).
TEST(Telemetry, PrometheusJobIsTheFilesName) {
  EXPECT_EQ(io::prometheus_job("/var/lib/node_exporter/infer-4121.prom"), "infer-4121");
  EXPECT_EQ(io::prometheus_job("train.prom"), "train");
  EXPECT_EQ(io::prometheus_job("dir.prom/metrics.txt"), "metrics.txt");
  EXPECT_EQ(io::prometheus_job("a.prom.prom"), "a.prom");
  EXPECT_EQ(io::prometheus_job(".prom"), ".prom");  // nothing would be left
  EXPECT_EQ(io::prometheus_label_value("a\"b\\c\nd"), R"(a\"b\\c\nd)");
}

// The checker above is strict: what the format forbids fails it.
TEST(Telemetry, PrometheusCheckerRejectsBadText) {
  EXPECT_NONFATAL_FAILURE(parse_prometheus("a 1\n"), "before its family's HELP and TYPE");
  EXPECT_NONFATAL_FAILURE(parse_prometheus("# HELP a x\n# TYPE a counter\na 1\n"), "_total");
  EXPECT_NONFATAL_FAILURE(
      parse_prometheus("# HELP a x\n# TYPE a gauge\na{h=\"x\"y\"} 1\n"), "not Prometheus");
  EXPECT_NONFATAL_FAILURE(parse_prometheus("# HELP a x\n# TYPE a gauge\na 1\na 2\n"), "twice");
  EXPECT_NONFATAL_FAILURE(parse_prometheus("# HELP a x\n# TYPE a gauge\na nan\n"),
                          "not Prometheus");
  EXPECT_NONFATAL_FAILURE(
      parse_prometheus("# HELP a x\n# TYPE a gauge\n# HELP b y\n# TYPE b gauge\n"
                       "a{r=\"0\"} 1\nb 2\na{r=\"1\"} 1\n"),
      "not contiguous");
  EXPECT_NONFATAL_FAILURE(parse_prometheus("# HELP a x\n# TYPE a gauge\na 1"), "newline");
}

TEST(Telemetry, AtomicRewrite) {
  if (!world().is_root()) return;
  test::SharedTmpDir dir(mpi::Comm::borrow(MPI_COMM_SELF));
  const std::string p = dir.file("job.prom");
  write_file_atomically(p, "a 1\n");
  write_file_atomically(p, "a 2\n");
  EXPECT_EQ(slurp(p), "a 2\n");
  int files = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++files;
  EXPECT_EQ(files, 1) << "a temporary file was left behind";
  try {
    write_file_atomically(dir.file("no/such/dir/job.prom"), "a 1\n");
    ADD_FAILURE() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write the Prometheus file '" +
                                         dir.file("no/such/dir/job.prom") + "'"),
              std::string::npos)
        << e.what();
  }
}

// The observer on every rank: lines and file after each interval, GPU figures through the
// stand-in NVML, and the end of the job in the Prometheus file.
TEST(Telemetry, ObserverWritesLinesAndPrometheus) {
  test::SharedTmpDir dir(world());
  const std::string metrics_path = dir.file("m.jsonl"), prom = dir.file("job.prom");
  {
    train::JsonlMetrics metrics(world(), metrics_path);
    TelemetryOptions o;
    o.prometheus = prom;
    o.gpu = true;
    o.nvml_library = fake_nvml();
    o.gpu_device = "0000:3b:00.0";
    Telemetry t(world(), o, &metrics);
    EXPECT_EQ(t.gpu_note(), "");
    ASSERT_EQ(t.hosts().size(), static_cast<std::size_t>(world().size()));
    EXPECT_EQ(t.hosts()[0], mpi::hostname());
    train::StepMetrics m;
    for (std::int64_t step : {10, 20}) {
      m.step = step;
      m.loss = 1.0 / static_cast<double>(step);
      t.on_step(m);
      if (world().is_root()) {
        const auto p = parse_prometheus(slurp(prom), "job");
        EXPECT_EQ(p.at("locus_train_step"), static_cast<double>(step));
        EXPECT_EQ(p.at("locus_train_running"), 1);
        for (int r = 0; r < world().size(); ++r) {
          const std::string labels = "{rank=\"" + std::to_string(r) + "\",host=\"" +
                                     t.hosts()[static_cast<std::size_t>(r)] + "\"}";
          EXPECT_GT(p.at("locus_rank_resident_memory_bytes" + labels), 1e6);
          EXPECT_EQ(p.at("locus_rank_gpu_temperature_celsius" + labels), 61);
        }
      }
    }
  }
  if (!world().is_root()) return;
  const auto done = parse_prometheus(slurp(prom), "job");
  EXPECT_EQ(done.at("locus_train_running"), 0) << "the end of the job is not in the file";
  EXPECT_EQ(done.at("locus_train_step"), 20) << "the last figures are kept at the end";
  std::ifstream in(metrics_path);
  std::vector<io::Json> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(io::Json::parse(l));
  ASSERT_EQ(lines.size(), 2u);
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const io::Json& j = lines[i];
    EXPECT_EQ(j.begin().key(), "type");
    EXPECT_EQ(j["type"], "telemetry");
    EXPECT_EQ(j["step"], i == 0 ? 10 : 20);
    EXPECT_GT(j["time"].get<double>(), 1.6e9);
    for (const char* k : {"rss_mib", "cpu_s", "minor_faults", "major_faults", "gpu_util_pct",
                          "gpu_power_w", "gpu_mem_clock_mhz"}) {
      ASSERT_TRUE(j.contains(k) && j[k].is_array()) << k << " in " << j;
      EXPECT_EQ(j[k].size(), static_cast<std::size_t>(world().size())) << k;
    }
    EXPECT_GT(j["rss_mib"][world().size() - 1].get<double>(), 1.0);
    EXPECT_EQ(j["gpu_power_w"][0].get<double>(), 512.25);
  }
}

TEST(Telemetry, NoGpuMeansNoGpuMembers) {
  test::SharedTmpDir dir(world());
  {
    train::JsonlMetrics metrics(world(), dir.file("m.jsonl"));
    TelemetryOptions o;
    o.gpu = true;
    o.nvml_library = "libnvidia-ml-does-not-exist.so.1";
    Telemetry t(world(), o, &metrics);
    EXPECT_NE(t.gpu_note().find("cannot be loaded"), std::string::npos) << t.gpu_note();
    train::StepMetrics m;
    m.step = 5;
    t.on_step(m);
  }
  if (!world().is_root()) return;
  const io::Json j = io::Json::parse(slurp(dir.file("m.jsonl")));
  EXPECT_TRUE(j.contains("rss_mib"));
  EXPECT_FALSE(j.contains("gpu_util_pct")) << j;
}

TEST(Telemetry, UnwritablePrometheusPathIsRefusedOnEveryRank) {
  test::SharedTmpDir dir(world());
  TelemetryOptions o;
  o.prometheus = dir.file("missing-dir/job.prom");
  const std::string msg =
      test::agreed_error<IoError>([&] { Telemetry t(world(), o, nullptr); });
  EXPECT_NE(msg.find("set train.prometheus to a writable path"), std::string::npos) << msg;
}

// train.telemetry = false: no sampling and no telemetry lines; the Prometheus file still has
// the job's figures, without per-rank series.
TEST(Telemetry, DisabledSamplesNothing) {
  test::SharedTmpDir dir(world());
  {
    train::JsonlMetrics metrics(world(), dir.file("m.jsonl"));
    TelemetryOptions o;
    o.enabled = false;
    o.prometheus = dir.file("job.prom");
    Telemetry t(world(), o, &metrics);
    train::StepMetrics m;
    m.step = 7;
    t.on_step(m);
  }
  if (!world().is_root()) return;
  EXPECT_EQ(slurp(dir.file("m.jsonl")), "");
  const auto p = parse_prometheus(slurp(dir.file("job.prom")), "job");
  EXPECT_EQ(p.at("locus_train_step"), 7);
  for (const auto& [k, v] : p) EXPECT_FALSE(k.starts_with("locus_rank_")) << k;
}
