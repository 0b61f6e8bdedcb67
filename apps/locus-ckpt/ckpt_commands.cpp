// locus-ckpt's commands over lib/train's checkpoint readers; rank 0 prints.
#include "ckpt_commands.hpp"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "locus/comm/agree.hpp"
#include "locus/comm/app.hpp"
#include "locus/train/checkpoint/checkpoint.hpp"
#include "locus/train/model/model_file.hpp"

namespace locus::app {

namespace fs = std::filesystem;

namespace {

void out(const mpi::Comm& world, const std::string& text) {
  if (!world.is_root()) return;
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

std::string size_text(std::uint64_t bytes) {
  if (bytes >= (1ull << 30)) return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1 << 30));
  if (bytes >= (1ull << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20));
  return fmt::format("{:.1f} KiB", static_cast<double>(bytes) / 1024);
}

std::string shape_text(const std::vector<std::uint64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Collective: the checkpoints named by paths (directories expand to their checkpoints),
// listed by rank 0 and broadcast. A missing path is a DataError.
std::vector<std::string> expand(const mpi::Comm& world, const std::vector<std::string>& paths) {
  std::string joined;
  mpi::agree_on(world, [&] {
    if (!world.is_root()) return;
    for (const auto& p : paths) {
      std::error_code ec;
      if (fs::is_directory(p, ec)) {
        const auto entries = train::list_checkpoints(p);
        if (entries.empty()) {
          throw DataError(fmt::format("'{}' holds no checkpoints (ckpt-<step>.h5)", p));
        }
        for (const auto& e : entries) joined += e.path + "\n";
      } else if (fs::exists(p, ec)) {
        joined += p + "\n";
      } else {
        throw DataError(fmt::format("'{}' does not exist: give a checkpoint file or directory", p));
      }
    }
  });
  joined = world.bcast(joined);
  std::vector<std::string> files;
  std::istringstream in(joined);
  for (std::string line; std::getline(in, line);) files.push_back(line);
  return files;
}

}  // namespace

int ckpt_list(const mpi::Comm& world, const std::string& dir) {
  mpi::agree_on(world, [&] {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) {
      throw DataError(fmt::format("'{}' is not a directory: give a checkpoint.dir", dir));
    }
  });
  std::string pointer_text;
  if (world.is_root()) {
    const train::LatestPointer p = train::read_latest(dir);
    pointer_text = p.present ? fmt::format("{}\n{}", p.run_id, p.file) : "\n";
  }
  pointer_text = world.bcast(pointer_text);
  const std::string latest_file = pointer_text.substr(pointer_text.find('\n') + 1);
  const std::string latest_run = pointer_text.substr(0, pointer_text.find('\n'));
  std::vector<std::string> files;
  std::string listed;
  if (world.is_root()) {
    for (const auto& e : train::list_checkpoints(dir)) listed += e.path + "\n";
  }
  listed = world.bcast(listed);
  std::istringstream in(listed);
  for (std::string line; std::getline(in, line);) files.push_back(line);
  out(world, fmt::format("{}: {} checkpoint(s); latest run {} -> {}\n", dir, files.size(),
                         latest_run.empty() ? "(none)" : latest_run,
                         latest_file.empty() ? "(none)" : latest_file));
  out(world, fmt::format("  {:<20} {:>9} {:>6} {:<16} {:>10}  {}\n", "file", "step", "epoch",
                         "run", "size", "status"));
  for (const auto& f : files) {
    const train::VerifyReport r = train::verify_checkpoint(world, f);
    const std::string name = fs::path(f).filename().string();
    out(world, fmt::format("{} {:<20} {:>9} {:>6} {:<16} {:>10}  {}\n",
                           name == latest_file ? "*" : " ", name,
                           r.meta_valid ? std::to_string(r.meta.step) : "?",
                           r.meta_valid ? std::to_string(r.meta.epoch) : "?",
                           r.meta_valid ? r.meta.run_id : "?", size_text(r.file_bytes),
                           r.ok ? "ok" : "DAMAGED: " + r.problem));
  }
  return exit_code::ok;
}

int ckpt_verify(const mpi::Comm& world, const std::vector<std::string>& paths) {
  const std::vector<std::string> files = expand(world, paths);
  int bad = 0;
  for (const auto& f : files) {
    const train::VerifyReport r = train::verify_checkpoint(world, f);
    if (r.ok) {
      out(world, fmt::format("ok       {} (step {}, {} tensors, {})\n", f, r.meta.step,
                             r.tensors.size(), size_text(r.file_bytes)));
    } else {
      ++bad;
      out(world, fmt::format("DAMAGED  {}: {}\n", f, r.problem));
    }
  }
  if (bad > 0) {
    DataError e(fmt::format("{} of {} checkpoint(s) failed verification (see above); "
                            "--resume=auto skips them", bad, files.size()));
    e.mark_agreed();
    throw e;
  }
  return exit_code::ok;
}

int ckpt_inspect(const mpi::Comm& world, const std::string& path) {
  const std::vector<std::string> files = expand(world, {path});
  const train::VerifyReport r = train::verify_checkpoint(world, files[0]);
  if (!r.meta_valid) {
    DataError e(fmt::format("cannot read '{}': {}", files[0], r.problem));
    e.mark_agreed();
    throw e;
  }
  out(world, fmt::format("{} ({})\n", files[0], size_text(r.file_bytes)));
  std::istringstream meta(train::meta_text(r.meta));
  for (std::string line; std::getline(meta, line);) {
    const auto eq = line.find('=');
    out(world, fmt::format("  {:<20} {}\n", line.substr(0, eq), line.substr(eq + 1)));
  }
  out(world, "tensors:\n");
  for (const auto& t : r.tensors) {
    out(world, fmt::format("  {:<44} {:<14} crc32 {:08x} {}\n", t.name, shape_text(t.shape),
                           t.stored_crc,
                           t.ok() ? std::string("ok")
                           : t.stored_crc != t.computed_crc
                               ? fmt::format("(computed {:08x}: DAMAGED)", t.computed_crc)
                               : fmt::format("({} NaN/Inf: REFUSED)", t.nonfinite)));
  }
  out(world, r.ok ? "verification: ok\n" : fmt::format("verification: FAILED: {}\n", r.problem));
  out(world, "config:\n" + r.meta.config);
  return r.ok ? exit_code::ok : exit_code::data;
}

int ckpt_export(const mpi::Comm& world, const std::string& checkpoint, const std::string& path) {
  train::CheckpointMeta meta;
  const train::TrainState state = train::load_checkpoint_state(world, checkpoint, &meta);
  train::ModelInfo info;
  info.spec = meta.model;
  info.loss = meta.loss;
  info.num_classes = meta.num_classes;
  info.trained_steps = meta.step;
  info.dataset = meta.dataset.path;
  info.config = meta.config;
  train::write_model_file(world, path, state.model, info);
  out(world, fmt::format("exported the model of {} (step {}, {}) to {}\n", checkpoint, meta.step,
                         train::format_widths(meta.model.widths), path));
  return exit_code::ok;
}

namespace {

struct TensorDiff {
  std::string name;
  std::size_t differing = 0, size = 0;
  double max_abs = 0;
};

TensorDiff compare(const std::string& name, std::span<const float> a, std::span<const float> b,
                   double tolerance) {
  TensorDiff d{name, 0, a.size(), 0};
  for (std::size_t i = 0; i < a.size(); ++i) {
    const double diff = std::abs(static_cast<double>(a[i]) - b[i]);
    const bool same = tolerance == 0 ? std::memcmp(&a[i], &b[i], sizeof(float)) == 0
                                     : diff <= tolerance;
    if (!same) ++d.differing;
    if (std::isfinite(diff)) d.max_abs = std::max(d.max_abs, diff);
  }
  return d;
}

}  // namespace

int ckpt_diff(const mpi::Comm& world, const std::string& a, const std::string& b,
              double tolerance) {
  train::CheckpointMeta ma, mb;
  const train::TrainState sa = train::load_checkpoint_state(world, a, &ma);
  const train::TrainState sb = train::load_checkpoint_state(world, b, &mb);
  out(world, fmt::format("A {} (step {}, run {})\nB {} (step {}, run {})\n", a, ma.step,
                         ma.run_id, b, mb.step, mb.run_id));
  if (ma.model.widths != mb.model.widths || ma.optimizer_state != mb.optimizer_state) {
    out(world, fmt::format("different models: A {} with [{}], B {} with [{}]\n",
                           train::format_widths(ma.model.widths), fmt::join(ma.optimizer_state, ","),
                           train::format_widths(mb.model.widths), fmt::join(mb.optimizer_state, ",")));
    return kExitDiffer;
  }
  std::vector<TensorDiff> diffs;
  const auto tensors = sa.model.layout().tensors();
  for (const auto& t : tensors) {
    diffs.push_back(compare("model/" + t.name, sa.model.params().subspan(t.offset, t.size()),
                            sb.model.params().subspan(t.offset, t.size()), tolerance));
  }
  const auto oa = std::as_const(*sa.optimizer).state(), ob = std::as_const(*sb.optimizer).state();
  for (std::size_t s = 0; s < oa.size(); ++s) {
    for (const auto& t : tensors) {
      diffs.push_back(compare(fmt::format("optimizer/{}/{}", oa[s].name, t.name),
                              oa[s].data.subspan(t.offset, t.size()),
                              ob[s].data.subspan(t.offset, t.size()), tolerance));
    }
  }
  int differing = 0;
  for (const auto& d : diffs) {
    differing += d.differing > 0 ? 1 : 0;
    out(world, fmt::format("  {:<44} {:>10} of {:>10} differ, max |a - b| {:.3g}\n", d.name,
                           d.differing, d.size, d.max_abs));
  }
  if (ma.step != mb.step || ma.samples_seen != mb.samples_seen) {
    out(world, fmt::format("  counters: A at step {} ({} samples), B at step {} ({} samples)\n",
                           ma.step, ma.samples_seen, mb.step, mb.samples_seen));
  }
  out(world, differing == 0
                 ? fmt::format("same: every tensor {}\n",
                               tolerance == 0 ? "is bitwise equal"
                                              : fmt::format("within {:g}", tolerance))
                 : fmt::format("different: {} of {} tensors\n", differing, diffs.size()));
  return differing == 0 ? exit_code::ok : kExitDiffer;
}

}  // namespace locus::app
