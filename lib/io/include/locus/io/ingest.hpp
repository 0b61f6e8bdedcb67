// The ingest pipeline behind locus-ingest: the input is cut into units handed out dynamically
// through lib/comm's one-sided work queue (idle ranks re-run units still in flight on slower
// ranks; the first result wins), statistics are merged per unit in unit order, quality gates
// run before anything is written, each rank writes the units it won in one collective write,
// and the dataset is published atomically (or appended to a copy that replaces the original).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "locus/comm/mpi.hpp"
#include "locus/comm/queue_progress.hpp"
#include "locus/comm/work_queue.hpp"
#include "locus/io/csv.hpp"
#include "locus/io/dataset_file.hpp"
#include "locus/io/gates.hpp"
#include "locus/io/idx.hpp"
#include "locus/io/join.hpp"
#include "locus/io/stats.hpp"

namespace locus::io {

// A phase of the job after the parse, as it begins (IngestOptions::on_phase), with what the
// phase before it did: a large ingest spends minutes checking its gates and writing after its
// last progress line, and this is how a person watching it learns where it is.
struct IngestPhase {
  enum class Kind {
    gates,   // the parse is done: checking the rows against the quality gates (collective)
    write,   // the gates passed: writing the rows (collective rounds; an append copies first)
    commit,  // the rows written: making the file durable and publishing it
  };
  Kind kind = Kind::gates;
  std::int64_t cols = 0;         // features a row
  double seconds_before = 0;     // the phase before this one: parse, gates or write
  // The parse's final figures: every unit done, its rows (kept: non-finite rows dropped), its
  // re-runs.
  comm::QueueProgress parse;
};
// "gates", "write", "commit": the names of the Prometheus file's phase series.
const char* phase_name(IngestPhase::Kind kind);
// Every phase of an ingest in order, the parse first: "parse", "gates", "write", "commit".
const std::vector<std::string>& ingest_phases();

struct IngestOptions {
  enum class Source { idx, csv };
  Source source = Source::idx;
  IdxOptions idx;
  CsvOptions csv;
  // ingest.join (CSV only): a small table broadcast to every rank whose columns are added to
  // each row by its key; rows whose key it lacks are left out and judged by the join_missing
  // gate (GateConfig::drop_join_missing). The table is recorded as a source after the input.
  JoinOptions join;
  std::string output;              // final dataset path
  std::string report;              // gate report (JSON); "" → "<output>.gates.json"
  Normalization normalize = Normalization::none;
  std::int64_t num_classes = 0;    // recorded; with gates it bounds the labels
  std::uint64_t chunk_rows = 0;    // 0 → default_chunk_rows (about 1 MiB, 256 KiB compressed)
  Compression compression;         // of a new dataset; an append keeps the dataset's own
  GateConfig gates;
  std::string reference;           // reference dataset for record-count and drift gates
  bool validate_only = false;      // run the gates, write only the report
  bool append = false;             // add rows to an existing output
  bool overwrite = false;          // replace an existing output
  std::string effective_config;    // recorded in the provenance
  // Units of work: about unit_bytes of input each (0: auto_unit_bytes, 1-16 MiB). The output
  // and its statistics do not depend on the schedule, the rank count or speculation; they do
  // depend on unit_bytes (the statistics merge per unit, in unit order).
  std::uint64_t unit_bytes = 0;
  comm::Schedule schedule = comm::Schedule::dynamic;  // static_blocks: rank r parses block r
  bool speculate = true;           // idle ranks re-run units still in flight elsewhere
  // Progress while parsing: every progress_s seconds (0: never) on the ranks given a sink (the
  // app: rank 0), the queue's counters with the amounts in rows parsed (the total is not known
  // ahead for CSV, so none is given; comm::describe words them).
  double progress_s = 0;
  comm::ProgressTicker::Sink on_progress;
  // Called on every rank where set as each phase after the parse begins (the app sets it on
  // rank 0 only); validate_only stops after the gates, and a failed gate before the write.
  std::function<void(const IngestPhase&)> on_phase;
};

// What one rank did in the parse phase; runs are counted when started.
struct IngestRankStats {
  std::int64_t claimed = 0;     // fresh units taken from the queue
  std::int64_t reruns = 0;      // speculative re-runs of units another rank was parsing
  std::int64_t won = 0;         // units whose result this rank kept (and writes)
  std::int64_t rerun_wins = 0;  // re-runs that finished first
  std::int64_t abandoned = 0;   // runs dropped because another rank finished the unit first
  std::int64_t rows = 0;        // rows of the units won
  double seconds = 0;           // wall time of this rank's unit loop
};

struct IngestSchedule {
  std::int64_t units = 0;
  std::uint64_t unit_bytes = 0;
  comm::Schedule schedule = comm::Schedule::dynamic;
  bool speculate = true;                  // as run (false under the static schedule)
  std::vector<IngestRankStats> per_rank;  // every rank's, on every rank
};

struct IngestResult {
  GateReport report;
  DatasetMeta meta;                // of the published dataset (after an append: of the whole)
  std::int64_t rows_added = 0;
  std::uint64_t input_bytes = 0;   // bytes of the input files (as stored)
  double seconds_parse = 0, seconds_gates = 0, seconds_write = 0;
  bool published = false;
  IngestSchedule schedule;         // who parsed which units (also in the gate report)
  Compression compression;         // of the published dataset's /features (read back)
  // --append only: the inputs are already the dataset's last recorded sources (same paths,
  // sizes and CRC-32s), i.e. this append was done before, typically by a run that was killed
  // or preempted after its publication and then rerun. Nothing was read or written.
  bool already_appended = false;
};

// Collective over comm. Throws GateError (agreed, after writing the JSON report) when a gate
// fails; ConfigError/DataError/IoError for bad options, inputs or outputs. Publishes nothing
// unless every gate passed and every rank wrote its rows.
IngestResult run_ingest(const mpi::Comm& comm, const IngestOptions& opts);

// Collective over comm: opens a published dataset and reads its metadata.
DatasetMeta read_dataset_meta(const mpi::Comm& comm, const std::string& path);

}  // namespace locus::io
