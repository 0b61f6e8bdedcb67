// Checkpoint metadata: the root attributes and their canonical text (guarded by meta_crc32),
// digests and fingerprints, and the identity of a training set.
#include <zlib.h>

#include <fmt/format.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <mutex>
#include <tuple>

#include "checkpoint/checkpoint_detail.hpp"
#include "locus/comm/agree.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "locus/train/data/loader.hpp"
#include "locus/train/model/model_file.hpp"

namespace locus::train {

namespace detail {

std::vector<TensorSlot> tensor_slots(const ParamLayout& layout,
                                     const std::vector<std::string>& state_names) {
  std::vector<TensorSlot> out;
  const std::vector<TensorInfo> tensors = layout.tensors();
  for (const TensorInfo& t : tensors) out.push_back({"/model/" + t.name, t, -1});
  for (std::size_t s = 0; s < state_names.size(); ++s) {
    for (const TensorInfo& t : tensors) {
      out.push_back({fmt::format("/optimizer/{}/{}", state_names[s], t.name), t,
                     static_cast<int>(s)});
    }
  }
  return out;
}

std::uint32_t crc32_of(std::span<const std::byte> bytes) {
  uLong crc = ::crc32_z(0L, Z_NULL, 0);
  if (!bytes.empty()) {
    crc = ::crc32_z(crc, reinterpret_cast<const Bytef*>(bytes.data()), bytes.size());
  }
  return static_cast<std::uint32_t>(crc);
}

std::uint64_t fnv1a(std::string_view bytes, std::uint64_t h) {
  for (const char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

std::string hex64(std::uint64_t v) { return fmt::format("{:016x}", v); }

}  // namespace detail

namespace {

using detail::fnv1a;

template <class T>
std::string_view bytes_of(const std::vector<T>& v) {
  return {reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T)};
}

}  // namespace

std::string meta_text(const CheckpointMeta& m) {
  std::string t;
  auto line = [&t](std::string_view key, const auto& value) {
    t += fmt::format("{}={}\n", key, value);
  };
  line("format_version", m.format_version);
  line("run_id", m.run_id);
  line("step", m.step);
  line("epoch", m.epoch);
  line("step_in_epoch", m.step_in_epoch);
  line("samples_in_epoch", m.samples_in_epoch);
  line("samples_seen", m.samples_seen);
  line("steps_per_epoch", m.steps_per_epoch);
  line("optimizer_steps", m.optimizer_steps);
  line("optimizer", m.optimizer);
  line("schedule", m.schedule);
  line("base_lr", m.base_lr);
  line("warmup_steps", m.warmup_steps);
  line("total_steps", m.total_steps);
  line("lr", m.lr);
  line("global_batch", m.global_batch);
  line("shuffle", m.shuffle);
  line("loader_seed", m.loader_seed);
  line("drop_last", m.drop_last ? 1 : 0);
  line("dataset", m.dataset.path);
  line("dataset_rows", m.dataset.rows);
  line("dataset_cols", m.dataset.cols);
  line("dataset_fingerprint", m.dataset.fingerprint);
  line("config_hash", m.config_hash);
  line("config_crc32", detail::crc32_of(std::as_bytes(std::span(m.config.data(), m.config.size()))));
  line("world_size", m.world_size);
  line("data_parallel", m.data_parallel);
  line("pipeline_stages", m.pipeline_stages);
  line("tool_version", m.tool_version);
  line("git_revision", m.git_revision);
  if (!m.compute.empty()) line("compute", m.compute);
  line("created", m.created);
  if (m.has_metrics) {
    const MetricsProgress& p = m.metrics;
    for (const auto& [name, sums, times] :
         {std::tuple{"epoch", &p.epoch, &p.epoch_time},
          std::tuple{"interval", &p.interval, &p.interval_time}}) {
      line(fmt::format("metrics_{}_loss", name), fmt::format("{}", fmt::join(sums->loss.limbs(), ",")));
      line(fmt::format("metrics_{}_loss_other", name), sums->loss.other());
      line(fmt::format("metrics_{}_correct", name), sums->correct);
      line(fmt::format("metrics_{}_rows", name), sums->rows);
      line(fmt::format("metrics_{}_times", name),
           fmt::format("{},{},{},{}", times->seconds, times->allreduce_s,
                       times->allreduce_blocked_s, times->data_wait_s));
    }
    line("metrics_interval_steps", p.interval_steps);
  }
  if (m.has_anomaly) {
    const AnomalyState& a = m.anomaly;
    line("anomaly_counts", fmt::format("{},{},{},{}", a.anomalies, a.skipped,
                                       a.consecutive_skips, a.loss.size()));
    if (!a.loss.empty()) {
      line("anomaly_window", fmt::format("{},{}", fmt::join(a.loss, ","),
                                         fmt::join(a.grad_norm, ",")));
    }
  }
  line("widths", format_widths(m.model.widths));
  line("activation", to_string(m.model.activation));
  line("init", to_string(m.model.init));
  line("dropout", static_cast<double>(m.model.dropout));
  line("seed", m.model.seed);
  line("loss", to_string(m.loss));
  // As /model's num_classes attribute is written (write_model_attributes): a cross-entropy
  // model trained on a set without num_classes (0: a plain HDF5 file, an ingest with
  // num_classes = 0) records its output width. The digest covered the raw 0 before, so every
  // such checkpoint failed verification and --resume=auto skipped it.
  line("num_classes", m.loss == Loss::softmax_cross_entropy && m.num_classes == 0 &&
                              !m.model.widths.empty()
                          ? static_cast<std::int64_t>(m.model.widths.back())
                          : m.num_classes);
  return t;
}

namespace detail {

namespace {

// The metrics_* root attributes (docs/FORMATS.md): per part (epoch, interval) the exact loss
// sum's limbs and its inexact rest, the hits and rows, and the times.
void write_metrics(hid_t root, const MetricsProgress& p) {
  for (const auto& [name, sums, times] : {std::tuple{"epoch", &p.epoch, &p.epoch_time},
                                          std::tuple{"interval", &p.interval, &p.interval_time}}) {
    const std::string k = fmt::format("metrics_{}_", name);
    const auto& limbs = sums->loss.limbs();
    h5::write_attr(root, k + "loss", std::vector<std::int64_t>(limbs.begin(), limbs.end()));
    h5::write_attr(root, k + "loss_other", sums->loss.other());
    h5::write_attr(root, k + "correct", sums->correct);
    h5::write_attr(root, k + "rows", sums->rows);
    h5::write_attr(root, k + "times",
                   std::vector<double>{times->seconds, times->allreduce_s,
                                       times->allreduce_blocked_s, times->data_wait_s});
  }
  h5::write_attr(root, "metrics_interval_steps", p.interval_steps);
}

MetricsProgress read_metrics(hid_t root, const std::string& path) {
  MetricsProgress p;
  for (const auto& [name, sums, times] : {std::tuple{"epoch", &p.epoch, &p.epoch_time},
                                          std::tuple{"interval", &p.interval, &p.interval_time}}) {
    const std::string k = fmt::format("metrics_{}_", name);
    const auto limbs = h5::read_attr<std::vector<std::int64_t>>(root, k + "loss");
    const auto t = h5::read_attr<std::vector<double>>(root, k + "times");
    if (limbs.size() != ExactSum::kLimbs || t.size() != 4) {
      throw DataError(fmt::format("checkpoint '{}': {}loss has {} values (expected {}) and "
                                  "{}times {} (expected 4): the file is damaged; use an older "
                                  "checkpoint", path, k, limbs.size(), ExactSum::kLimbs, k,
                                  t.size()));
    }
    std::array<std::int64_t, ExactSum::kLimbs> a{};
    std::copy(limbs.begin(), limbs.end(), a.begin());
    try {
      sums->loss = ExactSum::from_parts(a, h5::read_attr<double>(root, k + "loss_other"));
    } catch (const DataError& e) {
      throw DataError(fmt::format("checkpoint '{}': {}loss: {}; use an older checkpoint", path,
                                  k, e.what()));
    }
    sums->correct = h5::read_attr<std::int64_t>(root, k + "correct");
    sums->rows = h5::read_attr<std::int64_t>(root, k + "rows");
    *times = {t[0], t[1], t[2], t[3]};
  }
  p.interval_steps = h5::read_attr<std::int64_t>(root, "metrics_interval_steps");
  return p;
}

// The anomaly_* root attributes (docs/FORMATS.md): counts, and the window's values (loss, then
// gradient norm, oldest first) when it holds any.
void write_anomaly(hid_t root, const AnomalyState& a) {
  h5::write_attr(root, "anomaly_counts",
                 std::vector<std::int64_t>{a.anomalies, a.skipped, a.consecutive_skips,
                                           static_cast<std::int64_t>(a.loss.size())});
  if (a.loss.empty()) return;
  std::vector<double> w = a.loss;
  w.insert(w.end(), a.grad_norm.begin(), a.grad_norm.end());
  h5::write_attr(root, "anomaly_window", w);
}

AnomalyState read_anomaly(hid_t root, const std::string& path) {
  const auto c = h5::read_attr<std::vector<std::int64_t>>(root, "anomaly_counts");
  const auto n = c.size() == 4 ? c[3] : -1;
  std::vector<double> w;
  if (n > 0) w = h5::read_attr<std::vector<double>>(root, "anomaly_window");
  if (n < 0 || c[0] < 0 || c[1] < 0 || c[2] < 0 || w.size() != static_cast<std::size_t>(2 * n)) {
    throw DataError(fmt::format("checkpoint '{}': anomaly_counts has {} values (expected 4: "
                                "anomalies, skipped, consecutive skips, window length) and "
                                "anomaly_window {} (expected twice the window length): the file "
                                "is damaged; use an older checkpoint", path, c.size(), w.size()));
  }
  AnomalyState a;
  a.anomalies = c[0];
  a.skipped = c[1];
  a.consecutive_skips = c[2];
  a.loss.assign(w.begin(), w.begin() + n);
  a.grad_norm.assign(w.begin() + n, w.end());
  return a;
}

}  // namespace

// Collective over the file's communicator: the root attributes of `m` (not the /model ones).
void write_meta(hid_t root, const CheckpointMeta& m) {
  h5::write_attr(root, "locus_format", kCheckpointFormat);
  h5::write_attr(root, "format_version", m.format_version);
  h5::write_attr(root, "run_id", m.run_id);
  h5::write_attr(root, "step", m.step);
  h5::write_attr(root, "epoch", m.epoch);
  h5::write_attr(root, "step_in_epoch", m.step_in_epoch);
  h5::write_attr(root, "samples_in_epoch", m.samples_in_epoch);
  h5::write_attr(root, "samples_seen", m.samples_seen);
  h5::write_attr(root, "steps_per_epoch", m.steps_per_epoch);
  h5::write_attr(root, "optimizer_steps", m.optimizer_steps);
  h5::write_attr(root, "optimizer", m.optimizer);
  h5::write_attr(root, "schedule", m.schedule);
  h5::write_attr(root, "base_lr", m.base_lr);
  h5::write_attr(root, "warmup_steps", m.warmup_steps);
  h5::write_attr(root, "total_steps", m.total_steps);
  h5::write_attr(root, "lr", m.lr);
  h5::write_attr(root, "global_batch", m.global_batch);
  h5::write_attr(root, "shuffle", m.shuffle);
  h5::write_attr(root, "loader_seed", m.loader_seed);
  h5::write_attr(root, "drop_last", static_cast<std::int64_t>(m.drop_last));
  h5::write_attr(root, "dataset", m.dataset.path);
  h5::write_attr(root, "dataset_rows", m.dataset.rows);
  h5::write_attr(root, "dataset_cols", m.dataset.cols);
  h5::write_attr(root, "dataset_fingerprint", m.dataset.fingerprint);
  h5::write_attr(root, "config", m.config);
  h5::write_attr(root, "config_hash", m.config_hash);
  h5::write_attr(root, "world_size", m.world_size);
  h5::write_attr(root, "data_parallel", m.data_parallel);
  h5::write_attr(root, "pipeline_stages", m.pipeline_stages);
  h5::write_attr(root, "tool_version", m.tool_version);
  h5::write_attr(root, "git_revision", m.git_revision);
  if (!m.compute.empty()) h5::write_attr(root, "compute", m.compute);
  h5::write_attr(root, "created", m.created);
  if (m.has_metrics) write_metrics(root, m.metrics);
  if (m.has_anomaly) write_anomaly(root, m.anomaly);
  h5::write_attr(root, "digest", "crc32");
  // Written last: a reader that finds it knows every other attribute was written.
  const std::string text = meta_text(m);
  h5::write_attr(root, "meta_crc32",
                 static_cast<std::int64_t>(crc32_of(std::as_bytes(std::span(text.data(), text.size())))));
}

// Local: the metadata of an open checkpoint (root and /model attributes). DataError naming
// the file for anything missing, malformed or newer than this build reads.
CheckpointMeta read_meta(h5::File& file) {
  const hid_t root = file.id();
  const std::string& path = file.path();
  if (!h5::has_attr(root, "locus_format") ||
      h5::read_attr<std::string>(root, "locus_format") != kCheckpointFormat) {
    throw DataError(fmt::format("'{}' is not a locus checkpoint (its locus_format attribute is "
                                "not \"{}\"); see docs/FORMATS.md, \"Checkpoint files\"",
                                path, kCheckpointFormat));
  }
  CheckpointMeta m;
  m.format_version = h5::read_attr<std::int64_t>(root, "format_version");
  if (m.format_version > kCheckpointFormatVersion || m.format_version < 1) {
    throw DataError(fmt::format("checkpoint '{}' has format_version {}; this locus reads 1 to {}: "
                                "resume it with a newer locus, or start over with --resume=none",
                                path, m.format_version, kCheckpointFormatVersion));
  }
  if (!h5::has_attr(root, "meta_crc32")) {
    throw DataError(fmt::format("checkpoint '{}' has no meta_crc32 attribute: it was not "
                                "completely written; use an older checkpoint", path));
  }
  auto i64 = [&](const char* k) { return h5::read_attr<std::int64_t>(root, k); };
  auto str = [&](const char* k) { return h5::read_attr<std::string>(root, k); };
  auto dbl = [&](const char* k) { return h5::read_attr<double>(root, k); };
  m.run_id = str("run_id");
  m.step = i64("step");
  m.epoch = i64("epoch");
  m.step_in_epoch = i64("step_in_epoch");
  m.samples_in_epoch = i64("samples_in_epoch");
  m.samples_seen = i64("samples_seen");
  m.steps_per_epoch = i64("steps_per_epoch");
  m.optimizer_steps = i64("optimizer_steps");
  m.optimizer = str("optimizer");
  m.schedule = str("schedule");
  m.base_lr = dbl("base_lr");
  m.warmup_steps = i64("warmup_steps");
  m.total_steps = i64("total_steps");
  m.lr = dbl("lr");
  m.global_batch = i64("global_batch");
  m.shuffle = str("shuffle");
  m.loader_seed = i64("loader_seed");
  m.drop_last = i64("drop_last") != 0;
  m.dataset.path = str("dataset");
  m.dataset.rows = i64("dataset_rows");
  m.dataset.cols = i64("dataset_cols");
  m.dataset.fingerprint = str("dataset_fingerprint");
  m.config = str("config");
  m.config_hash = str("config_hash");
  m.world_size = i64("world_size");
  m.data_parallel = i64("data_parallel");
  m.pipeline_stages = i64("pipeline_stages");
  m.tool_version = str("tool_version");
  m.git_revision = str("git_revision");
  if (h5::has_attr(root, "compute")) m.compute = str("compute");
  m.created = dbl("created");
  m.has_metrics = h5::has_attr(root, "metrics_interval_steps");
  if (m.has_metrics) m.metrics = read_metrics(root, path);
  m.has_anomaly = h5::has_attr(root, "anomaly_counts");
  if (m.has_anomaly) m.anomaly = read_anomaly(root, path);
  if (!h5::exists(root, "/model")) {
    throw DataError(fmt::format("checkpoint '{}' has no /model group: it is incomplete or "
                                "corrupt; use an older checkpoint", path));
  }
  h5::Id g = h5::open_group(root, "/model");
  const std::int64_t model_version = h5::has_attr(g.get(), "schema_version")
                                         ? h5::read_attr<std::int64_t>(g.get(), "schema_version")
                                         : 0;
  if (model_version > kModelSchemaVersion || model_version < 1) {
    throw DataError(fmt::format("checkpoint '{}': /model has schema_version {}; this locus reads "
                                "1 to {}: resume it with a newer locus, or start over with "
                                "--resume=none",
                                path, model_version, kModelSchemaVersion));
  }
  for (std::int64_t w : h5::read_attr<std::vector<std::int64_t>>(g.get(), "widths")) {
    m.model.widths.push_back(static_cast<int>(w));
  }
  try {
    m.model.activation = parse_activation(h5::read_attr<std::string>(g.get(), "activation"));
    m.model.init = parse_init(h5::read_attr<std::string>(g.get(), "init"));
    m.loss = parse_loss(h5::read_attr<std::string>(g.get(), "loss"));
    validate(m.model);
  } catch (const ConfigError& e) {
    throw DataError(fmt::format("checkpoint '{}': /model attributes are invalid: {}", path,
                                e.what()));
  }
  m.model.dropout = static_cast<float>(h5::read_attr<double>(g.get(), "dropout"));
  m.model.seed = static_cast<std::uint64_t>(h5::read_attr<std::int64_t>(g.get(), "seed"));
  m.num_classes = h5::read_attr<std::int64_t>(g.get(), "num_classes");
  if (h5::exists(root, "/optimizer")) {
    h5::Id o = h5::open_group(root, "/optimizer");
    if (h5::has_attr(o.get(), "state_names")) {
      const auto names = h5::read_attr<std::string>(o.get(), "state_names");
      for (std::size_t b = 0; b < names.size();) {
        const std::size_t e = std::min(names.find(',', b), names.size());
        m.optimizer_state.push_back(names.substr(b, e - b));
        b = e + 1;
      }
    }
  }
  const std::string text = meta_text(m);
  const auto stored = static_cast<std::uint32_t>(i64("meta_crc32"));
  const std::uint32_t computed = crc32_of(std::as_bytes(std::span(text.data(), text.size())));
  // Checkpoints of earlier versions digested num_classes = 0 where /model records the width.
  const auto legacy = [&] {
    if (m.loss != Loss::softmax_cross_entropy || m.model.widths.empty() ||
        m.num_classes != m.model.widths.back()) {
      return false;
    }
    std::string old = text;
    const std::string now = fmt::format("\nnum_classes={}\n", m.num_classes);
    const auto at = old.rfind(now);
    if (at == std::string::npos) return false;
    old.replace(at, now.size(), "\nnum_classes=0\n");
    return crc32_of(std::as_bytes(std::span(old.data(), old.size()))) == stored;
  };
  if (stored != computed && !legacy()) {
    throw DataError(fmt::format("checkpoint '{}': its attributes do not match their digest "
                                "(meta_crc32 {:08x}, computed {:08x}): the file is damaged; use "
                                "an older checkpoint", path, stored, computed));
  }
  return m;
}

}  // namespace detail

CheckpointMeta read_checkpoint_meta(const mpi::Comm& comm, const std::string& path) {
  std::lock_guard lock(hdf5_mutex());
  h5::File file = h5::File::open(comm, path, h5::File::Mode::read);
  CheckpointMeta m;
  mpi::agree_on(file.comm(), [&] { m = detail::read_meta(file); });
  mpi::agree_on(file.comm(), [&] { file.close(); });
  return m;
}

DatasetIdentity dataset_identity(const mpi::Comm& comm, const std::string& path) {
  std::lock_guard lock(hdf5_mutex());
  DatasetIdentity id;
  id.path = path;
  h5::File file = h5::File::open(comm, path, h5::File::Mode::read);
  mpi::agree_on(file.comm(), [&] {
    const hid_t root = file.id();
    h5::Dataset features = h5::Dataset::open(file, "/features");
    id.cols = static_cast<std::int64_t>(features.row_width());
    id.rows = h5::has_attr(root, "committed_rows")
                  ? h5::read_attr<std::int64_t>(root, "committed_rows")
                  : static_cast<std::int64_t>(features.rows());
    std::uint64_t h = fnv1a(fmt::format("rows={} cols={}", id.rows, id.cols));
    for (const char* a : {"source_crc32", "source_bytes"}) {
      if (h5::has_attr(root, a)) h = fnv1a(bytes_of(h5::read_attr<std::vector<std::int64_t>>(root, a)), h);
    }
    if (h5::has_attr(features.id(), "mean")) {
      h = fnv1a(bytes_of(h5::read_attr<std::vector<double>>(features.id(), "mean")), h);
    }
    id.fingerprint = detail::hex64(h);
  });
  mpi::agree_on(file.comm(), [&] { file.close(); });
  return id;
}

}  // namespace locus::train
