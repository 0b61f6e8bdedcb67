// The JSON report of an inference run: rows, timing, per-rank work and speculation, and the
// label metrics (accuracy, log-loss, confusion matrix).
#include <fmt/format.h>

#include "locus/infer/infer.hpp"
#include "locus/io/json.hpp"

namespace locus::infer {

namespace {

void rank_json(io::JsonWriter& w, int rank, const RankStats& s) {
  w.begin_object();
  w.key("rank").value(rank);
  w.key("units_written").value(s.written).key("rows_written").value(s.rows);
  w.key("units_claimed").value(s.claimed);
  w.key("speculative_runs").value(s.speculative).key("speculative_wins").value(s.speculative_wins);
  w.key("abandoned_runs").value(s.abandoned);
  w.key("seconds_read").value(s.seconds_read).key("seconds_compute").value(s.seconds_compute);
  w.key("seconds_write").value(s.seconds_write).key("seconds_wait").value(s.seconds_wait);
  w.key("seconds_idle").value(s.seconds_idle);
  w.key("cpu_seconds_compute").value(s.cpu_seconds_compute).key("cpu_seconds").value(s.cpu_seconds);
  w.end_object();
}

void metrics_json(io::JsonWriter& w, const Metrics& m, int classes) {
  w.begin_object();
  w.key("rows").value(m.rows);
  w.key("accuracy").value(m.rows > 0 ? static_cast<double>(m.correct) / m.rows : 0.0);
  w.key("log_loss").value(m.rows > 0 ? m.log_loss_sum / static_cast<double>(m.rows) : 0.0);
  w.key("correct").value(m.correct);
  w.key("labels_out_of_range").value(m.out_of_range);
  w.key("classes").value(classes);
  w.key("confusion").begin_array();  // rows: true class, columns: predicted class
  for (int t = 0; t < classes; ++t) {
    w.begin_array();
    for (int p = 0; p < classes; ++p)
      w.value(m.confusion[static_cast<std::size_t>(t) * static_cast<std::size_t>(classes) +
                          static_cast<std::size_t>(p)]);
    w.end_array();
  }
  w.end_array();
  w.end_object();
}

}  // namespace

std::string report_json(const InferOptions& opts, const InferResult& r) {
  io::JsonWriter w(2);
  const auto rows = static_cast<std::int64_t>(r.row_end - r.row_begin);
  w.begin_object();
  w.key("output").value(opts.output).key("model").value(opts.model);
  w.key("input").value(opts.input).key("features").value(opts.features);
  w.key("mode").value(r.incremental ? "incremental" : "full");
  w.key("row_begin").value(static_cast<std::int64_t>(r.row_begin));
  w.key("row_end").value(static_cast<std::int64_t>(r.row_end));
  w.key("rows_scored").value(rows);
  w.key("features_per_row").value(r.features).key("outputs").value(r.outputs);
  w.key("kind").value(std::string(to_string(r.kind))).key("top_k").value(r.top_k);
  w.key("ranks").value(static_cast<int>(r.ranks.size()));
  w.key("unit_rows").value(static_cast<std::int64_t>(r.unit_rows));
  w.key("batch_rows").value(static_cast<std::int64_t>(r.batch_rows));
  w.key("units").value(r.units).key("units_written_once").value(r.units_written_once);
  w.key("schedule").value(opts.schedule == Schedule::dynamic ? "dynamic" : "static");
  w.key("speculation").value(opts.speculate && opts.schedule == Schedule::dynamic);
  w.key("speculative_runs").value(r.speculative_runs);
  std::int64_t wins = 0;
  for (const RankStats& s : r.ranks) wins += s.speculative_wins;
  w.key("speculative_wins").value(wins);
  w.key("seconds").value(r.seconds).key("seconds_durable").value(r.seconds_durable);
  w.key("seconds_total").value(r.seconds_total);
  w.key("rows_per_second").value(r.seconds > 0 ? static_cast<double>(rows) / r.seconds : 0.0);
  w.key("per_rank").begin_array();
  for (std::size_t i = 0; i < r.ranks.size(); ++i) rank_json(w, static_cast<int>(i), r.ranks[i]);
  w.end_array();
  w.key("metrics");
  if (r.metrics) metrics_json(w, *r.metrics, r.outputs);
  else w.null();
  w.end_object();
  return w.str();
}

}  // namespace locus::infer
