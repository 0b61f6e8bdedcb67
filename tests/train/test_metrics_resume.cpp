// Metrics across resumes at 1 and 2 ranks: a run stopped mid-epoch once or twice -- by a
// signal at a step boundary inside train() (the checkpoint written there) or at stop_at_step
// with a save after train() returned -- and resumed each time with --resume=auto by a new
// trainer writes the metrics file of an uninterrupted run: the same lines, every field but the
// timing ones equal (doubles in their shortest round-trip form, so bit for bit), with the
// log interval spanning the stop; the weights end bitwise equal. A checkpoint without the
// metrics sums (an older locus) still resumes, with a note, and its epoch line then covers
// only the resumed part. The exact sum behind the loss is order-independent.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>
#include <csignal>
#include <functional>
#include <fstream>
#include <map>
#include <set>

#include "locus/io/attribute.hpp"
#include "locus/train/checkpoint/preempt.hpp"
#include "shared_tmpdir.hpp"
#include "test_checkpoint_util.hpp"

namespace locus::train::test {
namespace {

class MetricsResume : public CheckpointSuite {
 protected:
  static TrainOptions options() {
    TrainOptions o = small_options(data());  // 15 steps an epoch (the last one partial), 2 epochs
    o.model.dropout = 0.2f;
    o.log_every = 4;  // intervals end at 4, 8, 12, the epoch end 15, 16, 20, ...
    return o;
  }
};

// The timing fields of the metrics lines (docs/FORMATS.md, "Training metrics"): wall time and
// what is derived from it. Every other field must not depend on interruptions.
const std::set<std::string> kTimingFields = {
    "seconds",     "samples_per_s",   "allreduce_s",       "allreduce_blocked_s",
    "hidden_fraction", "data_wait_s", "data_wait_fraction", "eval_seconds", "time"};

// The fields of one flat JSON object line (what JsonlMetrics writes: numbers and plain strings)
// as raw text by key.
std::map<std::string, std::string> fields_of(const std::string& line) {
  std::map<std::string, std::string> out;
  EXPECT_TRUE(line.size() >= 2 && line.front() == '{' && line.back() == '}') << line;
  std::size_t at = 1;
  while (at + 1 < line.size()) {
    const std::size_t colon = line.find("\":", at);
    const std::size_t end = std::min(line.find(',', colon), line.size() - 1);
    out[line.substr(at + 1, colon - at - 1)] = line.substr(colon + 2, end - colon - 2);
    at = end + 1;
  }
  return out;
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// Collective: the metrics file `got` equals `want` line by line, field by field except timing.
void expect_same_metrics_file(const std::string& got, const std::string& want,
                              const std::string& what) {
  if (!world().is_root()) return;
  const auto a = lines_of(got), b = lines_of(want);
  ASSERT_EQ(a.size(), b.size()) << what << ": metrics lines";
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto fa = fields_of(a[i]), fb = fields_of(b[i]);
    std::set<std::string> ka, kb;
    for (const auto& [k, v] : fa) ka.insert(k);
    for (const auto& [k, v] : fb) kb.insert(k);
    EXPECT_EQ(ka, kb) << what << ": line " << i + 1;
    for (const auto& [k, v] : fb) {
      if (kTimingFields.count(k) != 0 || fa.count(k) == 0) continue;
      EXPECT_EQ(fa.at(k), v) << what << ": line " << i + 1 << " field " << k << "\n  got  "
                             << a[i] << "\n  want " << b[i];
    }
  }
}

// Every metric but the timings, bit for bit.
void expect_same_records(const Recorder& got, const Recorder& want, const std::string& what) {
  ASSERT_EQ(got.steps.size(), want.steps.size()) << what;
  for (std::size_t i = 0; i < got.steps.size(); ++i) {
    const StepMetrics &a = got.steps[i], &b = want.steps[i];
    EXPECT_EQ(a.step, b.step) << what;
    EXPECT_EQ(a.epoch, b.epoch) << what << " step " << b.step;
    EXPECT_EQ(a.step_in_epoch, b.step_in_epoch) << what << " step " << b.step;
    EXPECT_EQ(a.steps, b.steps) << what << " step " << b.step;
    EXPECT_EQ(a.samples, b.samples) << what << " step " << b.step;
    EXPECT_EQ(a.loss, b.loss) << what << " step " << b.step;
    EXPECT_EQ(a.accuracy, b.accuracy) << what << " step " << b.step;
    EXPECT_EQ(a.lr, b.lr) << what << " step " << b.step;
  }
  ASSERT_EQ(got.epochs.size(), want.epochs.size()) << what;
  for (std::size_t i = 0; i < got.epochs.size(); ++i) {
    const EpochMetrics &a = got.epochs[i], &b = want.epochs[i];
    EXPECT_EQ(a.step, b.step) << what << " epoch " << i;
    EXPECT_EQ(a.samples, b.samples) << what << " epoch " << i;
    EXPECT_EQ(a.train_loss, b.train_loss) << what << " epoch " << i;
    EXPECT_EQ(a.train_accuracy, b.train_accuracy) << what << " epoch " << i;
    EXPECT_EQ(a.eval.loss, b.eval.loss) << what << " epoch " << i;
  }
}

// Raises SIGUSR1 on the last rank at the boundary after step `at`, then lets the Checkpointer
// see the boundary: the preemption path of locus-train.
struct SignalAtStep final : StepHook {
  SignalAtStep(Checkpointer& c, std::int64_t at) : c_(c), at_(at) {}
  bool at_step_boundary(Trainer& t, const StepBoundary& b) override {
    if (b.step == at_ && world().rank() == world().size() - 1) std::raise(SIGUSR1);
    return c_.at_step_boundary(t, b);
  }
  Checkpointer& c_;
  std::int64_t at_;
};

struct Segmented {
  Recorder rec;
  Outcome end;
  std::vector<ResumeResult> resumes;
};

// Trains `o` in segments ending at `stops` (even segments stopped by a signal, odd ones at
// stop_at_step and saved after), each a new Trainer, Checkpointer and JsonlMetrics on
// `metrics`, resumed with --resume=auto from the checkpoint the previous one ended with.
// `edit` runs on the directory after each interrupted segment.
Segmented run_in_segments(const TrainOptions& o, const std::vector<std::int64_t>& stops,
                          const std::string& dir, const std::string& metrics,
                          const std::function<void(std::int64_t)>& edit = {}) {
  const Grid grid(world(), 1);
  Segmented out;
  CheckpointOptions co = checkpoint_options(dir);
  co.signals = parse_signals("USR1");
  for (std::size_t i = 0; i <= stops.size(); ++i) {
    const PreemptSignals handlers(co.signals);
    Trainer t(grid, o);
    Checkpointer c(t, co, "");
    const ResumeResult r = c.resume(i == 0 ? "none" : "auto");
    if (i > 0) {
      EXPECT_TRUE(r.resumed);
      EXPECT_EQ(r.meta.step, stops[i - 1]);
      out.resumes.push_back(r);
    }
    JsonlMetrics file(world(), metrics, r.resumed ? r.meta.step : -1);
    ObserverList obs;
    obs.add(&file);
    obs.add(&out.rec);
    if (i == stops.size()) {
      EXPECT_TRUE(t.train(&obs, -1, &c).finished);
      c.wait();
      add_state(out.end, t.state());
      break;
    }
    if (i % 2 == 0) {
      SignalAtStep hook(c, stops[i]);
      EXPECT_FALSE(t.train(&obs, -1, &hook).finished);
      EXPECT_EQ(c.stopped_by_signal(), SIGUSR1);
    } else {
      t.train(&obs, stops[i], &c);
      c.save_now("test");
      c.wait();
    }
    EXPECT_EQ(t.state().step, stops[i]);
    if (edit) edit(stops[i]);
  }
  return out;
}

struct Straight {
  Recorder rec;
  Outcome end;
};

Straight straight(const TrainOptions& o, const std::string& metrics) {
  const Grid grid(world(), 1);
  Trainer t(grid, o);
  JsonlMetrics file(world(), metrics);
  Straight out;
  ObserverList obs;
  obs.add(&file);
  obs.add(&out.rec);
  t.train(&obs);
  add_state(out.end, t.state());
  return out;
}

TEST_F(MetricsResume, MidEpochResumesWriteTheUninterruptedMetrics) {
  const TrainOptions o = options();
  const locus::test::SharedTmpDir dir(world());
  const Straight want = straight(o, dir.file("want.jsonl"));
  // The reference itself: interval lines at multiples of 4 and at the epoch ends, 2 epochs of
  // all 600 rows, or the comparison below could pass on two equally wrong files.
  std::vector<std::int64_t> steps;
  for (const auto& s : want.rec.steps) steps.push_back(s.step);
  EXPECT_EQ(steps, (std::vector<std::int64_t>{4, 8, 12, 15, 16, 20, 24, 28, 30}));
  ASSERT_EQ(want.rec.epochs.size(), 2u);
  for (const auto& e : want.rec.epochs) EXPECT_EQ(e.samples, 600);

  // Once (mid-interval in epoch 1) and twice (in epochs 1 and 2, by both stop paths).
  for (const std::vector<std::int64_t>& stops :
       {std::vector<std::int64_t>{9}, std::vector<std::int64_t>{6, 22}}) {
    std::string what = "stopped at";
    for (auto s : stops) what += " " + std::to_string(s);
    const locus::test::SharedTmpDir ckpt(world());
    const std::string path = dir.file("got.jsonl");
    const Segmented got = run_in_segments(o, stops, ckpt.path(), path);
    expect_same_metrics_file(path, dir.file("want.jsonl"), what);
    expect_same_records(got.rec, want.rec, what);
    for (const ResumeResult& r : got.resumes) {
      // What the checkpoint carried: the epoch's samples so far and the open interval since
      // the last line of the uninterrupted run (every full batch is 42 rows).
      const std::int64_t at = r.meta.step;
      std::int64_t last_line = 0;
      for (const auto& l : want.rec.steps) {
        if (l.step <= at) last_line = l.step;
      }
      EXPECT_TRUE(r.meta.has_metrics) << what;
      EXPECT_EQ(r.meta.metrics.epoch.rows, (at - (at > 15 ? 15 : 0)) * 42) << what;
      EXPECT_EQ(r.meta.metrics.interval_steps, at - last_line) << what;
      EXPECT_EQ(r.meta.metrics.interval.rows, (at - last_line) * 42) << what;
    }
    expect_bitwise(got.end, want.end, what);
  }
}

// Deletes the metrics_* attributes of a checkpoint and re-signs its metadata, as a locus from
// before they existed wrote it. Collective.
void strip_metrics(const std::string& path) {
  CheckpointMeta m = read_checkpoint_meta(world(), path);
  ASSERT_TRUE(m.has_metrics);
  m.has_metrics = false;
  const std::string text = meta_text(m);
  const auto crc = static_cast<std::int64_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(text.data()), static_cast<uInt>(text.size())));
  if (world().is_root()) {
    h5::init();
    h5::Id f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT));
    ASSERT_TRUE(f);
    for (const char* part : {"epoch", "interval"}) {
      for (const char* k : {"loss", "loss_other", "correct", "rows", "times"}) {
        const std::string name = std::string("metrics_") + part + "_" + k;
        EXPECT_GE(H5Adelete(f.get(), name.c_str()), 0) << name;
      }
    }
    EXPECT_GE(H5Adelete(f.get(), "metrics_interval_steps"), 0);
    h5::write_attr(f.get(), "meta_crc32", crc);
  }
  world().barrier();
  EXPECT_FALSE(read_checkpoint_meta(world(), path).has_metrics);
}

TEST_F(MetricsResume, CheckpointWithoutMetricsResumesWithANote) {
  const TrainOptions o = options();
  const locus::test::SharedTmpDir dir(world());
  const Straight want = straight(o, dir.file("want.jsonl"));
  const locus::test::SharedTmpDir ckpt(world());
  const Segmented got =
      run_in_segments(o, {9}, ckpt.path(), dir.file("got.jsonl"), [&](std::int64_t step) {
        strip_metrics(ckpt.file(checkpoint_file_name(step)));
      });
  ASSERT_EQ(got.resumes.size(), 1u);
  bool noted = false;
  for (const auto& n : got.resumes[0].notes) {
    noted = noted || n.find("has no metrics sums") != std::string::npos;
  }
  EXPECT_TRUE(noted) << "no note about the missing metrics sums";
  // The weights do not depend on the metrics: still bitwise.
  expect_bitwise(got.end, want.end, "resumed from a checkpoint without metrics");
  // Epoch 1's line then covers only the 222 samples after step 9 (600 - 9 x 42).
  ASSERT_EQ(got.rec.epochs.size(), 2u);
  EXPECT_EQ(got.rec.epochs[0].samples, 600 - 9 * 42);
  EXPECT_EQ(got.rec.epochs[1].samples, 600);
}

TEST(ExactSum, OrderAndGroupingDoNotMatter) {
  std::vector<double> v;
  for (int i = 0; i < 1000; ++i) {
    v.push_back(std::ldexp(noise(static_cast<std::uint64_t>(i), 1, 5), (i * 37) % 140 - 70));
  }
  ExactSum forward, backward, halves, a, b;
  for (double x : v) forward.add(x);
  for (auto it = v.rbegin(); it != v.rend(); ++it) backward.add(*it);
  for (std::size_t i = 0; i < v.size(); ++i) (i % 2 == 0 ? a : b).add(v[i]);
  halves.add(a);
  halves.add(b);
  EXPECT_EQ(forward, backward);
  EXPECT_EQ(forward, halves);
  EXPECT_EQ(forward.value(), backward.value());
  // Exact where doubles are not: 1e16 + 1 - 1e16.
  ExactSum s;
  s.add(1e16);
  s.add(1.0);
  s.add(-1e16);
  EXPECT_EQ(s.value(), 1.0);
  EXPECT_EQ(ExactSum::from_parts(forward.limbs(), forward.other()), forward);
  ExactSum n;
  n.add(std::nan(""));
  n.add(2.0);
  EXPECT_TRUE(std::isnan(n.value()));
  // Over the ranks: every rank adds its share, the reduction equals the serial sum.
  ExactSum mine;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (static_cast<int>(i % static_cast<std::size_t>(world().size())) == world().rank()) {
      mine.add(v[i]);
    }
  }
  EXPECT_EQ(mine.allreduce(world()), forward);
}

}  // namespace
}  // namespace locus::train::test
