// Whether a checkpoint can continue a run: what refuses it (another model, optimizer, global
// batch, dataset, or a mid-epoch position whose remaining order would change) and what is
// only noted (config lines, schedule horizon, dataset path, resharding).
#include <fmt/format.h>

#include <filesystem>
#include <map>
#include <sstream>

#include "checkpoint/checkpointer_impl.hpp"
#include "locus/comm/agree.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"

namespace locus::train {

namespace {

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : sep) + s;
  return out;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

// "section.key" -> value of an INI text (comments and blank lines ignored).
std::map<std::string, std::string> ini_values(const std::string& text) {
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line, section;
  while (std::getline(in, line)) {
    line = trim(line);
    if (line.empty() || line[0] == '#' || line[0] == ';') continue;
    if (line.front() == '[' && line.back() == ']') {
      section = trim(line.substr(1, line.size() - 2));
      continue;
    }
    const auto eq = line.find('=');
    if (eq == std::string::npos) continue;
    out[(section.empty() ? "" : section + ".") + trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  return out;
}

bool mid_epoch(const CheckpointMeta& m) {
  return m.step_in_epoch > 0 && m.step_in_epoch < m.steps_per_epoch;
}

}  // namespace

std::string resume_conflicts(const CheckpointMeta& m, const Trainer& trainer,
                             const DatasetIdentity& dataset) {
  const TrainOptions& o = trainer.options();
  std::vector<std::string> why;
  if (m.model.widths != o.model.widths || m.model.activation != o.model.activation) {
    why.push_back(fmt::format("the model differs: the checkpoint holds {} {}, this run trains "
                              "{} {} (set model.widths and model.activation to the "
                              "checkpoint's)",
                              format_widths(m.model.widths), to_string(m.model.activation),
                              format_widths(o.model.widths), to_string(o.model.activation)));
  }
  if (m.optimizer != to_string(o.optimizer.kind)) {
    why.push_back(fmt::format("optim.optimizer is {} in the checkpoint and {} here (its state "
                              "only fits {})", m.optimizer, to_string(o.optimizer.kind),
                              m.optimizer));
  }
  if (m.global_batch != o.data.global_batch) {
    why.push_back(fmt::format(
        "train.batch is {} in the checkpoint and {} here (the global batch does not depend on "
        "the rank count, and the step counters, the schedule and the data position are in its "
        "units: set train.batch = {})", m.global_batch, o.data.global_batch, m.global_batch));
  }
  if (m.dataset.rows != dataset.rows || m.dataset.cols != dataset.cols ||
      m.dataset.fingerprint != dataset.fingerprint) {
    why.push_back(fmt::format(
        "the training data differs: the checkpoint was trained on '{}' ({} rows x {} features, "
        "fingerprint {}), this run reads '{}' ({} rows x {} features, fingerprint {}) (train on "
        "the same dataset)", m.dataset.path, m.dataset.rows, m.dataset.cols,
        m.dataset.fingerprint, dataset.path, dataset.rows, dataset.cols, dataset.fingerprint));
  } else if (m.steps_per_epoch != trainer.steps_per_epoch()) {
    why.push_back(fmt::format("an epoch has {} steps in the checkpoint and {} here (set "
                              "loader.drop_last as the checkpoint's run did)",
                              m.steps_per_epoch, trainer.steps_per_epoch()));
  }
  if (mid_epoch(m)) {
    const std::string shuffle = to_string(o.data.shuffle);
    if (m.shuffle != shuffle || m.loader_seed != static_cast<std::int64_t>(o.data.seed)) {
      why.push_back(fmt::format(
          "the checkpoint is in the middle of epoch {} (step {} of {}) with loader.shuffle = {}, "
          "loader.seed = {}; this run has {} and {}, so the rest of the epoch would repeat and "
          "skip samples (keep the checkpoint's shuffle and seed, or resume from an epoch-end "
          "checkpoint)", m.epoch, m.step_in_epoch, m.steps_per_epoch, m.shuffle, m.loader_seed,
          shuffle, o.data.seed));
    } else if (m.shuffle != "global" && m.data_parallel != trainer.grid().data_parallel()) {
      why.push_back(fmt::format(
          "the checkpoint is in the middle of epoch {} (step {} of {}) and was written by {} "
          "data-parallel ranks with loader.shuffle = {}, whose order depends on the rank count: "
          "on {} ranks the rest of the epoch would repeat and skip samples (resume on {} "
          "data-parallel ranks, or from an epoch-end checkpoint, or train with loader.shuffle = "
          "global)", m.epoch, m.step_in_epoch, m.steps_per_epoch, m.data_parallel, m.shuffle,
          trainer.grid().data_parallel(), m.data_parallel));
    }
  }
  if (why.empty()) return "";
  return fmt::format("the checkpoint cannot continue this run: {}. To train from scratch "
                     "instead, pass --resume=none (or use another checkpoint.dir)",
                     join(why, "; "));
}

std::vector<std::string> resume_notes(const CheckpointMeta& m, const Trainer& trainer,
                                      const std::string& config,
                                      const DatasetIdentity& dataset) {
  std::vector<std::string> notes;
  if (m.data_parallel != trainer.grid().data_parallel()) {
    notes.push_back(fmt::format("resharding: written by {} data-parallel ranks, continuing on "
                                "{}; the data position (epoch {}, sample {} of the epoch) is "
                                "kept", m.data_parallel, trainer.grid().data_parallel(),
                                m.epoch, m.samples_in_epoch));
  }
  if (m.dataset.path != dataset.path) {
    notes.push_back(fmt::format("the training set moved: '{}' then, '{}' now (same data)",
                                m.dataset.path, dataset.path));
  }
  const std::string compute = trainer.compute_description();
  if (!m.compute.empty() && m.compute != compute) {
    notes.push_back(fmt::format("written by {}, continuing on {}: the run goes on, but it is "
                                "bitwise equal to an uninterrupted one only on the same backend, "
                                "precision, device kind and library versions",
                                m.compute, compute));
  }
  if (m.total_steps != trainer.options().schedule.total_steps) {
    notes.push_back(fmt::format("the schedule's horizon changed from {} to {} steps",
                                m.total_steps, trainer.options().schedule.total_steps));
  }
  if (!config.empty()) {
    const auto then = ini_values(m.config), now = ini_values(config);
    for (const auto& [key, value] : now) {
      if (key == "checkpoint.resume") continue;
      const auto it = then.find(key);
      if (it == then.end()) continue;
      if (it->second != value) {
        notes.push_back(fmt::format("config {} = {} (was {})", key, value, it->second));
      }
    }
  }
  return notes;
}

namespace {

// Collective over comm: the candidates of --resume=auto in the order they are tried: the
// pointer's checkpoint first, then every other checkpoint of the directory, newest first
// (rank 0 lists; every rank gets its list).
std::vector<std::string> auto_candidates(const mpi::Comm& comm, const std::string& dir,
                                         LatestPointer& pointer) {
  std::string text;
  if (comm.is_root()) {
    pointer = read_latest(dir);
    text = fmt::format("{}\n{}\n", pointer.present ? pointer.run_id : "", pointer.file);
    for (const CheckpointEntry& e : list_checkpoints(dir)) {
      if (e.name != pointer.file) text += e.name + "\n";
    }
  }
  text = comm.bcast(text);
  std::istringstream in(text);
  std::string line;
  std::getline(in, pointer.run_id);
  std::getline(in, pointer.file);
  pointer.present = !pointer.run_id.empty();
  std::vector<std::string> out;
  if (!pointer.file.empty()) out.push_back(pointer.file);
  while (std::getline(in, line)) out.push_back(line);
  for (auto& name : out) name = (std::filesystem::path(dir) / name).string();
  return out;
}

}  // namespace

ResumeResult Checkpointer::resume(const std::string& how) {
  Impl& m = *impl_;
  ResumeResult res;
  auto adopt = [&](const std::string& path, const CheckpointMeta& meta) {
    res.resumed = true;
    res.path = path;
    res.meta = meta;
    res.notes = resume_notes(meta, m.trainer, m.config, m.dataset);
    m.trainer.restore_metrics(meta.has_metrics ? meta.metrics : MetricsProgress{});
    m.trainer.restore_anomaly(meta.has_anomaly ? meta.anomaly : AnomalyState{});
    if (!meta.has_anomaly && meta.step > 0) {
      res.notes.push_back(fmt::format(
          "{} has no anomaly detector state (written by an older locus): the detector starts "
          "with an empty window of train.anomaly_window steps",
          std::filesystem::path(path).filename().string()));
    }
    if (!meta.has_metrics && meta.step_in_epoch > 0 && meta.step_in_epoch < meta.steps_per_epoch) {
      res.notes.push_back(fmt::format(
          "{} has no metrics sums (written by an older locus): the metrics line of epoch {} "
          "covers only its steps after step {}, and the first step line after the resume only "
          "the steps since then; later lines are those of an uninterrupted run",
          std::filesystem::path(path).filename().string(), meta.epoch + 1, meta.step));
    }
    m.run_id = meta.run_id;
    m.last_step = meta.step;
    m.retire.clear();
    if (m.enabled() && m.comm.is_root()) {
      for (const CheckpointEntry& e : list_checkpoints(m.opts.dir)) {
        if (e.step > meta.step) m.retire.push_back(e.name);
      }
    }
    m.last_time = CheckpointClock::now();
  };
  // Refuses (agreed) a checkpoint that cannot continue this run.
  auto check = [&](const CheckpointMeta& meta, const std::string& path) {
    mpi::agree_on(m.comm, [&] {
      const std::string why = resume_conflicts(meta, m.trainer, m.dataset);
      if (!why.empty()) throw ConfigError(fmt::format("resuming from '{}': {}", path, why));
    });
  };
  auto new_run = [&] {
    m.trainer.restore_metrics({});
    m.trainer.restore_anomaly({});
    m.run_id = new_run_id(m.comm);
    if (!m.enabled()) return;
    mpi::agree_on(m.comm, [&] {
      if (m.comm.is_root()) write_latest(m.opts.dir, {true, m.run_id, ""});
    });
  };
  if (how.empty() || how == "none") {
    if (m.enabled()) {
      const std::int64_t old = static_cast<std::int64_t>(list_checkpoints(m.opts.dir).size());
      if (old > 0) {
        m.say(fmt::format("checkpoint.dir {} holds {} checkpoint(s) of an earlier run: this "
                          "run starts from scratch (--resume=none) and retires them at its "
                          "first checkpoint; pass --resume=auto to continue that run instead",
                          m.opts.dir, old));
      }
    }
    new_run();
    return res;
  }
  if (how != "auto") {
    const CheckpointMeta meta = read_checkpoint_meta(m.comm, how);
    check(meta, how);
    load_checkpoint(m.comm, how, m.trainer.state());
    adopt(how, meta);
    return res;
  }
  if (!m.enabled()) {
    m.say("--resume=auto: no checkpoint.dir is set, so there is nothing to resume; starting "
          "from scratch");
    new_run();
    return res;
  }
  LatestPointer pointer;
  for (const std::string& path : auto_candidates(m.comm, m.opts.dir, pointer)) {
    const std::string name = std::filesystem::path(path).filename().string();
    CheckpointMeta meta;
    try {
      meta = read_checkpoint_meta(m.comm, path);
    } catch (const Error& e) {
      if (!e.agreed()) throw;
      res.skipped.push_back(fmt::format("{}: {}", name, e.what()));
      continue;
    }
    if (pointer.present && meta.run_id != pointer.run_id) {
      res.skipped.push_back(fmt::format("{}: belongs to run {}, not to the latest run {}",
                                        name, meta.run_id, pointer.run_id));
      continue;
    }
    check(meta, path);
    try {
      load_checkpoint(m.comm, path, m.trainer.state());
    } catch (const DataError& e) {
      if (!e.agreed()) throw;
      reset_state(m.trainer.state());
      res.skipped.push_back(fmt::format("{}: {}", name, e.what()));
      continue;
    }
    adopt(path, meta);
    break;
  }
  for (const auto& s : res.skipped) m.say("resume: skipped " + s);
  if (!res.resumed) {
    m.say(fmt::format("resume: no usable checkpoint in {}; starting from scratch", m.opts.dir));
    new_run();
  }
  return res;
}

}  // namespace locus::train
