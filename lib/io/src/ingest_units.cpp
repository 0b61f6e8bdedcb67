// The unit loop of locus-ingest: claim a unit, parse it onto this rank's table, drop non-finite
// rows and summarise it, then keep it only if this rank finished it first; afterwards put the
// rank's units in unit order and agree on errors, row positions and statistics.
#include "ingest_units.hpp"

#include <time.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <optional>
#include <span>

#include <fmt/format.h>
#include <mpi.h>

#include "locus/comm/agree.hpp"
#include "locus/comm/test_hook.hpp"
#include "locus/comm/watchdog.hpp"

namespace locus::io::detail {

namespace {

// One unit this rank parsed first: its rows sit in the rank's table (in-order units) or in a
// piece of their own (a re-run won after higher units, put in place once the loop is over).
struct Won {
  std::int64_t unit = 0;
  std::int64_t local_begin = 0;  // first row in the table (once assembled)
  std::int64_t rows = 0;
  std::int64_t lines = 0;
  std::int64_t dropped = 0;
  std::optional<UnitError> error;
  std::int64_t join_missing = 0;
  std::optional<JoinMiss> first_missing;
  FeatureStats stats;
  std::optional<Table> piece;    // rows of a unit won out of order
};

void truncate_rows(Table& t, std::int64_t rows) {
  t.features.resize(static_cast<std::size_t>(rows * t.cols));
  if (t.has_labels) t.labels.resize(static_cast<std::size_t>(rows));
}

// Waits `seconds` in 1 ms slices, as a slower rank would still be working; false as soon as
// keep_going() says the unit is moot (another rank finished it).
template <class KeepGoing>
bool slow_wait(double seconds, KeepGoing&& keep_going) {
  const double end = MPI_Wtime() + seconds;
  for (double now = MPI_Wtime(); now < end; now = MPI_Wtime()) {
    if (!keep_going()) return false;
    const double step = std::min(1e-3, end - now);
    const timespec pause{0, static_cast<long>(step * 1e9)};
    ::nanosleep(&pause, nullptr);
  }
  return true;
}

// Puts the units won out of order (their own pieces) between the in-order ones, in place:
// walking from the last unit down, every block moves only upwards into space nothing still
// needs. Afterwards t holds every won unit in unit order and local_begin says where.
void assemble(Table& t, std::vector<Won>& won) {
  std::sort(won.begin(), won.end(), [](const Won& a, const Won& b) { return a.unit < b.unit; });
  if (std::none_of(won.begin(), won.end(), [](const Won& w) { return w.piece.has_value(); }))
    return;
  std::int64_t total = 0;
  std::vector<std::int64_t> dest(won.size());
  for (std::size_t i = 0; i < won.size(); ++i) dest[i] = total, total += won[i].rows;
  const auto d = static_cast<std::size_t>(t.cols);
  t.features.resize(static_cast<std::size_t>(total) * d);
  if (t.has_labels) t.labels.resize(static_cast<std::size_t>(total));
  for (std::size_t i = won.size(); i-- > 0;) {
    Won& w = won[i];
    const auto n = static_cast<std::size_t>(w.rows);
    const auto to = static_cast<std::size_t>(dest[i]);
    if (w.piece) {
      std::copy_n(w.piece->features.begin(), n * d, t.features.begin() + static_cast<std::ptrdiff_t>(to * d));
      if (t.has_labels)
        std::copy_n(w.piece->labels.begin(), n, t.labels.begin() + static_cast<std::ptrdiff_t>(to));
      w.piece.reset();
    } else {
      LOCUS_ASSERT(w.local_begin <= dest[i], "an in-order unit would move down");
      const auto from = static_cast<std::size_t>(w.local_begin);
      std::memmove(t.features.data() + to * d, t.features.data() + from * d, n * d * sizeof(float));
      if (t.has_labels)
        std::memmove(t.labels.data() + to, t.labels.data() + from, n * sizeof(std::int32_t));
    }
    w.local_begin = dest[i];
  }
}

class UnitLoop {
 public:
  UnitLoop(const mpi::Comm& comm, UnitSource& src, const UnitLoopOptions& opts)
      : src_(src), opts_(opts), queue_(comm, src.units(), opts.speculate, 2, opts.schedule),
        ticker_(opts.progress_s, 0, opts.on_progress), slow_(test_hook_slowdown("ingest-unit")),
        d_(static_cast<std::size_t>(src.header().cols)) {
    table_ = src.header();
  }

  void run() {
    const double t0 = MPI_Wtime();
    while (true) {
      ticker_.poll(queue_);
      comm::progress("claiming an ingest unit (the work queue's one-sided counter)");
      const comm::WorkQueue::Claim c = queue_.claim({});
      if (c.unit < 0) break;
      ++(c.speculative ? stats_.reruns : stats_.claimed);
      if (c.speculative && queue_.finished(c.unit)) {  // finished since the claim
        ++stats_.abandoned;
        continue;
      }
      comm::progress("parsing ingest unit {}{}", c.unit, c.speculative ? " (a re-run)" : "");
      run_unit(c.unit, c.speculative);
      if (!held_) {  // a test may hold the job here, mid-run (LOCUS_TEST_HOLD)
        held_ = true;
        test_hold("ingest-first-unit", [&] {
          ticker_.poll(queue_);
          queue_.progress();
        });
      }
    }
    stats_.seconds = MPI_Wtime() - t0;
  }

  comm::WorkQueue& queue() { return queue_; }
  comm::ProgressTicker& ticker() { return ticker_; }
  Table& table() { return table_; }
  std::vector<Won>& won() { return won_; }
  IngestRankStats& stats() { return stats_; }

 private:
  // Parses one unit; keeps it when this rank finishes it first.
  void run_unit(std::int64_t unit, bool speculative) {
    const bool in_order = unit > last_in_order_;
    Won w;
    w.unit = unit;
    if (!in_order) w.piece = src_.header();
    Table& dst = in_order ? table_ : *w.piece;
    const std::int64_t mark = dst.rows();
    // Between chunks: let other ranks' one-sided requests progress here, and stop when
    // another rank already finished this unit.
    const auto keep_going = [&] {
      ticker_.poll(queue_);
      if (queue_.solo()) return true;
      queue_.progress();
      return !(queue_.speculating() && queue_.finished(unit));
    };
    const double w0 = MPI_Wtime();
    const UnitParse p = src_.parse(unit, dst, keep_going);
    bool moot = p.abandoned;
    w.lines = p.lines;
    w.error = p.error;
    w.join_missing = p.join_missing;
    w.first_missing = p.first_missing;
    if (!moot) {
      if (w.error) truncate_rows(dst, mark);  // the job fails; the rows do not count
      w.dropped = opts_.drop_nonfinite ? nonfinite_rows(dst, mark, true) : 0;
      w.rows = dst.rows() - mark;
      w.stats = row_stats(std::span<const float>(dst.features).subspan(
                              static_cast<std::size_t>(mark) * d_), d_);
    }
    if (!moot && slow_.active())
      moot = !slow_wait((slow_.factor - 1) * (MPI_Wtime() - w0) + slow_.extra_ms * 1e-3, keep_going);
    if (moot || !queue_.try_win(unit, w.rows)) {
      truncate_rows(dst, mark);
      ++stats_.abandoned;
      return;
    }
    queue_.wrote(unit);  // the exactly-once check: this result is the unit's
    ++stats_.won;
    stats_.rerun_wins += speculative;
    stats_.rows += w.rows;
    w.local_begin = mark;
    if (in_order) last_in_order_ = unit;
    won_.push_back(std::move(w));
  }

  UnitSource& src_;
  UnitLoopOptions opts_;
  comm::WorkQueue queue_;
  comm::ProgressTicker ticker_;
  SlowDown slow_;
  bool held_ = false;  // past the test hold point
  std::size_t d_;
  Table table_;
  std::vector<Won> won_;
  std::int64_t last_in_order_ = -1;
  IngestRankStats stats_;
};

// Collective: the lowest unit with an error, thrown on every rank (its owner words it).
void agree_on_errors(const mpi::Comm& comm, const UnitSource& src, const std::vector<Won>& won,
                     std::span<const std::int64_t> lines) {
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
  std::int64_t mine = kNone;
  for (const Won& w : won)
    if (w.error) mine = std::min(mine, w.unit);
  const std::int64_t first = comm.allreduce(mine, MPI_MIN);
  if (first == kNone) return;
  mpi::agree_on(comm, [&] {
    if (mine != first) return;
    const auto it = std::find_if(won.begin(), won.end(), [&](const Won& w) { return w.unit == first; });
    std::int64_t before = 0;
    for (std::int64_t u = 0; u < first; ++u) before += lines[static_cast<std::size_t>(u)];
    throw_error(it->error->kind, src.describe(*it->error, before), false);
  });
}

// Collective: "'in.csv' line 57: key 'x'", the first row of the input (in unit order) whose
// join key the join table lacks, on every rank; "" when there is none.
std::string first_join_miss(const mpi::Comm& comm, const UnitSource& src,
                            const std::vector<Won>& won, std::span<const std::int64_t> missing,
                            std::span<const std::int64_t> lines) {
  const auto first = std::find_if(missing.begin(), missing.end(), [](std::int64_t m) { return m > 0; });
  if (first == missing.end()) return {};
  const std::int64_t unit = first - missing.begin();
  const auto it = std::find_if(won.begin(), won.end(), [&](const Won& w) { return w.unit == unit; });
  const int owner = comm.allreduce(it != won.end() ? comm.rank() : comm.size(), MPI_MIN);
  std::string text;
  if (it != won.end() && owner == comm.rank()) {
    LOCUS_ASSERT(it->first_missing.has_value(), "a unit with join misses has no first miss");
    std::int64_t before = 0;
    for (std::int64_t u = 0; u < unit; ++u) before += lines[static_cast<std::size_t>(u)];
    text = src.describe(UnitError{ErrorKind::data, fmt::format("key '{}'", it->first_missing->key),
                                  it->first_missing->line},
                        before);
  }
  return comm.bcast(std::move(text), owner);
}

std::vector<IngestRankStats> gather_stats(const mpi::Comm& comm, const IngestRankStats& s) {
  constexpr int kFields = 7;
  const std::array<double, kFields> mine{
      static_cast<double>(s.claimed), static_cast<double>(s.reruns), static_cast<double>(s.won),
      static_cast<double>(s.rerun_wins), static_cast<double>(s.abandoned),
      static_cast<double>(s.rows), s.seconds};
  std::vector<double> all(static_cast<std::size_t>(kFields * comm.size()));
  LOCUS_MPI_CHECK(MPI_Allgather(mine.data(), kFields, MPI_DOUBLE, all.data(), kFields,
                                MPI_DOUBLE, comm.get()));
  std::vector<IngestRankStats> out(static_cast<std::size_t>(comm.size()));
  for (std::size_t r = 0; r < out.size(); ++r) {
    const double* f = all.data() + r * kFields;
    const auto i = [&](int k) { return static_cast<std::int64_t>(f[k]); };
    out[r] = {i(0), i(1), i(2), i(3), i(4), i(5), f[6]};
  }
  return out;
}

}  // namespace

ParsedUnits parse_units(const mpi::Comm& comm, UnitSource& src, const UnitLoopOptions& opts) {
  UnitLoop loop(comm, src, opts);
  loop.run();
  const comm::WorkQueue::Summary q =
      loop.queue().finish([&] { loop.ticker().poll(loop.queue()); });
  if (q.written_once != q.units) {
    throw InternalError(fmt::format("{} of {} ingest units were kept exactly once ({} never, {} "
                                    "more than once): a work-queue bug",
                                    q.written_once, q.units, q.unwritten, q.written_twice));
  }
  ParsedUnits res;
  res.seconds = loop.ticker().seconds();
  std::vector<Won>& won = loop.won();
  assemble(loop.table(), won);
  res.table = std::move(loop.table());

  // Per unit, from its winner: rows (after dropping), lines, dropped rows.
  const std::int64_t units = src.units();
  const auto n = static_cast<std::size_t>(units);
  std::vector<std::int64_t> info(4 * n, 0);
  for (const Won& w : won) {
    const auto u = static_cast<std::size_t>(w.unit);
    info[u] = w.rows;
    info[n + u] = w.lines;
    info[2 * n + u] = w.dropped;
    info[3 * n + u] = w.join_missing;
  }
  comm.allreduce_inplace(std::span<std::int64_t>(info), MPI_SUM);
  agree_on_errors(comm, src, won, std::span<const std::int64_t>(info).subspan(n, n));

  std::vector<std::int64_t> first_row(n + 1, 0);
  for (std::size_t u = 0; u < n; ++u) {
    first_row[u + 1] = first_row[u] + info[u];
    res.dropped += info[2 * n + u];
    res.join_missing += info[3 * n + u];
  }
  res.join_missing_first = first_join_miss(comm, src, won,
                                           std::span<const std::int64_t>(info).subspan(3 * n, n),
                                           std::span<const std::int64_t>(info).subspan(n, n));
  res.rows = first_row[n];
  mpi::agree_on(comm, [&] { src.check_total_rows(res.rows); });

  std::vector<UnitStats> mine;
  mine.reserve(won.size());
  for (Won& w : won) {
    const std::int64_t begin = first_row[static_cast<std::size_t>(w.unit)];
    if (w.rows > 0) {
      res.runs.push_back({w.local_begin, begin});
      const auto b = static_cast<std::uint64_t>(begin);
      if (!res.file_rows.empty() && res.file_rows.back().end() == b) {
        res.file_rows.back().count += static_cast<std::uint64_t>(w.rows);
      } else {
        res.file_rows.push_back({b, static_cast<std::uint64_t>(w.rows)});
      }
    }
    mine.push_back({w.unit, std::move(w.stats)});
  }
  res.stats = merge_in_unit_order(comm, units, static_cast<std::size_t>(src.header().cols), mine);

  res.schedule.units = units;
  res.schedule.unit_bytes = src.unit_bytes();
  res.schedule.schedule = opts.schedule;
  res.schedule.speculate = loop.queue().speculating();
  res.schedule.per_rank = gather_stats(comm, loop.stats());
  return res;
}

}  // namespace locus::io::detail
