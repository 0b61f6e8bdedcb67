// The monitor lines of the metrics file (docs/FORMATS.md, "Training metrics").
#include "locus/train/monitor/event.hpp"

#include "locus/train/metrics.hpp"

namespace locus::train {

std::string to_json(const MonitorEvent& e) {
  io::Json j;
  j["type"] = "event";
  j["step"] = e.step;
  j["event"] = e.event;
  j["time"] = e.time;
  for (const auto& [k, v] : e.values.items()) j[k] = v;
  return io::dump_json(j);
}

std::string to_json(const RanksRecord& r) {
  io::Json j;
  j["type"] = "ranks";
  j["step"] = r.step;
  j["time"] = r.time;
  j["compute_s"] = r.compute_s;
  j["data_wait_s"] = r.data_wait_s;
  j["reduce_wait_s"] = r.reduce_wait_s;
  j["pipeline_wait_s"] = r.pipeline_wait_s;
  j["step_max_s"] = r.step_max_s;
  j["compute_sd_s"] = r.compute_sd_s;
  j["compute_p50_s"] = r.compute_p50_s;
  j["compute_p90_s"] = r.compute_p90_s;
  return io::dump_json(j);
}

}  // namespace locus::train
