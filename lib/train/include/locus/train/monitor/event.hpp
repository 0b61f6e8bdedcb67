// What the training monitors report: events (an anomaly, a skipped update, a non-finite step,
// a straggler and its recovery) and the per-rank step times of a log interval, as they go to
// the metrics file ("type":"event" and "type":"ranks" lines, docs/FORMATS.md) and, for events,
// to the log.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "locus/io/json.hpp"

namespace locus::train {

struct MonitorEvent {
  std::string event;    // anomaly, anomaly_skip, nonfinite, straggler, straggler_recovered
  std::int64_t step = 0;
  double time = 0;      // Unix seconds
  io::Json values = io::Json::object();  // further members, in order
  std::string message;  // one line for a person
};

// One log interval's step times on every rank (index = world rank): means per step of each
// part, and the longest step.
struct RanksRecord {
  std::int64_t step = 0;
  double time = 0;
  std::vector<double> compute_s, data_wait_s, reduce_wait_s, pipeline_wait_s, step_max_s;
  std::vector<double> compute_sd_s, compute_p50_s, compute_p90_s;
};

// {"type":"event","step":N,"event":..,"time":..,<values>}
std::string to_json(const MonitorEvent& e);
// {"type":"ranks","step":N,"time":..,"compute_s":[..],...}
std::string to_json(const RanksRecord& r);

}  // namespace locus::train
