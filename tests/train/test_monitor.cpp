// The training monitors (lib/train/src/monitor/): the z-score window and the anomaly
// detector's verdicts; through the trainer at 1 and 2 ranks (and 2 pipeline stages), a loss
// spike injected by a test hook on rank 0 only at step 20 (LOCUS_TEST_HOOK, set before main)
// warned, skipped or stopped on every rank alike; a diverging run (lr 1e3) stopped at the
// same step everywhere with its last state finite; the same two on a backend that defers its
// step values (a model of the cuda backend's order around the cpu backend) decided and trained
// bitwise as in the host order; a run resumed mid-way with the detector
// active ends bitwise as an uninterrupted one, with the same metrics file; the straggler
// detector's judgement on crafted summaries.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <set>

#include "locus/train/monitor/anomaly.hpp"
#include "locus/train/monitor/straggler.hpp"
#include "async_input_compute.hpp"
#include "test_checkpoint_util.hpp"

namespace locus::train::test {
namespace {

// Before main (the hook's variable is read once, at its first use): every trainer in this
// binary sees rank 0's loss of step 20 multiplied by 1000 in the detector's figures (only
// there: the update is the real one).
const bool kHookSet = [] {
  ::setenv("LOCUS_TEST_HOOK", "anomaly-step-20:loss-spike@0", 1);
  return true;
}();

constexpr std::int64_t kSpikeStep = 20;

TEST(ValueWindow, ZScoresOverAFullWindowInAFixedOrder) {
  ValueWindow w(4);
  EXPECT_TRUE(std::isnan(w.z(1.0)));
  for (double v : {1.0, 2.0, 3.0}) w.push(v);
  EXPECT_TRUE(std::isnan(w.z(10.0))) << "no z-score before the window is full";
  w.push(4.0);  // mean 2.5, population sd sqrt(1.25)
  EXPECT_DOUBLE_EQ(w.z(2.5 + 3 * std::sqrt(1.25)), 3.0);
  w.push(5.0);  // 2,3,4,5
  EXPECT_EQ(w.values(), (std::vector<double>{2, 3, 4, 5}));
  ValueWindow copy(4);
  copy.assign(std::vector<double>{0, 1, 2, 3, 4, 5});  // keeps the newest 4
  EXPECT_EQ(copy.values(), w.values());
  EXPECT_EQ(copy.z(7.25), w.z(7.25));
  ValueWindow flat(2);
  flat.push(1.0);
  flat.push(1.0);
  EXPECT_TRUE(std::isnan(flat.z(5.0))) << "sigma 0 gives no verdict";
}

StepValues values(double loss, double grad) {
  StepValues v;
  v.loss = loss;
  v.grad_norm = grad;
  v.loss_finite = std::isfinite(loss);
  v.grads_finite = std::isfinite(grad);
  v.rows = 10;
  return v;
}

// A slowly falling loss with a little noise, then a spike at step 12.
std::vector<std::pair<std::string, StepAction>> run_series(AnomalyAction action,
                                                           std::vector<double> extra = {}) {
  AnomalyOptions o;
  o.action = action;
  o.z = 6;
  o.window = 8;
  AnomalyDetector d(o);
  std::vector<double> series;
  for (int i = 0; i < 12; ++i) series.push_back(2.0 - 0.01 * i + 0.02 * ((i * 7) % 3));
  series.push_back(50.0);
  series.push_back(1.9);
  for (double x : extra) series.push_back(x);
  std::vector<std::pair<std::string, StepAction>> out;
  for (std::size_t i = 0; i < series.size(); ++i) {
    MonitorEvent e;
    const double grad = 1.0 + 0.01 * static_cast<double>(i % 2);
    const StepVerdict v = d.judge(static_cast<std::int64_t>(i + 1), values(series[i], grad), e);
    out.emplace_back(e.event, v.action);
    if (!e.event.empty()) {
      EXPECT_EQ(e.step, static_cast<std::int64_t>(i + 1));
    }
  }
  return out;
}

TEST(AnomalyDetector, ActsOnASpikeAsConfigured) {
  for (AnomalyAction a : {AnomalyAction::warn, AnomalyAction::skip, AnomalyAction::stop}) {
    const auto got = run_series(a);
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (i == 12) {
        const StepAction want = a == AnomalyAction::warn   ? StepAction::apply
                                : a == AnomalyAction::skip ? StepAction::skip
                                                           : StepAction::stop;
        EXPECT_EQ(got[i].second, want) << to_string(a);
        EXPECT_EQ(got[i].first, a == AnomalyAction::skip ? "anomaly_skip" : "anomaly");
      } else {
        EXPECT_EQ(got[i].first, "") << to_string(a) << " step " << i + 1;
        EXPECT_EQ(got[i].second, StepAction::apply) << to_string(a) << " step " << i + 1;
      }
    }
  }
}

TEST(AnomalyDetector, NonFiniteStopsUnlessSkipAndEndlessSkipsStop) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (AnomalyAction a : {AnomalyAction::warn, AnomalyAction::stop}) {
    const auto got = run_series(a, {nan});
    EXPECT_EQ(got.back().first, "nonfinite");
    EXPECT_EQ(got.back().second, StepAction::stop) << to_string(a);
  }
  // Under skip a non-finite step is dropped; 8 (the window) in a row still are, the 9th stops.
  const auto got = run_series(AnomalyAction::skip, std::vector<double>(9, nan));
  for (std::size_t i = 14; i < 22; ++i) EXPECT_EQ(got[i].second, StepAction::skip) << i;
  EXPECT_EQ(got.back().second, StepAction::stop);
  EXPECT_EQ(got.back().first, "nonfinite");
}

TEST(AnomalyDetector, RestoredStateMakesTheSameDecisions) {
  AnomalyOptions o;
  o.action = AnomalyAction::skip;
  o.z = 3;
  o.window = 5;
  AnomalyDetector a(o);
  MonitorEvent e;
  for (int i = 0; i < 9; ++i) a.judge(i + 1, values(1.0 + 0.1 * (i % 3), 2.0 - 0.05 * i), e);
  AnomalyDetector b(o);
  b.restore(a.state());
  EXPECT_EQ(b.state(), a.state());
  for (int i = 9; i < 30; ++i) {
    const StepValues v = values(1.0 + 0.1 * (i % 3) + (i == 20 ? 5.0 : 0.0), 2.0 - 0.05 * (i % 7));
    MonitorEvent ea, eb;
    const StepVerdict va = a.judge(i + 1, v, ea), vb = b.judge(i + 1, v, eb);
    EXPECT_EQ(va.action, vb.action) << i;
    EXPECT_EQ(ea.event, eb.event) << i;
    if (!std::isnan(va.loss_z)) {
      EXPECT_EQ(va.loss_z, vb.loss_z) << i;
    }
  }
  EXPECT_EQ(a.state(), b.state());
  EXPECT_GE(a.state().skipped, 1);
}

// ---- through the trainer ----

struct Events final : TrainObserver {
  std::vector<std::string> lines;  // "event@step"
  std::vector<MonitorEvent> all;
  void on_event(const MonitorEvent& e) override {
    lines.push_back(e.event + "@" + std::to_string(e.step));
    all.push_back(e);
  }
};

// Collective over comm: rank 0's event list equals every rank's.
void expect_same_on_all_ranks(const mpi::Comm& comm, const std::vector<std::string>& lines) {
  std::string joined;
  for (const auto& l : lines) joined += l + ";";
  const std::string root = comm.bcast(joined);
  int same = root == joined ? 1 : 0;
  comm.allreduce_inplace(std::span<int>(&same, 1), MPI_MIN);
  EXPECT_EQ(same, 1) << "rank " << comm.rank() << " decided " << joined << ", rank 0 " << root;
}

class Monitor : public CheckpointSuite {
 protected:
  static TrainOptions options(AnomalyAction action, int stages = 1) {
    TrainOptions o = small_options(data());  // 15 steps an epoch, 2 epochs
    o.anomaly.action = action;
    o.anomaly.window = 8;
    o.anomaly.z = 8;
    o.pipeline_stages = stages;
    // Stragglers are a matter of timing (tested below on crafted summaries, and end to end in
    // tests/apps/test_monitor_app.py): ranks lines are written, no rank is ever judged slow.
    o.straggler.pct = 1e6;
    return o;
  }
  struct Run {
    Outcome end;
    Events events;
    TrainSummary summary;
    std::int64_t step = 0;
  };
  static Run run(const TrainOptions& o) {
    const Grid grid(world(), o.pipeline_stages);
    Trainer t(grid, o);
    Run r;
    Recorder rec;
    ObserverList obs;
    obs.add(&rec);
    obs.add(&r.events);
    r.summary = t.train(&obs);
    add_state(r.end, t);
    r.end.steps = rec.steps;
    r.step = t.state().step;
    return r;
  }
};

TEST_F(Monitor, WarnReportsTheSpikeAndTrainsAsWithoutTheDetector) {
  TrainOptions off = options(AnomalyAction::warn);
  off.anomaly.enabled = false;
  const Run want = run(off);
  EXPECT_TRUE(want.events.lines.empty());
  const Run got = run(options(AnomalyAction::warn));
  EXPECT_EQ(got.events.lines, std::vector<std::string>{"anomaly@20"});
  ASSERT_EQ(got.events.all.size(), 1u);
  const io::Json& v = got.events.all[0].values;
  EXPECT_EQ(v["action"], "warn");
  EXPECT_GT(v["loss_z"].get<double>(), 8.0);
  EXPECT_TRUE(got.summary.finished);
  expect_same_on_all_ranks(world(), got.events.lines);
  expect_bitwise(got.end, want.end, "warn");  // the spike was in the figures only
}

TEST_F(Monitor, SkipDropsTheUpdateOnEveryRank) {
  const Run got = run(options(AnomalyAction::skip));
  EXPECT_EQ(got.events.lines, std::vector<std::string>{"anomaly_skip@20"});
  expect_same_on_all_ranks(world(), got.events.lines);
  EXPECT_TRUE(got.summary.finished);
  EXPECT_EQ(got.step, 30);
  EXPECT_EQ(got.end.optimizer_steps, 29) << "one update dropped";
  EXPECT_TRUE(same_on_all_ranks(world(), got.end.params)) << "replicas diverged";
  // The dropped step's rows are not in the metrics: the interval 17..20 has 3 steps' rows.
  for (const StepMetrics& m : got.end.steps) {
    if (m.step == kSpikeStep) {
      EXPECT_EQ(m.samples, 3 * 42);
    }
  }
  // And the run is repeatable.
  const Run again = run(options(AnomalyAction::skip));
  expect_bitwise(again.end, got.end, "skip, twice");
}

TEST_F(Monitor, SkipWithPipelineStagesAgreesOverTheGrid) {
  if (world().size() != 2) GTEST_SKIP() << "2 ranks: 2 pipeline stages";
  const Run got = run(options(AnomalyAction::skip, 2));
  EXPECT_EQ(got.events.lines, std::vector<std::string>{"anomaly_skip@20"});
  expect_same_on_all_ranks(world(), got.events.lines);
  EXPECT_EQ(got.end.optimizer_steps, 29);
  // The same decision as one stage makes: the gathered model equals a 1-rank run's within the
  // data-parallel tolerance (the stages only cut the layers). On world rank 0, whose hook
  // injects the spike there too.
  const mpi::Comm self = world().split(world().rank(), 0);
  if (world().rank() != 0) return;
  const Grid grid(self, 1);
  Trainer t(grid, options(AnomalyAction::skip));
  Events ev;
  t.train(&ev);
  EXPECT_EQ(ev.lines, std::vector<std::string>{"anomaly_skip@20"});
  Outcome flat;
  add_state(flat, t.state());
  expect_close(got.end.params, flat.params, "pp=2 vs one rank");
}

TEST_F(Monitor, StopKeepsTheStateBeforeTheSpike) {
  const Run got = run(options(AnomalyAction::stop));
  EXPECT_EQ(got.events.lines, std::vector<std::string>{"anomaly@20"});
  expect_same_on_all_ranks(world(), got.events.lines);
  EXPECT_FALSE(got.summary.finished);
  EXPECT_NE(got.summary.anomaly_stop.find("step 20"), std::string::npos)
      << got.summary.anomaly_stop;
  EXPECT_EQ(got.step, kSpikeStep - 1);
  // Bitwise the state of a run stopped after step 19.
  TrainOptions off = options(AnomalyAction::stop);
  off.anomaly.enabled = false;
  const Grid grid(world(), 1);
  Trainer t(grid, off);
  t.train(nullptr, kSpikeStep - 1);
  Outcome want;
  add_state(want, t);
  Outcome end = got.end;
  end.steps.clear();
  expect_bitwise(end, want, "stop");
}

TEST_F(Monitor, DivergenceStopsEveryRankAtTheSameStepWithAFiniteState) {
  TrainOptions o = options(AnomalyAction::warn);
  o.schedule.base_lr = 1e3;
  o.schedule.warmup_steps = 0;
  const Run got = run(o);
  EXPECT_FALSE(got.summary.finished);
  ASSERT_FALSE(got.events.lines.empty());
  EXPECT_EQ(got.events.all.back().event, "nonfinite");
  EXPECT_EQ(got.events.all.back().step, got.step + 1);
  EXPECT_LT(got.step, kSpikeStep) << "lr 1e3 diverges within a few steps";
  expect_same_on_all_ranks(world(), got.events.lines);
  std::int64_t steps = got.step;
  world().allreduce_inplace(std::span<std::int64_t>(&steps, 1), MPI_MAX);
  EXPECT_EQ(steps, got.step) << "every rank stopped at the same step";
  // Nothing of the non-finite step was applied: the state is bitwise that of a run without
  // the detector stopped before it, and finite (what locus-train then checkpoints).
  TrainOptions off = o;
  off.anomaly.enabled = false;
  const Grid grid(world(), 1);
  Trainer t(grid, off);
  t.train(nullptr, got.step);
  Outcome want;
  add_state(want, t);
  Outcome end = got.end;
  end.steps.clear();
  expect_bitwise(end, want, "diverged");
  EXPECT_TRUE(params_finite(grid, got.end.params));
}

// The order a deferring backend (cuda) takes under warn -- the update issued first, gated on
// the gradient's finiteness, then the verdict (train_loop.cpp, deferred_step()) -- through the
// cpu backend behind a model of that backend (async_input_compute.hpp): the spike warned at the
// same step and the run bitwise the host order's; the diverging run (its gradient non-finite at
// the step that stops it) stopped at the same step with the same state, the gated update not
// counted.
TEST_F(Monitor, DeferredStepValuesDecideAsTheHostOrder) {
  auto deferring = [](TrainOptions o) {
    o.compute.factory = async_input_factory(world(), std::make_shared<InputLog>(),
                                            {.defers_step_values = true});
    return o;
  };
  const TrainOptions warn = options(AnomalyAction::warn);
  const Run want = run(warn);
  const Run got = run(deferring(warn));
  EXPECT_EQ(got.events.lines, std::vector<std::string>{"anomaly@20"});
  EXPECT_TRUE(got.summary.finished);
  expect_bitwise(got.end, want.end, "warn, deferred");

  TrainOptions diverge = warn;
  diverge.schedule.base_lr = 1e3;
  diverge.schedule.warmup_steps = 0;
  const Run host = run(diverge);
  const Run deferred = run(deferring(diverge));
  EXPECT_FALSE(deferred.summary.finished);
  ASSERT_FALSE(deferred.events.all.empty());
  EXPECT_EQ(deferred.events.all.back().event, "nonfinite");
  EXPECT_EQ(deferred.events.lines, host.events.lines);
  EXPECT_EQ(deferred.step, host.step);
  expect_bitwise(deferred.end, host.end, "diverged, deferred");
  EXPECT_TRUE(params_finite(Grid(world(), 1), deferred.end.params));
}

// A run resumed mid-way with the detector active (skip, with the spike after the resume and
// its window filled before it) ends bitwise where an uninterrupted one does, with the same
// metrics file, event and ranks lines included (timing members aside).
TEST_F(Monitor, ResumedRunMakesTheSameDecisions) {
  const TrainOptions o = options(AnomalyAction::skip);
  const locus::test::SharedTmpDir dir(world());
  const Grid grid(world(), 1);
  Outcome want;
  std::vector<std::string> want_events;
  {
    Trainer t(grid, o);
    JsonlMetrics file(world(), dir.file("want.jsonl"));
    Events ev;
    Recorder rec;
    ObserverList obs;
    obs.add(&file);
    obs.add(&ev);
    obs.add(&rec);
    t.train(&obs);
    add_state(want, t.state());
    want.steps = rec.steps;
    want_events = ev.lines;
  }
  EXPECT_EQ(want_events, std::vector<std::string>{"anomaly_skip@20"});
  const locus::test::SharedTmpDir ckpt(world());
  const std::string path = dir.file("got.jsonl");
  Outcome got;
  Recorder rec;
  {
    Trainer t(grid, o);
    Checkpointer c(t, checkpoint_options(ckpt.path()), "");
    c.resume("none");
    JsonlMetrics file(world(), path);
    ObserverList obs;
    obs.add(&file);
    obs.add(&rec);
    t.train(&obs, 13);
    c.save_now("test");
    const CheckpointMeta m = read_checkpoint_meta(world(), c.saves().back().path);
    EXPECT_TRUE(m.has_anomaly);
    EXPECT_EQ(m.anomaly.loss.size(), 8u);
    EXPECT_EQ(m.anomaly, t.anomaly_state());
  }
  {
    Trainer t(grid, o);
    Checkpointer c(t, checkpoint_options(ckpt.path()), "");
    const ResumeResult r = c.resume("auto");
    ASSERT_TRUE(r.resumed);
    EXPECT_EQ(r.meta.step, 13);
    JsonlMetrics file(world(), path, r.meta.step);
    Events ev;
    ObserverList obs;
    obs.add(&file);
    obs.add(&ev);
    obs.add(&rec);
    t.train(&obs);
    add_state(got, t.state());
    EXPECT_EQ(ev.lines, want_events);
  }
  got.steps = rec.steps;
  expect_bitwise(got, want, "resumed at step 13");
  if (world().is_root()) {
    // The files hold the same lines but for the timing members.
    auto strip = [](const std::string& file) {
      std::ifstream in(file);
      std::vector<io::Json> out;
      for (std::string l; std::getline(in, l);) {
        io::Json j = io::Json::parse(l);
        for (const char* k : {"time", "seconds", "samples_per_s", "allreduce_s",
                              "allreduce_blocked_s", "hidden_fraction", "data_wait_s",
                              "data_wait_fraction", "eval_seconds", "compute_s", "reduce_wait_s",
                              "pipeline_wait_s", "step_max_s", "compute_sd_s", "compute_p50_s",
                              "compute_p90_s"}) {
          j.erase(k);
        }
        out.push_back(j);
      }
      return out;
    };
    const auto a = strip(path), b = strip(dir.file("want.jsonl"));
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "line " << i + 1;
    std::set<std::string> types;
    for (const auto& j : b) types.insert(j["type"].get<std::string>());
    EXPECT_EQ(types, (std::set<std::string>{"step", "epoch", "event", "ranks"}));
  }
}

// ---- stragglers ----

RankSummary summary(double compute, double data = 0) {
  RankSummary s;
  s.steps = 10;
  s.mean = {compute * 1.1, data, 0.001, 0};
  s.compute_p50 = compute;
  s.step_max = compute * 1.5;
  return s;
}

TEST(StragglerDetector, ReportsASlowRankOnceAfterMIntervalsAndItsRecovery) {
  StragglerOptions o;  // 3 sigma, 3 intervals (locus-train's defaults), 25 %
  o.pct = 25;
  StragglerDetector d(o, {{"h0", ""}, {"h1", "n1"}, {"h2", ""}, {"h3", ""}});
  std::vector<std::string> seen;
  auto interval = [&](std::int64_t step, double slow, double data = 0) {
    std::vector<RankSummary> all = {summary(0.010), summary(slow, data), summary(0.0101),
                                    summary(0.0099)};
    for (const MonitorEvent& e : d.judge(step, all)) {
      seen.push_back(e.event + "@" + std::to_string(e.step) + ":" +
                     e.values["part"].get<std::string>());
      if (e.event == "straggler" && e.values["part"] == "compute") {
        EXPECT_EQ(e.values["rank"], 1);
        EXPECT_EQ(e.values["node"], "n1");
        EXPECT_NEAR(e.values["ratio"].get<double>(), 4.0, 0.01);
      }
    }
  };
  interval(10, 0.040);
  interval(20, 0.040);
  EXPECT_TRUE(seen.empty()) << "two intervals are not enough";
  interval(30, 0.040);
  interval(40, 0.040);
  EXPECT_EQ(seen, std::vector<std::string>{"straggler@30:compute"});
  EXPECT_NE(d.file_text(40).find("\n1 h1 n1 compute 4.000\n"), std::string::npos)
      << d.file_text(40);
  interval(50, 0.0102);
  interval(60, 0.0100);
  interval(70, 0.0101);
  EXPECT_EQ(seen.back(), "straggler_recovered@70:compute");
  EXPECT_TRUE(d.current().empty());
  // Within 25 %: never.
  for (int i = 0; i < 5; ++i) interval(80 + 10 * i, 0.012);
  EXPECT_EQ(seen.size(), 2u);
  // A rank waiting for its data: the data_wait part.
  for (int i = 0; i < 3; ++i) interval(200 + 10 * i, 0.010, 0.02);
  EXPECT_EQ(seen.back(), "straggler@220:data_wait");
}

TEST(StragglerDetector, ComparesOnlyRanksOfTheSameStage) {
  StragglerOptions o;
  o.pct = 25;
  StragglerDetector d(o, {{"a", ""}, {"b", ""}, {"c", ""}, {"d", ""}}, 2);
  // Stage 1 (ranks 1, 3) computes 3x what stage 0 does: by design, not a straggler.
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(d.judge(i, {summary(0.01), summary(0.03), summary(0.01), summary(0.031)}).empty());
  }
}

TEST(StepTimes, SummarisesAnInterval) {
  StepTimes t;
  for (int i = 1; i <= 10; ++i) t.add({0.001 * i, 0.5, 0.25, 0}, 0.002 * i);
  const RankSummary s = t.take();
  EXPECT_EQ(s.steps, 10);
  EXPECT_DOUBLE_EQ(s.mean[0], 0.0055);
  EXPECT_DOUBLE_EQ(s.mean[1], 0.5);
  EXPECT_DOUBLE_EQ(s.compute_p50, 0.005);
  EXPECT_DOUBLE_EQ(s.compute_p90, 0.009);
  EXPECT_DOUBLE_EQ(s.step_max, 0.02);
  EXPECT_EQ(t.take().steps, 0) << "take() starts the next interval";
}

}  // namespace
}  // namespace locus::train::test
