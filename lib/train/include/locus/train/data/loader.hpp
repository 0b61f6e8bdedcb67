// The data loader: each data-parallel rank reads its own partition of a locus dataset (or any
// HDF5 float32 [N, D] dataset) and a background producer keeps a ring buffer of ready batches
// while the trainer computes. All HDF5 calls happen on the producer thread.
//
// Rows. N = the `committed_rows` root attribute when present (locus datasets), else the extent
// of the features dataset. Labels (int32 [N], optional) must cover the same rows.
//
// Steps. An epoch has S = ceil(N / B) steps (floor(N / B) with drop_last), B = global_batch,
// in every mode and at every world size P. Global batch k is epoch positions
// [k·B, min((k+1)·B, N)), so all batches have B rows except possibly the last, which has
// N - (S-1)·B. LoadedBatch::global_rows is that size (the gradient divisor); the ranks' rows
// of a step always add up to it. A rank may have 0 rows in a step (last batch, or N < B·P): it
// still gets a batch object with rows = 0 and must take part in the step.
//
// Which rank gets which positions, and which sample sits at a position:
//  - global: positions are a permutation π_e of [0, N) (Fisher-Yates over the identity driven
//    by std::mt19937_64 seeded with a hash of (seed, e), bounded draws by Lemire's
//    multiply-and-reject: identical on every platform). Rank r takes the balanced partition
//    of each global batch (h5::partition_rows(size, r, P)): concatenating the ranks' rows of a
//    step in rank order gives exactly the batch of a 1-rank run.
//  - local, none: rank r owns the contiguous file partition h5::partition_rows(N, r, P) and
//    position i of the epoch goes to rank i mod P (a round-robin deal), so in step k rank r has
//    |{i in batch k : i mod P = r}| rows — floor or ceil of (batch size)/P — and uses its
//    partition's rows in its own epoch order, each exactly once (with drop_last the last
//    rows of that order are skipped). The order is a permutation of the partition from a hash
//    of (seed, e, partition) for local (when it fits memory_budget, see below), file order
//    for none. Data never crosses ranks, and the order depends on P.
// Everything is a pure function of (N, P, options, epoch, step): start_epoch(e, k) resumes.
//
// Memory. `memory_budget` bounds the sample bytes (features + labels) a rank holds:
//  - local/none, partition ≤ budget: the partition is read once (one collective read per
//    rank's contiguous range) and batches are gathered from memory;
//  - local/none, larger partition (out of core): the partition is cut into windows of
//    w = floor(G / M) rows, G = max(1, floor(budget / (2 · row bytes))), M = min(8, G)
//    windows per group for local (M = 1, w = G for none). Local order of an epoch: the
//    windows are permuted (hash of seed, e, partition), taken M at a time as groups in that
//    order; each group's rows, listed in ascending file order, are permuted by a hash of
//    (seed, e, partition, group index). Two groups are in memory: the one being served and
//    the next, read one window per batch (each window one contiguous read). Peak memory is
//    the budget plus the ring's batch buffers and index arrays (8 bytes per row). Only the first
//    batch after the constructor or a resume waits for a group read (the producer reads
//    the next epoch's first group ahead). The order depends on memory_budget: resume with
//    the same budget.
//  - global, N rows ≤ budget: every rank reads the whole dataset once (collective read of the
//    partitions, then an all-gather); otherwise each batch slice is read from the file:
//    row ids sorted, consecutive runs coalesced, one regular-hyperslab read per run for the
//    features and one hyperslab-union read for the labels. (HDF5 1.10 maps a union of runs
//    to chunks element by element: 2-3x slower than per-run reads for scattered rows.)
// The epoch's permutation (8 bytes per row: of the dataset for global, of the partition for
// local) is kept for two epochs at a time, as the producer works ahead into the next one.
//
// Threads. With MPI_THREAD_MULTIPLE (check with MPI_Query_thread) a producer thread opens the
// file on a dup() of the communicator, does the initial load (collectively, while the
// constructor waits), then reads independently — no collective after the constructor, so a
// rank that runs ahead, finishes its epoch early or stops never waits for another — and
// closes the file (collectively) when the Loader is destroyed. Below MPI_THREAD_MULTIPLE, or
// with background = false, the same reads run synchronously inside next(). HDF5 (Debian's
// build) is not thread-safe: the loader holds hdf5_mutex() around each of its HDF5 calls, and
// other threads must hold it around theirs (checkpoint and model writes) while a Loader
// exists: from the first start_epoch() on, the producer may read at any moment (also ahead
// into the next epoch after the last batch of one, out-of-core modes).
//
// Hand-off. The producer runs under SCHED_BATCH (Linux): woken, it does not preempt the
// thread that woke it, so the consumer is not descheduled inside next() while the producer
// refills the slot next() just freed (with as many busy threads as cores that preemption cost
// ~40 µs a step, 5-7% of the 2-rank Fashion-MNIST step: bench/RESULTS.md). It fills when a
// core frees up or at a scheduler tick. next() wakes it only when it sleeps, outside the lock,
// once the ring is down to half its depth. With paced_producer, next() wakes it only when the
// ring is empty: an idle producer sleeps until the consumer, at its measured pace, should have
// taken the ring down to half (longer while the consumer pauses), so the consumer's thread
// makes no system call while batches are ready (a wake-up cost that thread 31 µs on a VM
// whose other core idled: 14% of an 81 µs step; bench/RESULTS.md). Whenever it idles, the
// producer also computes the next epoch's permutation ahead of that epoch. When the ring is
// empty and the samples are in memory (Residency partition/dataset), next() gathers the batch
// itself (the producer skips that step) instead of waiting for the producer to be scheduled;
// out of core it waits. Either way a batch is the same pure function of (epoch, step),
// whichever thread gathered it.
//
// Wait time: next() measures the time until its batch is ready (the whole read in the
// synchronous mode, the gather when next() gathers it); wait_seconds() sums it.
//
// GPU hooks. host_memory supplies the batch buffers (page-locked memory, so a device backend
// can copy from them asynchronously); they are allocated on the constructing thread, sized for
// the largest batch. In memory, resident() is the block batches are gathered from and each
// batch lists its rows in it (resident_rows), so a device copy of the block can be gathered
// by index; gather_features = false then skips the host copy of the features. peek() shows
// the batch next() hands out next, and peek_next_epoch(), after an epoch's last batch, the next
// epoch's first, each in the memory next() will hand out, so a device copies it in during the
// step before (across an epoch's end too: no epoch starts with a wait for its first copy).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>

#include "locus/comm/mpi.hpp"

namespace locus::train {

enum class Shuffle {
  local,   // a per-epoch permutation inside the rank's partition; no data crosses ranks
  global,  // one permutation of the whole dataset per epoch; rank r takes its slice of every
           // global batch, so N ranks see exactly the batches of a 1-rank run
  none,    // file order (evaluation)
};
Shuffle parse_shuffle(const std::string& s);  // ConfigError naming the allowed values
const char* to_string(Shuffle s);

// Where the ring's batch buffers come from (null in LoaderOptions: the ordinary heap). A CUDA
// backend passes page-locked memory (cudaMallocHost) so it can copy batches asynchronously.
// Called on the thread that constructs the Loader (and, should a batch outgrow its buffer, on
// the producer thread); every allocation is returned before the Loader's destructor ends.
struct HostMemory {
  virtual ~HostMemory() = default;
  // `bytes` > 0; aligned for any of the batch's element types (8 bytes); throws on failure.
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
};

struct LoaderOptions {
  std::string path;
  std::string features = "/features";
  std::string labels = "/labels";     // "" or absent dataset: no labels
  std::int64_t global_batch = 128;     // samples per step over all data-parallel ranks
  Shuffle shuffle = Shuffle::local;
  std::uint64_t seed = 0;
  int prefetch_depth = 4;              // batches in the ring buffer
  std::uint64_t memory_budget = 1ULL << 30;  // bytes of samples a rank may hold
  bool drop_last = false;              // drop the last partial global batch of an epoch
  bool background = true;              // false: read on the calling thread inside next()
  std::shared_ptr<HostMemory> host_memory;  // batch buffers (x, y, ids, rows); null: heap
  // false: batches carry labels, sample_ids and resident_rows but no features (x empty): the
  // device gathers them from its copy of resident(). Only with the samples in memory
  // (Residency partition/dataset), else a ConfigError naming loader.device_cache_mb.
  bool gather_features = true;
  // Threads that copy the rows of one in-memory batch of at least 1 MiB of features: the
  // gathering thread and gather_threads - 1 helpers (a GPU consumes large batches faster than
  // one thread copies them). The batches are the same bytes at any count. 0: the Trainer
  // decides (trainer.cpp, gather_threads); a Loader made directly copies on one thread.
  int gather_threads = 0;
  // true: next() does not wake the idle producer while the ring holds a batch; the producer
  // times its refills from the consumer's pace instead (see "Hand-off" above). For a consumer
  // whose thread drives a device and whose node has cores to spare (the Trainer sets it for a
  // device backend); with every core busy computing, false costs less.
  bool paced_producer = false;
  // Node-local staging (stage.hpp): a directory on every node (node-local SSD, /dev/shm) into
  // which each node copies the rows its ranks read before the first step; batches are then read
  // from that copy. "" reads the source directly.
  std::string stage_dir;
  bool stage_keep = false;  // remove_staged_copy() leaves the copy in place
};

// Where the samples live, decided once from memory_budget, alike on every rank.
enum class Residency {
  partition,  // local/none: this rank's partition, read once
  dataset,    // global: the whole dataset on every rank, read once
  streamed,   // local/none out of core: the partition streamed in window groups
  per_batch,  // global out of core: each batch slice read from the file
};
const char* to_string(Residency r);

// The in-memory block batches are gathered from (Residency partition: this rank's partition,
// its file rows in order; dataset: every row of the file). Empty out of core. Valid while the
// Loader lives; it never changes after the constructor.
struct ResidentData {
  std::int64_t rows = 0;
  std::int64_t cols = 0;
  std::span<const float> x;           // rows × cols
  std::span<const std::int32_t> y;    // rows (empty without labels)
};

// One batch of this rank's rows (rows may be 0 on some ranks for the last partial batch).
struct LoadedBatch {
  std::int64_t epoch = 0, step = 0;    // step within the epoch
  int rows = 0;
  std::span<const float> x;            // rows × cols
  std::span<const std::int32_t> y;     // rows (empty without labels)
  std::span<const std::uint64_t> sample_ids;  // global row indices of the rows
  // For each row, its row in Loader::resident() (x of row i = resident().x row
  // resident_rows[i]); empty out of core.
  std::span<const std::int64_t> resident_rows;
  int global_rows = 0;                 // rows of the global batch (the gradient divisor)
};

// Held by the loader around every HDF5 call it makes; hold it around HDF5 calls made on other
// threads while a Loader exists. Never hold it while waiting for another rank.
std::mutex& hdf5_mutex();

struct StageReport;  // stage.hpp

class Loader {
 public:
  // Collective over comm (the data-parallel communicator): opens the file, validates the
  // options against it and reads what stays in memory. Bad options are ConfigErrors, a
  // missing/malformed file or dataset a DataError naming it; both agreed on every rank.
  Loader(const mpi::Comm& comm, LoaderOptions opts);
  // Collective over comm (closes the file), except while an exception unwinds.
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  std::int64_t rows() const;           // global committed rows
  std::int64_t cols() const;
  bool has_labels() const;
  std::int64_t steps_per_epoch() const;
  Residency residency() const;
  bool threaded() const;               // a background producer (false: synchronous reads)
  ResidentData resident() const;       // the in-memory block (empty out of core)

  // Starts producing the batches of `epoch` from step `first_step` (resume). A pure function
  // of (seed, epoch, step): no other state is needed to resume. Local: no other rank takes
  // part. Invalidates the batch last returned by next(). Once an epoch is fully produced the
  // producer prepares the first batches of epoch + 1 (for none: of whatever epoch comes
  // next, they are alike); start_epoch(epoch + 1) keeps them, any other call discards them.
  // In memory (Residency partition/dataset) epoch 0 is prepared before the first call.
  // ConfigError unless epoch ≥ 0 and 0 ≤ first_step ≤ steps_per_epoch().
  void start_epoch(std::int64_t epoch, std::int64_t first_step = 0);
  // The next batch of the epoch, or nullptr after the last. Valid until the next call.
  // Blocks (and counts data-wait time) while the producer is behind. Rethrows a read error of
  // the producer. Local: no other rank takes part.
  const LoadedBatch* next();
  // The batch the next call of next() returns, when the producer has it ready; else nullptr
  // (never waits or reads; always nullptr without a producer thread). Its memory stays as it
  // is until that next() hands it out and the next() after releases it, or until
  // start_epoch(), so a device may copy it ahead of its step. Local.
  const LoadedBatch* peek();
  // Once next() has handed out the epoch's last batch: the first batch of the epoch after it,
  // when the producer has it ready ahead (see start_epoch()); else nullptr (never waits or
  // reads; always nullptr without a producer thread). start_epoch(epoch + 1) keeps its memory
  // as it is (for shuffle none, any start_epoch(e, 0): those batches are alike) until next()
  // hands it out and the next() after releases it; any other start_epoch() releases it at
  // once, so a device copying it ahead must have finished with the copy before that call.
  // Local.
  const LoadedBatch* peek_next_epoch();

  double wait_seconds() const;         // total time next() waited since construction
  double last_wait_seconds() const;    // wait of the latest next()
  // Batches next() gathered itself because the ring was empty (threaded, in memory).
  std::int64_t consumer_batches() const;
  // What staging did (stage_dir set), the same on every rank; staged = false without it.
  const StageReport& stage_report() const;  // stage.hpp

 private:
  friend struct LoaderTestAccess;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// For tests only: holds the producer back (it finishes the batch in hand, then takes no new
// one until released), so next() gathers in-memory batches itself. Out of core next() would
// wait for the producer forever: release it first. ready_batches: the batches in the ring;
// consumer_wakeups: how often next() has woken the producer; paced_sleeps: how many timed
// sleeps the paced producer has begun.
struct LoaderTestAccess {
  static void hold_producer(Loader& l, bool hold);
  static std::size_t ready_batches(Loader& l);
  static std::int64_t consumer_wakeups(Loader& l);
  static std::int64_t paced_sleeps(Loader& l);
};

}  // namespace locus::train
