// run_inference: validate options, model and input on every rank, then a full run (atomic
// publish) or an incremental run (extend in place behind the watermark), then metrics.
#include "locus/infer/infer.hpp"

#include <sched.h>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <span>

#include "engine.hpp"
#include "input.hpp"
#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/comm/topology.hpp"
#include "locus/comm/watchdog.hpp"
#include "locus/io/publish.hpp"
#include "locus/train/model/blas.hpp"
#include "locus/train/model/model_file.hpp"
#include "pipeline.hpp"
#include "quiet_wait.hpp"

namespace locus::infer {

namespace {

constexpr int kMaxReadThreads = 64;

void check_options(const InferOptions& o, bool output_exists) {
  for (auto [key, value] : {std::pair{"infer.model", &o.model}, std::pair{"infer.input", &o.input},
                            std::pair{"infer.output", &o.output},
                            std::pair{"infer.features", &o.features}}) {
    if (value->empty()) throw ConfigError(fmt::format("option '{}' is empty; set it", key));
  }
  auto canonical = [](const std::string& p) {
    std::error_code ec;
    const std::filesystem::path c = std::filesystem::weakly_canonical(p, ec);
    return ec ? std::filesystem::path(p) : c;
  };
  for (auto [key, path] : {std::pair{"infer.input", &o.input}, std::pair{"infer.model", &o.model}}) {
    if (canonical(*path) == canonical(o.output)) {
      throw ConfigError(fmt::format("infer.output '{}' is the same file as {} '{}'; write the "
                                    "predictions elsewhere", o.output, key, *path));
    }
  }
  if (o.incremental && o.overwrite)
    throw ConfigError("--incremental and --overwrite exclude each other; choose one");
  if (output_exists && !o.overwrite && !o.incremental) {
    throw ConfigError(fmt::format("output '{}' already exists; pass --overwrite to replace it or "
                                  "--incremental to score only rows added since it was written",
                                  o.output));
  }
  if (o.batch_rows < 1) throw ConfigError("infer.batch_rows must be >= 1");
  if (o.read_threads < 0 || o.read_threads > kMaxReadThreads) {
    throw ConfigError(fmt::format("infer.read_threads = {}: expected 0 (automatic) to {}",
                                  o.read_threads, kMaxReadThreads));
  }
  if (o.slow_factor < 1.0) throw ConfigError("infer.slow_factor must be >= 1");
}

OutputKind resolve_kind(const std::string& outputs, train::Loss loss) {
  if (outputs == "auto")
    return loss == train::Loss::mse ? OutputKind::raw : OutputKind::probabilities;
  return parse_output_kind(outputs);
}

// Collective over comm where it splits it (automatic on cuda): infer.read_threads, with 0
// resolved (see InferOptions::read_threads).
int resolve_read_threads(const mpi::Comm& comm, const InferOptions& o, bool cuda) {
  // o and cuda are the same on every rank: either all ranks split the communicator or none.
  if (o.read_threads > 0) return o.read_threads;
  if (!cuda) return detail::auto_read_threads(false, 0);
  const comm::Topology topo(comm);
  cpu_set_t mine, all;
  CPU_ZERO(&mine);
  CPU_ZERO(&all);
  if (::sched_getaffinity(0, sizeof mine, &mine) != 0) CPU_SET(0, &mine);
  // The node's ranks' masks together: bound ranks see only their own cpus, unbound ones all.
  LOCUS_MPI_CHECK(MPI_Allreduce(&mine, &all, sizeof(cpu_set_t), MPI_BYTE, MPI_BOR,
                                topo.node().get()));
  return detail::auto_read_threads(
      cuda, detail::cpu_share(CPU_COUNT(&mine), CPU_COUNT(&all), topo.node().size()));
}

// Everything both kinds of run share once the options, model and input are validated.
struct Job {
  const mpi::Comm& comm;
  const InferOptions& opts;
  const train::Mlp& model;
  detail::EngineChoice engine;
  int read_threads = 1;
  detail::InputInfo input;
  PredictionLayout layout;
  PredictionProvenance prov;
  const io::OutputLock& lock;  // of opts.output, held by the whole run
};

struct Scored {
  detail::LoopResult loop;
  std::string read;            // how this rank read the features
  WorkQueue::Summary queue;
  double seconds = 0;          // first claim to durable output (or to publication)
  double seconds_durable = 0;  // of which: the watermark's flushes and fsyncs, the publication
};

// Collective: scores rows [begin, end) into `out` and advances the watermark (sync: durably,
// for a file extended in place).
Scored score_rows(const Job& job, PredictionFile& out, std::uint64_t begin, std::uint64_t end,
                  bool sync, const char* hook_point) {
  const mpi::Comm& comm = job.comm;
  const std::unique_ptr<detail::Engine> engine = detail::make_engine(
      job.engine, job.model,
      {.kind = job.layout.kind, .top_k = job.layout.top_k,
       .batch_rows = static_cast<int>(job.layout.batch_rows)});
  // Every rank reads its units through its own read-only handle: no collective on the input.
  const bool labelled = job.input.has_labels && job.layout.kind == OutputKind::probabilities;
  detail::LocalInput in(job.opts.input, job.opts.features, labelled ? job.opts.labels : "",
                        job.read_threads);
  const detail::UnitGrid grid{begin, end, job.layout.unit_rows};
  const auto& slow = job.opts.slow_ranks;
  const bool is_slow = std::find(slow.begin(), slow.end(), comm.rank()) != slow.end();
  comm.barrier();
  const double t0 = MPI_Wtime();
  Scored res;
  res.read = in.read_method();
  WorkQueue queue(comm, grid.units(), job.opts.speculate, 2, job.opts.schedule);
  comm::ProgressTicker ticker(job.opts.progress_s, static_cast<std::int64_t>(end - begin),
                              job.opts.on_progress);
  res.loop = detail::run_units(queue, grid, *engine, in, out, comm.rank(),
                               is_slow ? detail::SlowDown{job.opts.slow_factor, job.opts.slow_ms}
                                       : detail::SlowDown{},
                               job.opts.read_rows, ticker);
  res.queue = queue.finish([&] { ticker.poll(queue); });
  if (res.queue.written_once != res.queue.units) {
    throw InternalError(fmt::format("{} of {} units were written exactly once ({} never, {} "
                                    "more than once): a work-queue bug",
                                    res.queue.written_once, res.queue.units,
                                    res.queue.unwritten, res.queue.written_twice));
  }
  const double t_commit = MPI_Wtime();
  if (job.opts.on_commit) {
    comm::progress("the commit phase begins: its line, the Prometheus file (rank 0)");
    const auto rows = static_cast<std::int64_t>(end - begin);
    job.opts.on_commit({{res.queue.units, res.queue.units, rows, res.queue.extra_runs}, rows,
                        ticker.seconds()});
  }
  comm::progress("committing the rows of {} (collective)", job.opts.output);
  out.commit_rows(end, sync, hook_point);
  res.seconds_durable = MPI_Wtime() - t_commit;
  res.seconds = MPI_Wtime() - t0;
  return res;
}

// Collective: sums the metrics of every rank, the log-loss in unit order so the result does
// not depend on which rank won which unit.
std::optional<Metrics> reduce_metrics(const mpi::Comm& comm, detail::LoopResult& loop,
                                      bool labelled) {
  if (!labelled) return std::nullopt;
  Metrics m = loop.metrics;
  std::array<std::int64_t, 3> counts{m.rows, m.correct, m.out_of_range};
  comm.allreduce_inplace(std::span<std::int64_t>(counts), MPI_SUM);
  comm.allreduce_inplace(std::span<std::int64_t>(m.confusion), MPI_SUM);
  comm.allreduce_inplace(std::span<double>(loop.unit_loss), MPI_SUM);  // one non-zero per unit
  m.rows = counts[0];
  m.correct = counts[1];
  m.out_of_range = counts[2];
  m.log_loss_sum = std::accumulate(loop.unit_loss.begin(), loop.unit_loss.end(), 0.0);
  return m;
}

Scored run_full(const Job& job) {
  io::Publication pub(job.comm, job.opts.output, job.lock);
  Scored s;
  {
    h5::File file = h5::File::create(job.comm, pub.temp_path());
    {
      PredictionFile out = PredictionFile::create(file, job.layout, job.prov, job.input.rows);
      // No fsync of the watermark: nobody sees the temporary file, and the publication fsyncs
      // it (once, data and metadata together) before the rename.
      s = score_rows(job, out, 0, job.input.rows, /*sync=*/false, nullptr);
    }
    mpi::agree_on(job.comm, [&] { file.close(); });
  }
  test_hook("infer-before-publish");
  comm::progress("publishing {} (collective)", job.opts.output);
  const double t_publish = MPI_Wtime();
  // Rank 0 makes the file durable while the others sleep; the publication's own fsync then finds
  // nothing left to write, so its spinning collective is short (see quiet_wait.hpp).
  detail::on_root_quietly(job.comm, [&] { io::fsync_path(pub.temp_path(), false); });
  pub.commit();
  const double publish = MPI_Wtime() - t_publish;
  s.seconds += publish;
  s.seconds_durable += publish;
  return s;
}

Scored run_incremental(Job& job, std::uint64_t& begin) {
  h5::File file = h5::File::open(job.comm, job.opts.output, h5::File::Mode::read_write);
  Scored s;
  {
    PredictionFile out = PredictionFile::open(file);
    const PredictionLayout& have = out.layout();
    mpi::agree_on(job.comm, [&] {
      const std::string& path = job.opts.output;
      if (out.provenance().model_fingerprint != job.prov.model_fingerprint) {
        throw DataError(fmt::format("--incremental: '{}' was scored with model '{}' (fingerprint "
                                    "{}), not with '{}' (fingerprint {}); pass --overwrite to "
                                    "score every row with the new model", path,
                                    out.provenance().model, out.provenance().model_fingerprint,
                                    job.opts.model, job.prov.model_fingerprint));
      }
      // The fingerprint can match while num_outputs does not (a damaged or edited file); the
      // rows written below have the model's width, so a mismatch must stop here.
      if (have.outputs != job.layout.outputs) {
        throw DataError(fmt::format("--incremental: '{}' holds {} outputs per row but model '{}' "
                                    "has {}: the file is damaged or not this model's; pass "
                                    "--overwrite", path, have.outputs, job.opts.model,
                                    job.layout.outputs));
      }
      if (have.kind != job.layout.kind || have.top_k != job.layout.top_k) {
        throw ConfigError(fmt::format("--incremental: '{}' holds {} with top_k = {}, but this "
                                      "run asks for {} with top_k = {}; match its settings or "
                                      "pass --overwrite", path, to_string(have.kind), have.top_k,
                                      to_string(job.layout.kind), job.layout.top_k));
      }
      if (out.committed_rows() > job.input.rows) {
        throw DataError(fmt::format("--incremental: '{}' has {} rows scored but input '{}' has "
                                    "only {}: the input was replaced; pass --overwrite",
                                    path, out.committed_rows(), job.opts.input, job.input.rows));
      }
    });
    job.layout = have;  // unit and batch grid of the existing rows
    begin = out.committed_rows();
    if (out.rows() < job.input.rows) out.resize(job.input.rows);
    out.write_provenance(job.prov);
    s = score_rows(job, out, begin, job.input.rows, /*sync=*/true, "infer-before-watermark");
  }
  mpi::agree_on(job.comm, [&] { file.close(); });
  return s;
}

}  // namespace

std::vector<std::string> unused_settings(const InferOptions& o) {
  std::vector<std::string> notes;
  // The cuda engine's products are cuBLASLt and its softmax, argmax and top-k are kernels: the
  // host's BLAS serves the cpu engine only.
  if (o.backend == "cuda" && o.blas_threads != InferOptions{}.blas_threads) {
    notes.push_back(fmt::format("infer.blas_threads = {} sets the host BLAS's threads, which "
                                "infer.backend = cuda does not use: it scores on the GPU",
                                o.blas_threads));
  }
  return notes;
}

std::uint64_t choose_unit_rows(std::uint64_t chunk_rows, std::uint64_t batch_rows,
                               std::uint64_t target) {
  chunk_rows = std::max<std::uint64_t>(chunk_rows, 1);
  batch_rows = std::max<std::uint64_t>(batch_rows, 1);
  const std::uint64_t lo = std::max<std::uint64_t>(1, target / 2 / chunk_rows);
  const std::uint64_t hi = std::max(lo, 2 * target / chunk_rows);
  std::uint64_t best = lo * chunk_rows;
  double best_waste = 2.0;
  for (std::uint64_t k = lo; k <= hi; ++k) {
    const std::uint64_t u = k * chunk_rows;
    const std::uint64_t padded = (u + batch_rows - 1) / batch_rows * batch_rows;
    // Padding share, plus a small preference for sizes near the target.
    const double waste = static_cast<double>(padded - u) / static_cast<double>(u) +
                         0.01 * std::abs(std::log2(static_cast<double>(u) / target));
    if (waste < best_waste) {
      best_waste = waste;
      best = u;
    }
  }
  return best;
}

InferResult run_inference(const mpi::Comm& comm, const InferOptions& opts) {
  const double t_start = MPI_Wtime();
  bool exists = io::output_exists(comm, opts.output);
  mpi::agree_on(comm, [&] {
    check_options(opts, exists);
    train::set_blas_threads(opts.blas_threads);
  });
  // Held until the report is written, so no other job writes the output meanwhile; whether the
  // output exists is looked at again under it (another job may have published it meanwhile).
  const io::OutputLock lock = io::OutputLock::acquire(comm, opts.output, "infer.output");
  exists = io::output_exists(comm, opts.output);
  mpi::agree_on(comm, [&] { check_options(opts, exists); });
  // Collective (the node-local split that picks a GPU), so outside the check above.
  detail::EngineChoice engine;
  mpi::agree_on(comm, [&] { engine = detail::choose_engine(comm, opts); });
  train::ModelInfo info;
  const train::Mlp model = train::read_model_file(comm, opts.model, &info);
  const double seconds_init = MPI_Wtime() - t_start;
  const detail::InputInfo input = detail::inspect_input(comm, opts, model, opts.model);
  OutputKind kind{};
  mpi::agree_on(comm, [&] {
    kind = resolve_kind(opts.outputs, info.loss);
    check_score_spec({.kind = kind, .top_k = opts.top_k, .batch_rows = opts.batch_rows},
                     model.layout().output_width());
  });
  const auto batch = static_cast<std::uint64_t>(opts.batch_rows);
  const int read_threads = resolve_read_threads(comm, opts, engine.cuda);
  Job job{comm, opts, model, engine, read_threads, input,
          {.kind = kind, .outputs = model.layout().output_width(), .top_k = opts.top_k,
           .record_writer = opts.record_writer,
           .unit_rows = opts.unit_rows > 0 ? opts.unit_rows
                                           : choose_unit_rows(input.chunk_rows, batch),
           .batch_rows = batch},
          {.model = opts.model, .model_fingerprint = detail::model_fingerprint(model),
           .model_trained_steps = info.trained_steps, .input = opts.input,
           .features = opts.features, .config = opts.effective_config},
          lock};

  InferResult r;
  r.incremental = opts.incremental && exists;
  Scored s = r.incremental ? run_incremental(job, r.row_begin) : run_full(job);
  r.row_end = input.rows;
  r.input_rows = input.rows;
  r.features = model.layout().input_width();
  r.outputs = model.layout().output_width();
  r.kind = job.layout.kind;
  r.top_k = job.layout.top_k;
  r.unit_rows = job.layout.unit_rows;
  r.batch_rows = job.layout.batch_rows;
  r.units = s.queue.units;
  r.units_written_once = s.queue.written_once;
  r.speculative_runs = s.queue.extra_runs;
  r.ranks.resize(static_cast<std::size_t>(comm.size()));
  LOCUS_MPI_CHECK(MPI_Allgather(&s.loop.stats, sizeof(RankStats), MPI_BYTE, r.ranks.data(),
                                sizeof(RankStats), MPI_BYTE, comm.get()));
  r.metrics = reduce_metrics(comm, s.loop, input.has_labels && kind == OutputKind::probabilities);
  r.seconds = s.seconds;
  r.seconds_durable = s.seconds_durable;
  r.compute = engine.description;
  r.read = s.read;
  r.report_path = opts.report.empty() ? opts.output + ".report.json" : opts.report;
  r.seconds_init = seconds_init;
  r.seconds_total = MPI_Wtime() - t_start;
  const std::string json = report_json(opts, r);
  mpi::agree_on(comm, [&] {
    if (!comm.is_root()) return;
    const std::string tmp = r.report_path + ".tmp";  // under the output's lock
    std::FILE* f = std::fopen(tmp.c_str(), "w");
    bool ok = f != nullptr && std::fputs(json.c_str(), f) >= 0 && std::fputc('\n', f) >= 0;
    if (f != nullptr) ok = std::fclose(f) == 0 && ok;
    if (!ok || std::rename(tmp.c_str(), r.report_path.c_str()) != 0) {
      throw IoError(fmt::format("cannot write the report '{}'; the predictions in '{}' are "
                                "complete", r.report_path, opts.output));
    }
  });
  return r;
}

}  // namespace locus::infer
