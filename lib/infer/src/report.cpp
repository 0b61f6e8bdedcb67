// The JSON report of an inference run: rows, timing, per-rank work and speculation, and the
// label metrics (accuracy, log-loss, confusion matrix).
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "locus/infer/infer.hpp"
#include "locus/io/json.hpp"

namespace locus::infer {

namespace {

io::Json rank_json(int rank, const RankStats& s) {
  io::Json j;
  j["rank"] = rank;
  j["units_written"] = s.written;
  j["rows_written"] = s.rows;
  j["units_claimed"] = s.claimed;
  j["speculative_runs"] = s.speculative;
  j["speculative_wins"] = s.speculative_wins;
  j["abandoned_runs"] = s.abandoned;
  j["seconds_read"] = s.seconds_read;
  j["seconds_compute"] = s.seconds_compute;
  j["seconds_write"] = s.seconds_write;
  j["seconds_wait"] = s.seconds_wait;
  j["seconds_idle"] = s.seconds_idle;
  j["cpu_seconds_compute"] = s.cpu_seconds_compute;
  j["cpu_seconds"] = s.cpu_seconds;
  return j;
}

io::Json metrics_json(const Metrics& m, int classes) {
  io::Json j;
  j["rows"] = m.rows;
  j["accuracy"] = m.rows > 0 ? static_cast<double>(m.correct) / static_cast<double>(m.rows) : 0.0;
  j["log_loss"] = m.rows > 0 ? m.log_loss_sum / static_cast<double>(m.rows) : 0.0;
  j["correct"] = m.correct;
  j["labels_out_of_range"] = m.out_of_range;
  j["classes"] = classes;
  io::Json confusion = io::Json::array();  // rows: true class, columns: predicted class
  const auto c = static_cast<std::size_t>(classes);
  for (std::size_t t = 0; t < c; ++t) {
    const auto row = m.confusion.begin() + static_cast<std::ptrdiff_t>(t * c);
    confusion.push_back(std::vector<std::int64_t>(row, row + static_cast<std::ptrdiff_t>(c)));
  }
  j["confusion"] = std::move(confusion);
  return j;
}

}  // namespace

std::string report_json(const InferOptions& opts, const InferResult& r) {
  const auto rows = static_cast<std::int64_t>(r.row_end - r.row_begin);
  std::int64_t wins = 0;
  for (const RankStats& s : r.ranks) wins += s.speculative_wins;
  io::Json per_rank = io::Json::array();
  for (std::size_t i = 0; i < r.ranks.size(); ++i)
    per_rank.push_back(rank_json(static_cast<int>(i), r.ranks[i]));

  io::Json j;
  j["output"] = opts.output;
  j["model"] = opts.model;
  j["input"] = opts.input;
  j["features"] = opts.features;
  j["mode"] = r.incremental ? "incremental" : "full";
  j["row_begin"] = static_cast<std::int64_t>(r.row_begin);
  j["row_end"] = static_cast<std::int64_t>(r.row_end);
  j["rows_scored"] = rows;
  j["features_per_row"] = r.features;
  j["outputs"] = r.outputs;
  j["kind"] = std::string(to_string(r.kind));
  j["top_k"] = r.top_k;
  j["ranks"] = static_cast<int>(r.ranks.size());
  j["compute"] = r.compute;
  j["read"] = r.read;
  j["unit_rows"] = static_cast<std::int64_t>(r.unit_rows);
  j["batch_rows"] = static_cast<std::int64_t>(r.batch_rows);
  j["units"] = r.units;
  j["units_written_once"] = r.units_written_once;
  j["schedule"] = opts.schedule == Schedule::dynamic ? "dynamic" : "static";
  j["speculation"] = opts.speculate && opts.schedule == Schedule::dynamic;
  j["speculative_runs"] = r.speculative_runs;
  j["speculative_wins"] = wins;
  j["seconds"] = r.seconds;
  j["seconds_durable"] = r.seconds_durable;
  j["seconds_init"] = r.seconds_init;
  j["seconds_total"] = r.seconds_total;
  j["rows_per_second"] = r.seconds > 0 ? static_cast<double>(rows) / r.seconds : 0.0;
  j["per_rank"] = std::move(per_rank);
  j["metrics"] = r.metrics ? metrics_json(*r.metrics, r.outputs) : io::Json(nullptr);
  return io::dump_json(j, 2);
}

}  // namespace locus::infer
