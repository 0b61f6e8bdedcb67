// The metrics lines of locus-train (to_json of StepMetrics and EpochMetrics): one compact
// object per line, members in the documented order (docs/FORMATS.md, "Training metrics"),
// grad_norm and the eval_* members only when measured, and null for a non-finite figure (a
// diverged loss) so the line still parses.
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

#include "locus/io/json.hpp"
#include "locus/train/metrics.hpp"

using namespace locus;

namespace {

std::vector<std::string> keys(const std::string& line) {
  const io::Json j = io::Json::parse(line);  // items() refers to it: not a temporary
  std::vector<std::string> out;
  for (const auto& [k, v] : j.items()) out.push_back(k);
  return out;
}

}  // namespace

TEST(MetricsJson, StepLine) {
  train::StepMetrics m;
  m.step = 300;
  m.epoch = 1;
  m.step_in_epoch = 65;
  m.steps = 100;
  m.samples = 12800;
  m.loss = 0.375;
  m.accuracy = 1.0;
  m.lr = 0.05;
  m.seconds = 2.5;
  m.time = 1764045000.25;  // Unix seconds: written as given (a reader's time axis)
  const std::string line = train::to_json(m);
  EXPECT_NE(line.find(R"("time":1764045000.25})"), std::string::npos) << line;
  EXPECT_EQ(line.find('\n'), std::string::npos) << line;
  // The prefix scripts and the resume logic look for (tests/slurm greps '^{"type":"step","step":').
  EXPECT_EQ(line.rfind(R"({"type":"step","step":300,"epoch":1,"step_in_epoch":65,"steps":100,)"
                       R"("samples":12800,"loss":0.375,"accuracy":1.0,"lr":0.05,"seconds":2.5,)", 0),
            0u)
      << line;
  const std::vector<std::string> want = {
      "type", "step", "epoch", "step_in_epoch", "steps", "samples", "loss", "accuracy", "lr",
      "seconds", "samples_per_s", "allreduce_s", "allreduce_blocked_s", "hidden_fraction",
      "data_wait_s", "data_wait_fraction", "time"};
  EXPECT_EQ(keys(line), want);

  m.grad_norm = 0.75;  // clipping on: grad_norm follows lr
  std::vector<std::string> with_norm = want;
  with_norm.insert(with_norm.begin() + 9, "grad_norm");
  EXPECT_EQ(keys(train::to_json(m)), with_norm);
}

TEST(MetricsJson, NonFiniteFiguresAreNull) {
  train::StepMetrics m;
  m.step = 1;
  m.loss = std::numeric_limits<double>::quiet_NaN();
  m.samples_per_s = std::numeric_limits<double>::infinity();
  const io::Json j = io::Json::parse(train::to_json(m));
  EXPECT_TRUE(j["loss"].is_null()) << j;
  EXPECT_TRUE(j["samples_per_s"].is_null()) << j;
  EXPECT_EQ(j["step"], 1);

  train::EpochMetrics e;
  e.evaluated = true;
  e.eval.loss = -std::numeric_limits<double>::infinity();
  EXPECT_NE(train::to_json(e).find(R"("eval_loss":null)"), std::string::npos) << train::to_json(e);
}

TEST(MetricsJson, EpochLine) {
  train::EpochMetrics m;
  m.epoch = 2;
  m.step = 1407;
  m.samples = 60000;
  m.train_loss = 0.25;
  const std::vector<std::string> base = {"type", "epoch", "step", "samples", "train_loss",
                                         "train_accuracy", "seconds", "samples_per_s",
                                         "data_wait_fraction", "hidden_fraction", "time"};
  EXPECT_EQ(keys(train::to_json(m)), base);
  EXPECT_EQ(train::to_json(m).rfind(R"({"type":"epoch","epoch":2,"step":1407,"samples":60000,)"
                                    R"("train_loss":0.25,)", 0),
            0u);

  m.evaluated = true;
  m.eval = {10000, 0.3125, 0.875, 0.5};
  std::vector<std::string> with_eval = base;
  with_eval.pop_back();  // time stays last
  for (const char* k : {"eval_rows", "eval_loss", "eval_accuracy", "eval_seconds", "time"})
    with_eval.push_back(k);
  EXPECT_EQ(keys(train::to_json(m)), with_eval);
  const io::Json j = io::Json::parse(train::to_json(m));
  EXPECT_EQ(j["eval_rows"], 10000);
  EXPECT_EQ(j["eval_accuracy"].get<double>(), 0.875);
}
