// Checkpoint files: the collective write (each tensor by the ranks holding its layer, its rows
// split over them, CRC-32s combined across ranks), and the verifying readers (verify, load)
// with the same row partition.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#include <zlib.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <optional>
#include <utility>

#include "checkpoint/checkpoint_detail.hpp"
#include "model/layer_owners.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/app.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/config.hpp"
#include "locus/io/attribute.hpp"
#include "locus/io/dataset.hpp"
#include "locus/io/file.hpp"
#include "locus/train/data/loader.hpp"
#include "locus/train/model/model_file.hpp"

namespace locus::train {

namespace {

using Clock = std::chrono::steady_clock;

std::size_t row_width(const TensorInfo& t) { return t.shape.size() == 2 ? t.shape[1] : 1; }

// This rank's rows of a tensor, as element offsets into the buffer of its held layers.
struct Share {
  std::size_t begin = 0;  // element offset of the first row of the share in the buffer
  std::size_t count = 0;  // elements
  std::uint64_t first_row = 0;
};
// `base`: the layout offset of the buffer's first element (Mlp::offset()). A rank that does not
// hold the tensor's layer gets an empty share.
Share share_of(const TensorInfo& t, const detail::LayerOwners& owners, std::size_t base) {
  const h5::RowRange r = owners.rows(t.layer, t.shape[0]);
  if (r.count == 0) return {};
  const std::size_t w = row_width(t);
  return {t.offset - base + r.begin * w, r.count * w, r.begin};
}


std::string join(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += (out.empty() ? "" : ",") + s;
  return out;
}

std::vector<std::string> split_names(const std::string& s) {
  std::vector<std::string> out;
  std::size_t b = 0;
  while (b < s.size()) {
    const std::size_t e = std::min(s.find(',', b), s.size());
    out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

// The buffer (the held layers') a slot lives in.
std::span<const float> buffer_of(const CheckpointData& d, const detail::TensorSlot& s) {
  return s.state < 0 ? d.model->params()
                     : d.optimizer_state[static_cast<std::size_t>(s.state)].data;
}

// Collective over comm: rank 0's verdict on the time budget.
bool over_budget(const mpi::Comm& comm, Clock::time_point t0, double budget_s) {
  int over = 0;
  if (comm.is_root() && budget_s > 0) {
    over = std::chrono::duration<double>(Clock::now() - t0).count() > budget_s ? 1 : 0;
  }
  LOCUS_MPI_CHECK(MPI_Bcast(&over, 1, MPI_INT, 0, comm.get()));
  return over != 0;
}

// Collective: combines every slot's local CRC in one all-gather.
std::vector<std::uint32_t> combine_all(const mpi::Comm& comm,
                                       const std::vector<std::pair<std::uint32_t, std::uint64_t>>& local) {
  const std::size_t n = local.size();
  std::vector<std::uint64_t> mine(2 * n);
  for (std::size_t i = 0; i < n; ++i) {
    mine[2 * i] = local[i].first;
    mine[2 * i + 1] = local[i].second;
  }
  std::vector<std::uint64_t> all(mine.size() * static_cast<std::size_t>(comm.size()));
  LOCUS_MPI_CHECK(MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_UINT64_T,
                                all.data(), static_cast<int>(mine.size()), MPI_UINT64_T,
                                comm.get()));
  std::vector<std::uint32_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    uLong crc = ::crc32_z(0L, Z_NULL, 0);
    for (int r = 0; r < comm.size(); ++r) {
      const std::size_t at = static_cast<std::size_t>(r) * mine.size() + 2 * i;
      if (all[at + 1] > 0) {
        crc = ::crc32_combine(crc, static_cast<uLong>(all[at]), static_cast<z_off_t>(all[at + 1]));
      }
    }
    out[i] = static_cast<std::uint32_t>(crc);
  }
  return out;
}

// Local (rank 0): checks before HDF5 writes anything that the file can reach its expected
// size (the file size limit: ftruncate fails with EFBIG) and that the file system has the
// space, so such failures are found up front -- HDF5 cannot close a file whose final
// extension failed, and a half-closed file crashes the library's clean-up at exit. (Not
// fallocate: its blocks would be freed again by HDF5's truncating create, which costs a
// discard of every block on file systems mounted with `discard`.)
void preflight(const std::string& path, std::uint64_t bytes) {
  const auto fail = [&](int err) {
    throw IoError(fmt::format("cannot write checkpoint '{}' ({} bytes): {}; the previous "
                              "checkpoint is untouched: free space or raise the file size "
                              "limit, or set checkpoint.dir to another file system",
                              path, bytes, std::strerror(err)));
  };
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) fail(errno);
  const int rc = ::ftruncate(fd, static_cast<off_t>(bytes));
  const int err = errno;
  struct statvfs fs {};
  const bool stat_ok = ::fstatvfs(fd, &fs) == 0;
  ::close(fd);
  if (rc != 0) fail(err);
  if (stat_ok && static_cast<std::uint64_t>(fs.f_bavail) * fs.f_frsize < bytes) fail(ENOSPC);
}

// Collective over the file's communicator (metadata): a contiguous float32 dataset allocated
// at creation, so every rank's rows are one byte range it writes by itself.
h5::Id create_tensor(hid_t file, const std::string& path, const TensorInfo& t) {
  const int rank = static_cast<int>(t.shape.size());
  const hsize_t dims[2] = {t.shape[0], rank == 2 ? t.shape[1] : 1};
  h5::Id space(LOCUS_H5_CHECK(H5Screate_simple(rank, dims, nullptr)));
  h5::Id dcpl(LOCUS_H5_CHECK(H5Pcreate(H5P_DATASET_CREATE)));
  LOCUS_H5_CHECK(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS));
  LOCUS_H5_CHECK(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY));
  LOCUS_H5_CHECK(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER));
  return h5::Id(LOCUS_H5_CHECK(H5Dcreate2(file, path.c_str(), H5T_IEEE_F32LE, space.get(),
                                          H5P_DEFAULT, dcpl.get(), H5P_DEFAULT)));
}

// Local (independent I/O): this rank's rows of a tensor dataset. A rank writes or reads its own
// byte range; nothing is exchanged between ranks, unlike a collective two-phase transfer that
// routes the bytes through aggregator ranks. The rows of a contiguous dataset are moved as raw
// bytes by io::RawFile (pwrite/pread in 1 MiB pieces, write-back started as it goes), not
// through HDF5 and MPI-IO (measured in bench/RESULTS.md, "Checkpoints").
// Returns the CRC-32 of the bytes moved, computed piece by piece while they are in cache.
std::uint32_t rows_io(hid_t ds, const TensorInfo& t, const Share& mine, float* data, bool write) {
  if (mine.count == 0) return 0;  // the CRC-32 of nothing; a rank not holding this tensor
  const std::uint64_t width = row_width(t);
  const std::uint64_t row_bytes = width * sizeof(float);
  const std::span<std::byte> bytes = std::as_writable_bytes(std::span<float>(data, mine.count));
  if (const std::optional<std::uint64_t> at = h5::raw_offset(ds, H5T_NATIVE_FLOAT)) {
    io::RawFile f = io::RawFile::open(h5::file_name(ds), write ? io::RawFile::Mode::write
                                                               : io::RawFile::Mode::read);
    const std::uint64_t offset = *at + mine.first_row * row_bytes;
    const std::uint32_t crc = write ? f.write_at(offset, bytes) : f.read_at(offset, bytes);
    f.close();  // on a file system shared between nodes: this rank's bytes made durable
    return crc;
  }
  // Another layout (e.g. a checkpoint rewritten by h5repack): through HDF5, in pieces below
  // 2 MiB for the same reason as io::RawFile::kPieceBytes.
  const std::uint64_t rows = mine.count / width;
  const std::uint64_t piece = std::max<std::uint64_t>(1, io::RawFile::kPieceBytes / row_bytes);
  h5::Id fs(LOCUS_H5_CHECK(H5Dget_space(ds)));
  const int rank = static_cast<int>(t.shape.size());
  std::uint32_t crc = 0;
  for (std::uint64_t r0 = 0; r0 < rows; r0 += piece) {
    const std::uint64_t n = std::min(piece, rows - r0);
    const hsize_t start[2] = {mine.first_row + r0, 0};
    const hsize_t count[2] = {n, width};
    LOCUS_H5_CHECK(H5Sselect_hyperslab(fs.get(), H5S_SELECT_SET, start, nullptr, count, nullptr));
    h5::Id ms(LOCUS_H5_CHECK(H5Screate_simple(rank, count, nullptr)));
    float* p = data + r0 * width;
    if (write) {
      LOCUS_H5_CHECK(H5Dwrite(ds, H5T_NATIVE_FLOAT, ms.get(), fs.get(), H5P_DEFAULT, p));
    } else {
      LOCUS_H5_CHECK(H5Dread(ds, H5T_NATIVE_FLOAT, ms.get(), fs.get(), H5P_DEFAULT, p));
    }
    crc = io::crc32_bytes(bytes.subspan(r0 * width * sizeof(float), n * row_bytes), crc);
  }
  return crc;
}

// Collective: the /model attributes of docs/FORMATS.md, "Model files" (what write_model
// records), so read_model_file and locus-infer read a checkpoint's /model as a model.
void write_model_attributes(hid_t g, const Mlp& model, const CheckpointMeta& m) {
  const ModelSpec& spec = model.spec();
  const std::vector<std::int64_t> widths(spec.widths.begin(), spec.widths.end());
  h5::write_attr(g, "locus_format", kModelFormat);
  h5::write_attr(g, "schema_version", kModelSchemaVersion);
  h5::write_attr(g, "widths", std::span<const std::int64_t>(widths));
  h5::write_attr(g, "activation", std::string(to_string(spec.activation)));
  h5::write_attr(g, "init", std::string(to_string(spec.init)));
  h5::write_attr(g, "dropout", static_cast<double>(spec.dropout));
  h5::write_attr(g, "seed", static_cast<std::int64_t>(spec.seed));
  h5::write_attr(g, "loss", std::string(to_string(m.loss)));
  const std::int64_t classes = m.loss == Loss::softmax_cross_entropy && m.num_classes == 0
                                   ? spec.widths.back() : m.num_classes;
  h5::write_attr(g, "num_classes", classes);
  h5::write_attr(g, "trained_steps", m.step);
  h5::write_attr(g, "dataset", m.dataset.path);
  h5::write_attr(g, "config", m.config);
  h5::write_attr(g, "tool_version", LOCUS_VERSION);
  h5::write_attr(g, "git_revision", LOCUS_GIT_REVISION);
}

}  // namespace

// Copies the held layers only: a stage's snapshot is its share, like its live state.
Snapshot::Snapshot(const TrainState& state, CheckpointMeta meta)
    : model_(state.model), meta_(std::move(meta)) {
  for (const auto& s : std::as_const(*state.optimizer).state()) {
    optimizer_.emplace_back(s.name, std::vector<float>(s.data.begin(), s.data.end()));
  }
}

CheckpointData Snapshot::data() const {
  CheckpointData d;
  d.model = &model_;
  for (const auto& [name, values] : optimizer_) {
    d.optimizer_state.push_back({name, std::span<const float>(values)});
  }
  d.meta = meta_;
  return d;
}

std::uint64_t Snapshot::bytes() const noexcept {
  return model_.params().size_bytes() * (1 + optimizer_.size());
}

WriteOutcome write_checkpoint_file(const mpi::Comm& comm, const std::string& path,
                                   const CheckpointData& data, const WriteOptions& options) {
  const auto t0 = Clock::now();
  const Mlp& model = *data.model;
  const CheckpointMeta& meta = data.meta;
  std::vector<std::string> names;
  for (const auto& s : data.optimizer_state) {
    LOCUS_ASSERT(s.data.size() == model.params().size(),
                 fmt::format("optimizer state '{}' holds {} floats for {} parameters", s.name,
                             s.data.size(), model.params().size()));
    names.push_back(s.name);
  }
  const std::vector<detail::TensorSlot> slots = detail::tensor_slots(model.layout(), names);
  // Each tensor is written by the ranks holding its layer (a pipeline stage's replicas).
  const detail::LayerOwners owners(comm, model.held(), model.num_layers());
  std::optional<h5::File> file;
  auto locked = [&](const char* phase, auto&& fn) {
    std::lock_guard lock(hdf5_mutex());
    detail::write_phase(comm, path, phase, fn);
  };
  auto give_up = [&] {
    locked("close", [&] { file->close(); });
    return WriteOutcome::abandoned;
  };
  try {
    mpi::agree_on(comm, [&] {
      if (!comm.is_root()) return;
      const std::uint64_t tensors = model.layout().size() * sizeof(float) * (1 + names.size());
      preflight(path, tensors + (64u << 10) + 4096 * slots.size() + 2 * meta.config.size());
    });
    locked("create", [&] { file.emplace(h5::File::create(comm, path)); });
    std::vector<h5::Id> datasets;
    locked("layout", [&] {
      h5::create_group(file->id(), "/model");
      h5::create_group(file->id(), "/optimizer");
      for (const auto& n : names) h5::create_group(file->id(), "/optimizer/" + n);
      for (const detail::TensorSlot& s : slots) {
        datasets.push_back(create_tensor(file->id(), s.path, s.tensor));
      }
    });
    // Independent writes, one tensor per lock hold; the verdict is agreed once at the end.
    // Every rank calls rows_io for every tensor, with an empty share where it does not hold
    // the tensor (its CRC piece is then empty too).
    std::string failure;
    std::vector<std::pair<std::uint32_t, std::uint64_t>> local(slots.size());
    auto write_slot = [&](std::size_t i) {
      const Share mine = share_of(slots[i].tensor, owners, model.offset());
      comm::progress("checkpoint write of {} in {}", slots[i].path, path);
      std::lock_guard lock(hdf5_mutex());
      try {
        local[i] = {rows_io(datasets[i].get(), slots[i].tensor, mine,
                            const_cast<float*>(buffer_of(data, slots[i]).data() + mine.begin),
                            true),
                    mine.count * sizeof(float)};
      } catch (const std::exception& e) {
        if (failure.empty()) failure = fmt::format("{}: {}", slots[i].path, e.what());
      }
    };
    std::size_t i = 0;
    for (; i < slots.size() && slots[i].state < 0; ++i) write_slot(i);
    test_hook("ckpt-mid-write");
    for (; i < slots.size(); ++i) write_slot(i);
    detail::write_phase(comm, path, "tensors", [&] {
      if (!failure.empty()) throw IoError(failure);
    });
    if (over_budget(comm, t0, options.timeout_s)) {
      locked("close", [&] { datasets.clear(); });
      return give_up();
    }
    const std::vector<std::uint32_t> crcs = combine_all(comm, local);
    locked("attributes", [&] {
      for (std::size_t k = 0; k < slots.size(); ++k) {
        h5::write_attr(datasets[k].get(), detail::kCrcAttr, static_cast<std::int64_t>(crcs[k]));
      }
      datasets.clear();
      h5::Id mg = h5::open_group(file->id(), "/model");
      write_model_attributes(mg.get(), model, meta);
      h5::Id g = h5::open_group(file->id(), "/optimizer");
      h5::write_attr(g.get(), "kind", meta.optimizer);
      h5::write_attr(g.get(), "steps", meta.optimizer_steps);
      h5::write_attr(g.get(), "state_names", join(names));
      detail::write_meta(file->id(), meta);
    });
    locked("close", [&] { file->close(); });
  } catch (const Error& e) {
    if (options.end_job_on_refused_write && e.agreed() && e.kind() == ErrorKind::io && file &&
        file->is_open()) {
      // The file system refused a write into this file. HDF5's collective close would now
      // flush the metadata cache into it; when that flush fails as well (a full disk stays
      // full), the ranks leave H5Fclose through different collectives (one in the metadata
      // cache's barrier, one in MPI_File_close's) and the job hangs -- found by the chaos
      // suite (tests/chaos). So the job ends here without closing: the same message as an
      // agreed error, then exit 5 on every rank (MPI_Abort). The previous checkpoint is
      // untouched; the temporary file is removed by the next save of this step or by
      // retention (temporary names are pruned).
      if (comm.is_root()) {
        std::fprintf(stderr, "error: %s\n", e.what());
        std::fflush(stderr);
      }
      mpi::abort(comm.get(), exit_code::io);
    }
    // Agreed: every rank is here, so the collective close is safe (its own errors are moot).
    if (e.agreed() && file && file->is_open()) {
      std::lock_guard lock(hdf5_mutex());
      try {
        file->close();
      } catch (const Error&) {
      }
    }
    throw;
  }
  return over_budget(comm, t0, options.timeout_s) ? WriteOutcome::abandoned
                                                  : WriteOutcome::written;
}

namespace {

// Reads every tensor of an open checkpoint, fills `checks` with the stored and computed digests
// of every tensor (the same on every rank). Without `into`, every rank reads its share of every
// tensor. With `into`, only the ranks holding a tensor's layer (into->model.held()) read it,
// each its share, which lands in its buffers; when every digest matches, the shares are
// all-gathered among those ranks, so each holds its layers whole. Collective.
void read_tensors(h5::File& file, const CheckpointMeta& m, TrainState* into,
                  std::vector<TensorCheck>& checks) {
  const mpi::Comm& comm = file.comm();
  std::vector<std::string> names;
  mpi::agree_on(comm, [&] {
    if (!h5::exists(file.id(), "/optimizer")) {
      throw DataError(fmt::format("checkpoint '{}' has no /optimizer group: it is incomplete; "
                                  "use an older checkpoint", file.path()));
    }
    h5::Id g = h5::open_group(file.id(), "/optimizer");
    names = split_names(h5::read_attr<std::string>(g.get(), "state_names"));
    if (into == nullptr) return;
    std::vector<std::string> have;
    for (const auto& s : std::as_const(*into->optimizer).state()) have.push_back(s.name);
    if (names != have) {
      throw ConfigError(fmt::format(
          "checkpoint '{}' holds optimizer state [{}]; this run's {} optimizer keeps [{}] (e.g. "
          "sgd keeps momentum_buffer only with optim.momentum > 0): use the checkpoint's "
          "optimizer settings, or start over with --resume=none",
          file.path(), join(names), to_string(into->optimizer->options().kind), join(have)));
    }
  });
  const ParamLayout layout(m.model.widths);
  const std::vector<detail::TensorSlot> slots = detail::tensor_slots(layout, names);
  std::vector<NamedSpan<float>> state_bufs;
  if (into != nullptr) state_bufs = into->optimizer->state();
  const detail::LayerOwners owners(comm, into ? into->model.held() : layout.all_layers(),
                                   layout.num_layers());
  const std::size_t base = into ? into->model.offset() : 0;
  std::vector<std::pair<std::uint32_t, std::uint64_t>> local;
  std::vector<std::uint32_t> stored;
  std::vector<std::uint64_t> nonfinite(slots.size(), 0);  // this rank's share, then summed
  std::vector<float> scratch;
  for (const detail::TensorSlot& s : slots) {
    const Share mine = share_of(s.tensor, owners, base);
    std::span<float> dst;
    if (into != nullptr) {
      std::span<float> buf = s.state < 0 ? into->model.params()
                                         : state_bufs[static_cast<std::size_t>(s.state)].data;
      dst = buf.subspan(mine.begin, mine.count);  // empty where the layer is not held
    } else {
      scratch.resize(mine.count);
      dst = scratch;
    }
    mpi::agree_on(comm, [&] {
      h5::Dataset ds = h5::Dataset::open(file, s.path);
      const bool two_d = s.tensor.shape.size() == 2;
      if (ds.rows() != s.tensor.shape[0] || (two_d ? ds.cols() != s.tensor.shape[1] : ds.cols() != 0)) {
        const auto shape = [](std::uint64_t r, std::uint64_t c) {
          return c == 0 ? fmt::format("[{}]", r) : fmt::format("[{}, {}]", r, c);
        };
        throw DataError(fmt::format("checkpoint '{}': tensor '{}' has shape {} where widths {} "
                                    "need {}: the file is damaged; use an older checkpoint",
                                    file.path(), s.path, shape(ds.rows(), ds.cols()),
                                    format_widths(m.model.widths),
                                    shape(s.tensor.shape[0], two_d ? s.tensor.shape[1] : 0)));
      }
      local.emplace_back(rows_io(ds.id(), s.tensor, mine, dst.data(), false), dst.size_bytes());
      const auto i = static_cast<std::size_t>(&s - slots.data());
      nonfinite[i] = static_cast<std::uint64_t>(
          std::count_if(dst.begin(), dst.end(), [](float v) { return !std::isfinite(v); }));
      stored.push_back(static_cast<std::uint32_t>(h5::read_attr<std::int64_t>(ds.id(), detail::kCrcAttr)));
    });
  }
  const std::vector<std::uint32_t> computed = combine_all(comm, local);
  comm.allreduce_inplace(std::span<std::uint64_t>(nonfinite), MPI_SUM);
  for (std::size_t i = 0; i < slots.size(); ++i) {
    checks.push_back({slots[i].path.substr(1), slots[i].tensor.shape.size() == 2
                          ? std::vector<std::uint64_t>{slots[i].tensor.shape[0], slots[i].tensor.shape[1]}
                          : std::vector<std::uint64_t>{slots[i].tensor.shape[0]},
                      stored[i], computed[i], nonfinite[i]});
  }
  if (into == nullptr) return;
  for (const TensorCheck& c : checks) {
    if (!c.ok()) return;
  }
  // The ranks holding this rank's layers, in rank order: their shares are the rows in order.
  const mpi::Comm group = owners.group(comm);
  if (group.size() == 1) return;
  for (const detail::TensorSlot& s : slots) {
    if (!into->model.held().contains(s.tensor.layer)) continue;
    std::span<float> buf = s.state < 0 ? into->model.params()
                                       : state_bufs[static_cast<std::size_t>(s.state)].data;
    const std::size_t w = row_width(s.tensor);
    std::vector<int> counts(static_cast<std::size_t>(group.size())), displs(counts.size());
    for (int r = 0; r < group.size(); ++r) {
      const h5::RowRange rr = h5::partition_rows(s.tensor.shape[0], r, group.size());
      counts[static_cast<std::size_t>(r)] = static_cast<int>(rr.count);
      displs[static_cast<std::size_t>(r)] = static_cast<int>(rr.begin);
    }
    MPI_Datatype row = MPI_DATATYPE_NULL;
    LOCUS_MPI_CHECK(MPI_Type_contiguous(static_cast<int>(w), MPI_FLOAT, &row));
    LOCUS_MPI_CHECK(MPI_Type_commit(&row));
    const int rc = MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL,
                                  buf.data() + (s.tensor.offset - base), counts.data(),
                                  displs.data(), row, group.get());
    MPI_Type_free(&row);
    LOCUS_MPI_CHECK(rc);
  }
}

std::string first_mismatch(const std::string& path, const std::vector<TensorCheck>& checks) {
  for (const TensorCheck& c : checks) {
    if (c.stored_crc == c.computed_crc && c.nonfinite > 0) {
      return fmt::format("checkpoint '{}': tensor '{}' holds {} non-finite value(s) (NaN or "
                         "Inf): the run had diverged when it was saved, or the file was edited; "
                         "use an older checkpoint (locus-ckpt list shows which verify)",
                         path, c.name, c.nonfinite);
    }
    if (!c.ok()) {
      return fmt::format("checkpoint '{}': tensor '{}' does not match its digest (stored crc32 "
                         "{:08x}, computed {:08x}): the file is damaged; use an older checkpoint",
                         path, c.name, c.stored_crc, c.computed_crc);
    }
  }
  return "";
}

// Closes an open file after a failure every rank agreed on.
void close_quietly(h5::File& file) {
  try {
    mpi::agree_on(file.comm(), [&] { file.close(); });
  } catch (const Error&) {
  }
}

}  // namespace

VerifyReport verify_checkpoint(const mpi::Comm& comm, const std::string& path) {
  VerifyReport r;
  r.path = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) r.file_bytes = static_cast<std::uint64_t>(st.st_size);
  std::lock_guard lock(hdf5_mutex());
  std::optional<h5::File> file;
  try {
    file.emplace(h5::File::open(comm, path, h5::File::Mode::read));
    mpi::agree_on(file->comm(), [&] { r.meta = detail::read_meta(*file); });
    r.meta_valid = true;
    read_tensors(*file, r.meta, nullptr, r.tensors);
    r.problem = first_mismatch(path, r.tensors);
    mpi::agree_on(file->comm(), [&] { file->close(); });
  } catch (const Error& e) {
    if (!e.agreed()) throw;
    if (r.problem.empty()) r.problem = e.what();
    if (file && file->is_open()) close_quietly(*file);
  }
  r.ok = r.problem.empty();
  return r;
}

CheckpointMeta load_checkpoint(const mpi::Comm& comm, const std::string& path,
                               TrainState& state) {
  std::lock_guard lock(hdf5_mutex());
  h5::File file = h5::File::open(comm, path, h5::File::Mode::read);
  CheckpointMeta m;
  try {
    mpi::agree_on(file.comm(), [&] {
      m = detail::read_meta(file);
      const ModelSpec& have = state.model.spec();
      if (m.model.widths != have.widths || m.model.activation != have.activation) {
        throw ConfigError(fmt::format(
            "checkpoint '{}' holds a {} {} model; this run trains {} {}: set model.widths and "
            "model.activation to the checkpoint's, or start over with --resume=none",
            path, format_widths(m.model.widths), to_string(m.model.activation),
            format_widths(have.widths), to_string(have.activation)));
      }
      const std::string kind(to_string(state.optimizer->options().kind));
      if (m.optimizer != kind) {
        throw ConfigError(fmt::format("checkpoint '{}' was trained with optim.optimizer = {}; "
                                      "this run uses {}: set optim.optimizer = {}, or start over "
                                      "with --resume=none",
                                      path, m.optimizer, kind, m.optimizer));
      }
    });
    std::vector<TensorCheck> checks;
    read_tensors(file, m, &state, checks);
    mpi::agree_on(file.comm(), [&] {
      const std::string bad = first_mismatch(path, checks);
      if (!bad.empty()) throw DataError(bad);
      state.optimizer->set_steps(m.optimizer_steps);
      state.step = m.step;
      state.epoch = m.epoch;
      state.step_in_epoch = m.step_in_epoch;
      state.check();
    });
    mpi::agree_on(file.comm(), [&] { file.close(); });
  } catch (const Error& e) {
    if (e.agreed() && file.is_open()) close_quietly(file);
    throw;
  }
  return m;
}

TrainState load_checkpoint_state(const mpi::Comm& comm, const std::string& path,
                                 CheckpointMeta* meta) {
  const CheckpointMeta m = read_checkpoint_meta(comm, path);
  OptimizerOptions o;
  try {
    o.kind = parse_optimizer_kind(m.optimizer);
  } catch (const ConfigError& e) {
    throw DataError(fmt::format("checkpoint '{}': {}", path, e.what()));
  }
  // Plain sgd keeps no state; sgd with momentum keeps momentum_buffer.
  if (o.kind == OptimizerKind::sgd && !m.optimizer_state.empty()) o.momentum = 0.9;
  TrainState state(m.model, o);
  load_checkpoint(comm, path, state);
  if (meta != nullptr) *meta = m;
  return state;
}

void reset_state(TrainState& state) {
  init_params(state.model.spec(), state.model.layout(), state.model.held(), state.model.params());
  for (auto& s : state.optimizer->state()) std::ranges::fill(s.data, 0.0f);
  state.optimizer->set_steps(0);
  state.step = 0;
  state.epoch = 0;
  state.step_in_epoch = 0;
}

}  // namespace locus::train
