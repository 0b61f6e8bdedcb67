// Metrics as JSON lines (rank 0 writes, every rank agrees on whether the file opened) and the
// observer fan-out.
#include "locus/train/metrics.hpp"

#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "locus/comm/agree.hpp"
#include "locus/comm/error.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/io/json.hpp"
#include "locus/io/publish.hpp"
#include "locus/train/monitor/event.hpp"

namespace locus::train {

void ExactSum::add(double x) {
  if (x == 0) return;
  if (!std::isfinite(x) || std::abs(x) >= 0x1p150) {
    other_ += x;
    return;
  }
  int e = 0;
  const double m = std::frexp(x, &e);  // x = m 2^e, 0.5 <= |m| < 1
  const auto mantissa = static_cast<std::int64_t>(std::ldexp(m, 53));  // exact
  // x = mantissa 2^(e - 53) = mantissa 2^shift units of 2^-64.
  int shift = e - 53 + kFractionBits;
  std::uint64_t magnitude = static_cast<std::uint64_t>(mantissa < 0 ? -mantissa : mantissa);
  if (shift < 0) {  // below the grid: truncated toward zero
    if (shift <= -64) return;
    magnitude >>= -shift;
    shift = 0;
  }
  const int limb = shift / 32, bit = shift % 32;
  // Bits [32 j, 32 j + 32) of magnitude << bit (at most 85 bits: three pieces).
  auto piece = [&](int j) -> std::int64_t {
    constexpr std::uint64_t kMask = 0xffffffffu;
    if (j == 0) return static_cast<std::int64_t>((magnitude << bit) & kMask);
    const int down = 32 * j - bit;
    return down >= 64 ? 0 : static_cast<std::int64_t>((magnitude >> down) & kMask);
  };
  for (int j = 0; j < 3 && limb + j < kLimbs; ++j) {
    const std::int64_t p = piece(j);
    limb_[static_cast<std::size_t>(limb + j)] += mantissa < 0 ? -p : p;
  }
  normalize();
}

void ExactSum::add(const ExactSum& o) {
  for (std::size_t i = 0; i < limb_.size(); ++i) limb_[i] += o.limb_[i];
  other_ += o.other_;
  normalize();
}

void ExactSum::normalize() {
  for (std::size_t i = 0; i + 1 < limb_.size(); ++i) {
    const std::int64_t carry = limb_[i] >> 32;  // floor division (arithmetic shift)
    limb_[i] -= carry * (std::int64_t{1} << 32);
    limb_[i + 1] += carry;
  }
}

ExactSum ExactSum::allreduce(const mpi::Comm& comm) const {
  ExactSum out = *this;
  // Normalized limbs are below 2^32: their sum over any rank count fits in 64 bits.
  comm.allreduce_inplace(std::span<std::int64_t>(out.limb_), MPI_SUM);
  comm.allreduce_inplace(std::span<double>(&out.other_, 1), MPI_SUM);
  out.normalize();
  return out;
}

double ExactSum::value() const {
  double v = 0;
  for (std::size_t i = limb_.size(); i-- > 0;) {
    v += std::ldexp(static_cast<double>(limb_[i]), 32 * static_cast<int>(i) - kFractionBits);
  }
  return v + other_;
}

ExactSum ExactSum::from_parts(const std::array<std::int64_t, kLimbs>& limbs, double other) {
  for (std::size_t i = 0; i + 1 < limbs.size(); ++i) {
    if (limbs[i] < 0 || limbs[i] >= (std::int64_t{1} << 32)) {
      throw DataError(fmt::format("an exact sum's limb {} is {}, outside [0, 2^32): the stored "
                                  "sum is damaged", i, limbs[i]));
    }
  }
  ExactSum s;
  s.limb_ = limbs;
  s.other_ = other;
  return s;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void ObserverList::on_step(const StepMetrics& m) {
  for (auto* o : list_) o->on_step(m);
}

void ObserverList::on_epoch(const EpochMetrics& m) {
  for (auto* o : list_) o->on_epoch(m);
}

void ObserverList::on_event(const MonitorEvent& e) {
  for (auto* o : list_) o->on_event(e);
}

void ObserverList::on_ranks(const RanksRecord& r) {
  for (auto* o : list_) o->on_ranks(r);
}

std::string to_json(const StepMetrics& m) {
  io::Json j;
  j["type"] = "step";
  j["step"] = m.step;
  j["epoch"] = m.epoch;
  j["step_in_epoch"] = m.step_in_epoch;
  j["steps"] = m.steps;
  j["samples"] = m.samples;
  j["loss"] = m.loss;
  j["accuracy"] = m.accuracy;
  j["lr"] = m.lr;
  if (m.grad_norm >= 0) j["grad_norm"] = m.grad_norm;
  j["seconds"] = m.seconds;
  j["samples_per_s"] = m.samples_per_s;
  j["allreduce_s"] = m.allreduce_s;
  j["allreduce_blocked_s"] = m.allreduce_blocked_s;
  j["hidden_fraction"] = m.hidden_fraction;
  j["data_wait_s"] = m.data_wait_s;
  j["data_wait_fraction"] = m.data_wait_fraction;
  j["time"] = m.time;
  return io::dump_json(j);
}

std::string to_json(const EpochMetrics& m) {
  io::Json j;
  j["type"] = "epoch";
  j["epoch"] = m.epoch;
  j["step"] = m.step;
  j["samples"] = m.samples;
  j["train_loss"] = m.train_loss;
  j["train_accuracy"] = m.train_accuracy;
  j["seconds"] = m.seconds;
  j["samples_per_s"] = m.samples_per_s;
  j["data_wait_fraction"] = m.data_wait_fraction;
  j["hidden_fraction"] = m.hidden_fraction;
  if (m.evaluated) {
    j["eval_rows"] = m.eval.rows;
    j["eval_loss"] = m.eval.loss;
    j["eval_accuracy"] = m.eval.accuracy;
    j["eval_seconds"] = m.eval.seconds;
  }
  j["time"] = m.time;
  return io::dump_json(j);
}

namespace {

// The "step" value of one metrics line (step and epoch lines both carry it); -1 if none.
std::int64_t step_of(const std::string& line) {
  const std::string key = "\"step\":";
  const auto at = line.find(key);
  if (at == std::string::npos) return -1;
  return std::strtoll(line.c_str() + at + key.size(), nullptr, 10);
}

// The lines of an existing metrics file up to and including `step` (a resumed run continues
// after it; lines past it came from steps the interrupted run did not checkpoint). Only whole
// lines count: a last line without its newline was cut short (a kill, a full disk).
std::string lines_through(const std::string& path, std::int64_t step) {
  std::ifstream in(path);
  std::string kept, line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // no newline after it
    if (!line.empty() && step_of(line) <= step) kept += line + "\n";
  }
  return kept;
}

[[noreturn]] void metrics_io_fail(const std::string& what, const std::string& path, int err) {
  throw IoError(fmt::format("{} the metrics file '{}': {}; set train.metrics to a writable "
                            "path, or to empty to disable it", what, path, std::strerror(err)));
}

// A resumed run's file: the kept lines are written to a temporary file that then replaces the
// file by a rename, never by truncating it in place: a kill between a truncation and the
// rewrite would lose the lines before the checkpoint for good (the rerun resumes from the same
// checkpoint and keeps only what it finds). Returns the file opened for appending.
std::FILE* replace_with(const std::string& path, const std::string& kept) {
  const std::string temp = io::temp_path_for(path);
  std::FILE* t = std::fopen(temp.c_str(), "w");
  if (t == nullptr) metrics_io_fail("cannot create the temporary file for", path, errno);
  bool ok = std::fwrite(kept.data(), 1, kept.size(), t) == kept.size() && std::fflush(t) == 0 &&
            ::fsync(::fileno(t)) == 0;
  int err = errno;
  ok = std::fclose(t) == 0 && ok;
  if (!ok) {
    if (err == 0) err = errno;
    ::unlink(temp.c_str());
    metrics_io_fail(fmt::format("cannot write '{}', the new version of", temp), path, err);
  }
  test_hook("metrics-before-rename");
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    err = errno;
    ::unlink(temp.c_str());
    metrics_io_fail(fmt::format("cannot rename '{}' to", temp), path, err);
  }
  std::FILE* f = std::fopen(path.c_str(), "a");
  if (f == nullptr) metrics_io_fail("cannot open", path, errno);
  return f;
}

}  // namespace

JsonlMetrics::JsonlMetrics(const mpi::Comm& comm, const std::string& path,
                           std::int64_t resumed_step)
    : path_(path) {
  if (path.empty()) return;
  mpi::agree_on(comm, [&] {
    if (!comm.is_root()) return;
    const std::filesystem::path p(path);
    std::error_code ec;
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
    if (resumed_step >= 0) {
      file_ = replace_with(path, lines_through(path, resumed_step));
      return;
    }
    ::unlink(io::temp_path_for(path).c_str());  // a leftover of a killed resume, if any
    file_ = std::fopen(path.c_str(), "w");
    if (file_ == nullptr) metrics_io_fail("cannot create", path, errno);
  });
}

JsonlMetrics::~JsonlMetrics() {
  if (file_ != nullptr) std::fclose(file_);
}

void JsonlMetrics::write_line(const std::string& line) {
  if (file_ == nullptr) return;
  // Flushed per line so `tail -f` follows a running job and a killed job keeps its history.
  if (std::fputs(line.c_str(), file_) < 0 || std::fputc('\n', file_) == EOF ||
      std::fflush(file_) != 0) {
    // Only rank 0 writes: throwing here would strand its peers in the next collective, so a
    // failed metrics write is reported and the file dropped; training goes on.
    std::fprintf(stderr, "warning: writing the metrics file '%s' failed (%s); metrics are no "
                         "longer recorded\n", path_.c_str(), std::strerror(errno));
    std::fclose(file_);
    file_ = nullptr;
  }
}

void JsonlMetrics::on_step(const StepMetrics& m) { write_line(to_json(m)); }
void JsonlMetrics::on_epoch(const EpochMetrics& m) { write_line(to_json(m)); }
void JsonlMetrics::on_event(const MonitorEvent& e) { write_line(to_json(e)); }
void JsonlMetrics::on_ranks(const RanksRecord& r) { write_line(to_json(r)); }

}  // namespace locus::train
