// Checkpoints of a training run (docs/FORMATS.md, "Checkpoint files"): one HDF5 file per
// checkpoint holding the parameters (/model, as a model file), the optimizer state by PyTorch
// name (/optimizer/<state>/<tensor>), the counters, the data position in global samples and
// the run's identity, with a CRC-32 per tensor. Files do not depend on the world size or the
// grid: every tensor is global, written and read by the ranks that hold its layer (every rank,
// or a pipeline stage's replicas), each its share of the rows.
//
// A checkpoint directory holds ckpt-<step>.h5 files committed atomically (temporary name,
// fsync, rename, directory fsync) and a `latest` pointer naming the newest one and the run it
// belongs to. The Checkpointer plugs into Trainer::train as its StepHook: it saves on the
// configured triggers (steps, seconds, epoch ends, a preemption signal, the end), optionally
// in a background thread, and resumes a run (--resume auto|PATH|none).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/io/file_lock.hpp"
#include "locus/io/raw_io.hpp"
#include "locus/train/metrics.hpp"
#include "locus/train/model/loss.hpp"
#include "locus/train/model/model.hpp"
#include "locus/train/model/model_file.hpp"  // kCheckpointFormatVersion
#include "locus/train/optim/optimizer.hpp"
#include "locus/train/train_state.hpp"
#include "locus/train/trainer.hpp"

namespace locus::train {

// Which training set a checkpoint was trained on. The fingerprint (16 hex digits, FNV-1a 64)
// covers committed_rows, the feature count, the source files' sizes and CRC-32s and the
// per-feature means of a locus dataset (docs/FORMATS.md, "Dataset files"): it changes when
// the data does, not when the file moves. A plain HDF5 file (no locus attributes) gets a
// fingerprint of its shape only.
struct DatasetIdentity {
  std::string path;
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::string fingerprint;
};

// Collective over comm: the identity of the dataset at `path`. Holds hdf5_mutex() for its
// HDF5 calls (a Loader may exist). DataError (agreed) when it cannot be read.
DatasetIdentity dataset_identity(const mpi::Comm& comm, const std::string& path);

// Everything a checkpoint records besides the tensors (the root attributes).
struct CheckpointMeta {
  std::int64_t format_version = kCheckpointFormatVersion;
  std::string run_id;                // the run (lineage) the checkpoint belongs to
  std::int64_t step = 0;             // optimizer steps taken
  std::int64_t epoch = 0;            // epoch in progress (the next one at an epoch end)
  std::int64_t step_in_epoch = 0;    // batches of `epoch` already trained on
  std::int64_t samples_in_epoch = 0; // the data position: global samples of `epoch` consumed
  std::int64_t samples_seen = 0;     // global samples trained on since step 0
  std::int64_t steps_per_epoch = 0;
  std::int64_t optimizer_steps = 0;
  std::string optimizer;             // sgd | adam | adamw
  std::string schedule;              // constant | step | cosine
  double base_lr = 0;
  std::int64_t warmup_steps = 0;
  std::int64_t total_steps = 0;      // the schedule's horizon
  double lr = 0;                     // learning rate of the next step
  std::int64_t global_batch = 0;
  std::string shuffle;               // global | local | none
  std::int64_t loader_seed = 0;
  bool drop_last = false;
  DatasetIdentity dataset;
  std::string config;                // the effective configuration (INI) of the writing run
  std::string config_hash;           // 16 hex digits, FNV-1a 64 of `config`
  std::int64_t world_size = 0;
  std::int64_t data_parallel = 0;
  std::int64_t pipeline_stages = 0;
  std::string tool_version;
  std::string git_revision;
  // The backend that wrote it (Compute::describe() of rank 0): "cpu (OpenBLAS)", or "cuda bf16
  // on NVIDIA H100 80GB HBM3 (cc 9.0), CUDA runtime 13000, driver 13000, cuBLASLt 130000". A
  // resume is bitwise equal to an uninterrupted run only under the same one. Empty in files
  // written before it existed (and then absent from meta_text).
  std::string compute;
  double created = 0;                // Unix time of the save
  // The epoch and log interval in progress (Trainer::metrics_progress), so that a resumed run
  // writes the metrics of an uninterrupted one. has_metrics = false in files written before
  // they existed (their attributes are then absent, and absent from meta_text).
  bool has_metrics = false;
  MetricsProgress metrics;
  // The anomaly detector's state (Trainer::anomaly_state), so that a resumed run makes the
  // decisions of an uninterrupted one; has_anomaly = false in files written before it existed
  // (the detector then starts empty) and absent from meta_text.
  bool has_anomaly = false;
  AnomalyState anomaly;
  ModelSpec model;                   // from /model (filled by the readers)
  std::vector<std::string> optimizer_state;  // from /optimizer: state buffer names
  Loss loss = Loss::softmax_cross_entropy;
  std::int64_t num_classes = 0;      // 0 for regression
};

// The canonical text of the metadata (one "key=value" line per field, fixed order); its
// CRC-32 is stored as the root attribute meta_crc32, so a damaged attribute is detected too.
std::string meta_text(const CheckpointMeta& m);

// What a save writes: views of the parameters and optimizer state (the live TrainState for a
// synchronous save, a Snapshot's copies for a background one) plus the metadata. With pipeline
// stages the model and the state spans hold this rank's layers only (model->held()).
struct CheckpointData {
  const Mlp* model = nullptr;
  std::vector<NamedSpan<const float>> optimizer_state;
  CheckpointMeta meta;
};

// A host copy of a TrainState's tensors at a step boundary, for a background write while
// training continues: of the held layers only (a stage copies its share).
class Snapshot {
 public:
  Snapshot(const TrainState& state, CheckpointMeta meta);
  CheckpointData data() const;
  std::uint64_t bytes() const noexcept;  // this rank's copy

 private:
  Mlp model_;
  std::vector<std::pair<std::string, std::vector<float>>> optimizer_;
  CheckpointMeta meta_;
};

struct WriteOptions {
  double timeout_s = 0;  // > 0: give the save up (rank 0's clock decides) beyond this budget
  std::string abandon_hook;  // test hook point name; internal
  // After the file system refused a write into the file (an agreed IoError), end the job
  // (rank 0 prints the message, then MPI_Abort with exit 5) instead of closing the file and
  // throwing. HDF5's collective close flushes metadata into the same file; when that flush
  // fails too (a full disk stays full) the ranks leave H5Fclose through different collectives
  // and the job hangs (found by tests/chaos). Off: the IoError is thrown after the close, so a
  // caller may go on (the close is safe when only some writes fail, e.g. a file size limit).
  bool end_job_on_refused_write = false;
};

enum class WriteOutcome { written, abandoned };

// Collective over comm: writes a checkpoint file at `path` (created or truncated; no
// temporary name here, see CheckpointDir::save). Each tensor is written by the ranks holding
// its layer (data.model->held(): every rank, or a pipeline stage's replicas), each its balanced
// share of the rows among them (h5::partition_rows), which it checksums; the CRCs are combined
// in rank order into each tensor's zlib CRC-32, identical at any world size and grid. The
// ranks' held ranges must cover every layer and be equal or disjoint. Holds hdf5_mutex() around
// its HDF5 calls. A failed write is an agreed IoError naming the path; past the time budget it
// returns `abandoned` (the file is left incomplete: delete it).
WriteOutcome write_checkpoint_file(const mpi::Comm& comm, const std::string& path,
                                   const CheckpointData& data, const WriteOptions& options = {});

// One tensor as found by a reader.
struct TensorCheck {
  std::string name;                  // "model/layers.0.weight", "optimizer/exp_avg/layers.0.bias"
  std::vector<std::uint64_t> shape;
  std::uint32_t stored_crc = 0;
  std::uint32_t computed_crc = 0;
  // NaN or Inf elements: a run that had diverged when it was saved, or an edited file (the
  // digest then matches; the tensor is still refused).
  std::uint64_t nonfinite = 0;
  bool ok() const noexcept { return stored_crc == computed_crc && nonfinite == 0; }
};

struct VerifyReport {
  std::string path;
  bool ok = false;
  std::string problem;               // what is wrong (first problem found), "" when ok
  bool meta_valid = false;           // meta below was read (the attributes are intact)
  CheckpointMeta meta;
  std::vector<TensorCheck> tensors;
  std::uint64_t file_bytes = 0;
};

// Collective over comm: reads the attributes only (no tensors). DataError (agreed) naming the
// file for anything missing or malformed, a newer format_version, a meta_crc32 mismatch.
CheckpointMeta read_checkpoint_meta(const mpi::Comm& comm, const std::string& path);

// Collective over comm: reads every tensor and checks every digest. Never throws for a damaged
// or unreadable file (the report says what is wrong), only for MPI failures.
VerifyReport verify_checkpoint(const mpi::Comm& comm, const std::string& path);

// Collective over comm: reads `path` into `state` (parameters, optimizer state and steps,
// counters), verifying every digest on the way. Each rank reads only the tensors of its held
// layers (state.model.held(): a pipeline stage's), split in rows over the ranks holding the
// same layers and then gathered among them; every rank learns every tensor's verdict, so a
// DataError (agreed) names the file and the tensor on a digest mismatch anywhere, or on a
// missing/misshapen tensor; ConfigError when the checkpoint's model or optimizer differs from
// the state's. On a throw `state` may be partly overwritten (see reset_state). Holds
// hdf5_mutex() around its HDF5 calls.
CheckpointMeta load_checkpoint(const mpi::Comm& comm, const std::string& path,
                               TrainState& state);

// Collective over comm: a whole TrainState shaped as the checkpoint (its model and optimizer
// state buffers), loaded and verified as load_checkpoint does; `meta` receives the metadata.
// For tools (locus-ckpt): every rank holds every layer.
TrainState load_checkpoint_state(const mpi::Comm& comm, const std::string& path,
                                 CheckpointMeta* meta = nullptr);

// The state a fresh run starts from: parameters (of the held layers) initialised from the
// spec's seed, optimizer state zeroed, all counters 0.
void reset_state(TrainState& state);

// Local: the reasons a checkpoint cannot continue `trainer`'s run, as one message (empty when
// it can). Refused: another model (widths, activation), optimizer kind or global batch,
// another dataset (rows, fingerprint) or steps per epoch, a mid-epoch position with local
// shuffling on another data-parallel size or with another shuffle mode or seed.
std::string resume_conflicts(const CheckpointMeta& m, const Trainer& trainer,
                             const DatasetIdentity& dataset);
// Local: differences that are allowed but change the continuation (config lines, schedule
// horizon, dataset path), one line each.
std::vector<std::string> resume_notes(const CheckpointMeta& m, const Trainer& trainer,
                                      const std::string& config, const DatasetIdentity& dataset);

// The checkpoint directory: ckpt-<step>.h5 files, the `latest` pointer and retention.
struct CheckpointEntry {
  std::string name;                  // "ckpt-00000100.h5"
  std::string path;
  std::int64_t step = 0;
};

// The `latest` pointer: the newest committed checkpoint (empty before the run's first) and
// the run it belongs to. Text, two lines: "run <id>" and "latest <file name>".
struct LatestPointer {
  bool present = false;
  std::string run_id;
  std::string file;
};

std::string checkpoint_file_name(std::int64_t step);  // "ckpt-00000100.h5"
// Local: the checkpoints in `dir`, newest (highest step) first; [] for a missing dir.
std::vector<CheckpointEntry> list_checkpoints(const std::string& dir);
// Local: the pointer of `dir` (present = false when missing or unreadable).
LatestPointer read_latest(const std::string& dir);
// Local (one rank): replaces the pointer atomically (temporary file, fsync, rename, directory
// fsync). IoError naming the path.
void write_latest(const std::string& dir, const LatestPointer& pointer);

struct SaveResult {
  bool committed = false;            // false: abandoned past the time budget (nothing changed)
  std::int64_t step = 0;
  std::string path;
  std::string reason;                // the trigger: steps, seconds, epoch, signal, end, manual
  double seconds = 0;                // write + commit
  double snapshot_seconds = 0;       // the host copy of a background save (0 when synchronous)
  std::uint64_t bytes = 0;
  std::vector<std::string> removed;  // files deleted by retention
};

struct RetentionOptions {
  std::int64_t keep_last = 0;        // > 0: keep this many of the run's newest checkpoints
  std::vector<std::string> retire;   // file names to delete as well (a branch left by resume)
};

// Collective over comm: saves `data` as <dir>/ckpt-<step>.h5 (creating dir): writes a temporary name,
// fsyncs, renames, fsyncs the directory, then points `latest` at it (run data.meta.run_id) and
// applies retention: checkpoints of other runs, of this run beyond keep_last and at steps
// above this one (an abandoned branch) and stale temporary files are deleted -- never the new
// one, so the newest checkpoint is only removed after a newer one committed. Test hooks
// ckpt-mid-write, ckpt-before-rename, ckpt-before-latest. IoError (agreed) naming the path on
// a failed write; the previous checkpoint and the pointer are then untouched.
SaveResult save_checkpoint(const mpi::Comm& comm, const std::string& dir,
                           const CheckpointData& data, const WriteOptions& write,
                           const RetentionOptions& retention);

// How long CheckpointDirLock::acquire waits for an earlier instance of its own Slurm job.
struct LockWait {
  // For a predecessor that is going away (its node's lock released late, e.g. an NFS lease).
  double same_job_s = 0;
  // This job's train.watchdog_s (0: none), recorded in the holder record: a predecessor that
  // recorded one ends itself within that long of its last progress, e.g. when it is stranded
  // on a node that lost its network and Slurm requeued the job elsewhere, so a successor
  // waits same_job_s plus the predecessor's watchdog_s for it.
  double watchdog_s = 0;
};

// Ownership of a checkpoint directory by one training job (docs/FORMATS.md, "The directory
// and the commit"): rank 0 of the job holds an exclusive flock(2) on <dir>/.lock, whose text
// names the holder (host, pid, Slurm job, run, start time, watchdog). The kernel drops the lock
// when the process ends in any way, SIGKILL included, so no stale lock outlives a job; the file
// stays.
class CheckpointDirLock {
 public:
  CheckpointDirLock() = default;  // holds nothing

  // Collective over comm: creates `dir` when missing; comm's rank 0 takes the lock and writes
  // the holder record. A directory locked by another process is a ConfigError (agreed) naming
  // the directory and the holder and saying what to do; nothing in the directory is changed.
  // When the holder is an earlier instance of this Slurm job (the same SLURM_JOB_ID: requeued
  // while its predecessor is still going away or stranded), rank 0 first waits for it (see
  // LockWait), telling `say` (on rank 0) once. On a file system without locks (flock fails
  // with ENOLCK, ENOSYS, EOPNOTSUPP) the directory is used unlocked and warning() says so.
  // IoError (agreed) when `dir` or its lock file cannot be created.
  static CheckpointDirLock acquire(const mpi::Comm& comm, const std::string& dir,
                                   const std::string& run_id, const LockWait& wait = {},
                                   const std::function<void(const std::string&)>& say = {});

  bool held() const noexcept { return lock_.held(); }
  const std::string& warning() const noexcept { return lock_.warning(); }
  // Local: records another run id in the holder record (a resume adopts its checkpoint's
  // run); a no-op unless this rank holds the lock and the id changed.
  void set_run(const std::string& run_id) { lock_.set_run(run_id); }

 private:
  io::FileLock lock_;
};

// Local, read-only: the holder record of <dir>/.lock as one line ("" when there is none).
std::string read_lock_holder(const std::string& dir);

// The checkpointing policy of a run (apps/locus-train's [checkpoint] section).
struct CheckpointOptions {
  std::string dir;                   // "" : no checkpoints
  std::int64_t every_steps = 0;      // > 0: save when step % every_steps == 0
  double every_seconds = 0;          // > 0: save when this long passed since the last save
  bool at_epoch_end = true;
  bool at_end = true;                // after the last planned step
  std::int64_t keep_last = 2;        // 0: keep all
  bool async = false;                // periodic saves in a background thread
  std::vector<int> signals;          // signals that checkpoint and stop (see preempt.hpp)
  double save_timeout_s = 0;         // > 0: budget of one save
  bool end_job_on_refused_write = false;  // see WriteOptions (locus-train: on)
  double watchdog_s = 0;             // the job's train.watchdog_s, for the lock (LockWait)
};

// Throws ConfigError naming checkpoint.<key>.
void validate(const CheckpointOptions& options);

struct ResumeResult {
  bool resumed = false;
  std::string path;                  // the checkpoint resumed from
  CheckpointMeta meta;
  std::vector<std::string> skipped;  // "<file>: <reason>" for every candidate passed over
  std::vector<std::string> notes;    // allowed differences (resume_notes)
};

// Saves a run's checkpoints on its triggers; a Trainer's StepHook.
class Checkpointer final : public StepHook {
 public:
  using Log = std::function<void(const std::string&)>;
  // Collective over trainer.grid().world(). Creates the directory (IoError, agreed). `config`
  // is the effective configuration recorded in every checkpoint; `log` receives progress
  // lines on world rank 0 (may be empty).
  Checkpointer(Trainer& trainer, CheckpointOptions options, std::string config, Log log = {});
  // Waits for a background save (errors are dropped; call wait() to see them).
  ~Checkpointer() override;
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // Collective over the world: restores the trainer's state. how = "none" (a new run: its
  // first save retires the directory's older checkpoints), "auto" (the newest checkpoint of
  // the pointer's run that verifies, older ones on damage, a fresh start when there is none)
  // or a checkpoint path. Incompatible checkpoints are refused (ConfigError/DataError, agreed)
  // with what differs and what to do; a damaged PATH is a DataError.
  ResumeResult resume(const std::string& how);

  // StepHook: collective over the world at every step boundary.
  bool at_step_boundary(Trainer& trainer, const StepBoundary& boundary) override;

  // Collective over the world: saves the current state now (synchronously, after waiting for
  // a background save). Skipped (returns nullopt) when a checkpoint of this step exists.
  std::optional<SaveResult> save_now(const std::string& reason = "manual");
  // Collective over the world: waits for the background save, rethrowing its error.
  void wait();

  // The signal that stopped training (0 when none); training stopped resumably.
  int stopped_by_signal() const noexcept;
  const std::vector<SaveResult>& saves() const noexcept;
  const std::string& run_id() const noexcept;

 private:
  struct Impl;
  CheckpointDirLock lock_;  // released last, after any background save has ended
  std::unique_ptr<Impl> impl_;
};

}  // namespace locus::train
