// The CUDA engine: a stripe read into the (page-locked) ring goes to the device on a copy
// stream in up to kPieces pieces, so the forward passes of one piece overlap the copy of the
// next; per batch of the unit's grid the DeviceModel's forward pass (lib/train: the training
// backend's GEMMs and epilogues) and finish_rows (softmax, argmax, top-k, log-loss terms); then
// only those outputs come back, into page-locked per-unit buffers the main thread turns into
// the unit's Scores. The compute thread waits for each stripe before taking the next, so the
// ring's buffer is free when run() returns; the main thread's reads of the next stripes go on
// meanwhile.
//
// Bytes do not depend on the rank, stripe or unit: every batch is a full batch_rows-row
// forward pass (zero padding outside the stripe) from a 256-byte aligned device address (so
// cuBLASLt picks one algorithm for every batch), and each row is finished by one thread.
#include "cuda/cuda_engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <optional>
#include <vector>

#include "compute_thread.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/memory.hpp"
#include "cuda/score_kernels.hpp"
#include "locus/comm/mpi.hpp"
#include "locus/train/cuda/device_model.hpp"

namespace locus::infer::detail {

namespace {

namespace tc = locus::train::cuda;

constexpr int kPieces = 8;             // copy events per stripe
constexpr std::size_t kAlignFloats = 64;  // 256 bytes

std::size_t round_up(std::size_t n, std::size_t m) { return (n + m - 1) / m * m; }

class PinnedRing final : public Engine::Attachment {
 public:
  PinnedRing(void* p, std::size_t bytes) : registration_(p, bytes) {
    // Slower, not wrong: say so, go on. Already registered (e.g. by a CUDA-aware MPI): locked.
    if (registration_.refused() != cudaSuccess &&
        registration_.refused() != cudaErrorHostMemoryAlreadyRegistered) {
      fmt::print(stderr,
                 "[rank {}] note: the read ring ({:.0f} MiB) could not be page-locked ({}): "
                 "its copies to the GPU go through pageable memory, slower\n",
                 mpi::world_rank(), static_cast<double>(bytes) / (1 << 20),
                 cudaGetErrorString(registration_.refused()));
    }
  }

 private:
  tc::HostRegistration registration_;
};

// Where a unit's outputs land (page-locked): row i of the unit at row i of each buffer.
struct UnitOutputs {
  tc::PinnedBuffer<float> values, topk_value;
  tc::PinnedBuffer<std::int32_t> predicted, topk_index;
  tc::PinnedBuffer<double> loss;
};

// A stripe's outputs on the device, row i of the stripe at row i.
struct StripeOutputs {
  tc::DeviceBuffer<float> values, topk_value;
  tc::DeviceBuffer<std::int32_t> predicted, topk_index, labels;
  tc::DeviceBuffer<double> loss;
};

class CudaEngine final : public Engine {
 public:
  CudaEngine(const train::Mlp& model, const ScoreSpec& spec, train::Precision precision,
             int device)
      : spec_(spec),
        device_(device),
        inputs_(model.layout().input_width()),
        outputs_(model.layout().output_width()),
        model_(model, precision, spec.batch_rows),
        copy_(tc::make_stream()),
        compute_(tc::make_stream()) {
    LOCUS_ASSERT(spec.batch_rows >= 1 && spec.top_k >= 0 && spec.top_k <= outputs_,
                 "the score spec was validated by run_inference");
    for (auto& e : copied_) e = tc::make_event();
  }

  ~CudaEngine() override {
    // Work may still be queued after an error: let it finish before the buffers go.
    if (copy_) cudaStreamSynchronize(copy_.get());
    if (compute_) cudaStreamSynchronize(compute_.get());
  }

  const ScoreSpec& spec() const noexcept override { return spec_; }
  int outputs() const noexcept override { return outputs_; }

  std::unique_ptr<Attachment> attach(std::span<float> ring, std::uint64_t stripe_rows,
                                     std::uint64_t unit_rows) override {
    const auto b = static_cast<std::size_t>(spec_.batch_rows);
    const auto c = static_cast<std::size_t>(outputs_);
    const auto k = static_cast<std::size_t>(spec_.top_k);
    const bool probs = spec_.kind == OutputKind::probabilities;
    // A stripe ends on its unit's stripe grid, a multiple of the batch: stripe_rows / b
    // batches at most, one more for a stripe that starts inside a batch.
    max_batches_ = static_cast<std::size_t>(stripe_rows) / b + 1;
    stride_ = round_up(b * static_cast<std::size_t>(inputs_), kAlignFloats);
    x_ = tc::DeviceBuffer<float>(max_batches_ * stride_);
    const std::size_t rows = max_batches_ * b;
    dev_.values = tc::DeviceBuffer<float>(rows * c);
    if (probs) {
      dev_.predicted = tc::DeviceBuffer<std::int32_t>(rows);
      dev_.labels = tc::DeviceBuffer<std::int32_t>(rows);
      dev_.loss = tc::DeviceBuffer<double>(rows);
      dev_.topk_index = tc::DeviceBuffer<std::int32_t>(rows * k);
      dev_.topk_value = tc::DeviceBuffer<float>(rows * k);
    }
    const auto u = static_cast<std::size_t>(unit_rows);
    for (UnitOutputs& h : host_) {
      h.values = tc::PinnedBuffer<float>(u * c);
      if (probs) {
        h.predicted = tc::PinnedBuffer<std::int32_t>(u);
        h.loss = tc::PinnedBuffer<double>(u);
        h.topk_index = tc::PinnedBuffer<std::int32_t>(u * k);
        h.topk_value = tc::PinnedBuffer<float>(u * k);
      }
    }
    unit_rows_ = u;
    return std::make_unique<PinnedRing>(ring.data(), ring.size_bytes());
  }

  void on_compute_thread() override { LOCUS_CUDA_CHECK(cudaSetDevice(device_)); }

  void start_unit(UnitWork& u) override {
    LOCUS_ASSERT(u.rows.count <= unit_rows_,
                 fmt::format("a unit of {} rows in buffers of {}", u.rows.count, unit_rows_));
  }

  bool run(const Stripe& s, const std::function<bool()>& stop) override;
  void finish(UnitWork& u) override;

 private:
  void upload(const Stripe& s, std::size_t off, std::size_t batches, std::size_t per_piece);

  ScoreSpec spec_;
  int device_;
  int inputs_, outputs_;
  tc::DeviceModel model_;
  tc::Stream copy_, compute_;
  std::array<tc::Event, kPieces> copied_;
  std::size_t max_batches_ = 0, stride_ = 0, unit_rows_ = 0;
  tc::DeviceBuffer<float> x_;  // max_batches_ batches of [batch_rows, inputs], stride_ apart
  StripeOutputs dev_;
  std::array<UnitOutputs, 2> host_;  // per unit slot
};

// On the copy stream: zero padding before and after the stripe's rows within its first and
// last batch, the stripe's rows into their batches, and copied_[p] after piece p's batches.
// Rows are counted from the stripe's first batch: the stripe holds rows [off, off + n).
void CudaEngine::upload(const Stripe& s, std::size_t off, std::size_t batches,
                        std::size_t per_piece) {
  cudaStream_t cs = copy_.get();
  const auto b = static_cast<std::size_t>(spec_.batch_rows);
  const auto d = static_cast<std::size_t>(inputs_);
  const std::size_t n = s.rows;
  if (off > 0) LOCUS_CUDA_CHECK(cudaMemsetAsync(x_.data(), 0, off * d * sizeof(float), cs));
  const std::size_t end = off + n, tail = batches * b - end;
  if (tail > 0) {
    float* at = x_.data() + (batches - 1) * stride_ + (end - (batches - 1) * b) * d;
    LOCUS_CUDA_CHECK(cudaMemsetAsync(at, 0, tail * d * sizeof(float), cs));
  }
  const bool contiguous = stride_ == b * d;
  for (std::size_t first = 0, p = 0; first < batches; first += per_piece, ++p) {
    const std::size_t last = std::min(batches, first + per_piece);  // batches [first, last)
    auto copy = [&](std::size_t from, std::size_t to, std::size_t batch) {  // rows [from, to)
      float* dst = x_.data() + batch * stride_ + (from - batch * b) * d;
      LOCUS_CUDA_CHECK(cudaMemcpyAsync(dst, s.x.data() + (from - off) * d,
                                       (to - from) * d * sizeof(float), cudaMemcpyHostToDevice,
                                       cs));
    };
    const std::size_t lo = std::max(off, first * b), hi = std::min(end, last * b);
    if (contiguous) {
      copy(lo, hi, first);
    } else {
      for (std::size_t j = first; j < last; ++j)
        copy(std::max(lo, j * b), std::min(hi, (j + 1) * b), j);
    }
    LOCUS_CUDA_CHECK(cudaEventRecord(copied_[p].get(), cs));
  }
}

bool CudaEngine::run(const Stripe& s, const std::function<bool()>& stop) {
  UnitWork& u = *s.unit;
  const auto b = static_cast<std::size_t>(spec_.batch_rows);
  const auto c = static_cast<std::size_t>(outputs_);
  const auto k = static_cast<std::size_t>(spec_.top_k);
  const bool probs = spec_.kind == OutputKind::probabilities;
  const bool labelled = probs && !u.y.empty();
  // The stripe on its unit's batch grid: rows [off, off + n) of `batches` whole batches.
  const std::uint64_t batch0 = u.origin + (s.first_row - u.origin) / b * b;
  const auto off = static_cast<std::size_t>(s.first_row - batch0);
  const std::size_t n = s.rows;
  const std::size_t batches = (off + n + b - 1) / b;
  LOCUS_ASSERT(batches <= max_batches_ && s.x.size() == n * static_cast<std::size_t>(inputs_),
               fmt::format("a stripe of {} rows at offset {} in buffers of {} batches", n, off,
                           max_batches_));
  const std::size_t per_piece = (batches + kPieces - 1) / kPieces;
  const std::size_t in_unit = s.first_row - u.rows.begin;  // the stripe's first row in the unit

  if (labelled) {
    LOCUS_CUDA_CHECK(cudaMemcpyAsync(dev_.labels.data(), u.y.data() + in_unit,
                                     n * sizeof(std::int32_t), cudaMemcpyHostToDevice,
                                     copy_.get()));
  }
  upload(s, off, batches, per_piece);

  cudaStream_t cs = compute_.get();
  bool stopped = false;
  for (std::size_t j = 0; j < batches && !stopped; ++j) {
    if (j % per_piece == 0) LOCUS_CUDA_CHECK(cudaStreamWaitEvent(cs, copied_[j / per_piece].get(), 0));
    const float* logits = model_.forward(x_.data() + j * stride_, spec_.batch_rows, cs);
    const std::size_t lo = std::max(off, j * b), hi = std::min(off + n, (j + 1) * b);
    const std::size_t r = lo - off;  // the first of these rows in the stripe
    cuda::FinishArgs a;
    a.logits = logits;
    a.first = static_cast<int>(lo - j * b);
    a.rows = static_cast<int>(hi - lo);
    a.classes = outputs_;
    a.top_k = spec_.top_k;
    a.probabilities = probs;
    a.labels = labelled ? dev_.labels.data() + r : nullptr;
    a.values = dev_.values.data() + r * c;
    if (probs) {
      a.predicted = dev_.predicted.data() + r;
      a.loss = dev_.loss.data() + r;
      a.topk_index = k > 0 ? dev_.topk_index.data() + r * k : nullptr;
      a.topk_value = k > 0 ? dev_.topk_value.data() + r * k : nullptr;
    }
    cuda::finish_rows(a, cs);
    stopped = stop && stop();
  }
  if (!stopped) {  // only the outputs come back
    UnitOutputs& h = host_[static_cast<std::size_t>(u.slot)];
    auto d2h = [&](auto* dst, const auto* src, std::size_t count) {
      if (count > 0) {
        LOCUS_CUDA_CHECK(cudaMemcpyAsync(dst, src, count * sizeof(*src), cudaMemcpyDeviceToHost,
                                         cs));
      }
    };
    d2h(h.values.data() + in_unit * c, dev_.values.data(), n * c);
    if (probs) {
      d2h(h.predicted.data() + in_unit, dev_.predicted.data(), n);
      d2h(h.topk_index.data() + in_unit * k, dev_.topk_index.data(), n * k);
      d2h(h.topk_value.data() + in_unit * k, dev_.topk_value.data(), n * k);
      if (labelled) d2h(h.loss.data() + in_unit, dev_.loss.data(), n);
    }
  }
  // The ring's buffer (read by the copies) and the device buffers are free for the next stripe.
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(copy_.get()));
  LOCUS_CUDA_CHECK(cudaStreamSynchronize(cs));
  // A slowed rank (test hook) also stretches the device time just waited for.
  return !stopped && !(stop && stop());
}

void CudaEngine::finish(UnitWork& u) {
  const std::size_t n = u.rows.count;
  const auto c = static_cast<std::size_t>(outputs_);
  const auto k = static_cast<std::size_t>(spec_.top_k);
  const bool probs = spec_.kind == OutputKind::probabilities;
  const UnitOutputs& h = host_[static_cast<std::size_t>(u.slot)];
  Scores& out = u.scores;
  out.values.assign(h.values.data(), h.values.data() + n * c);
  out.predicted.assign(h.predicted.data(), h.predicted.data() + (probs ? n : 0));
  out.topk_index.assign(h.topk_index.data(), h.topk_index.data() + (probs ? n * k : 0));
  out.topk_value.assign(h.topk_value.data(), h.topk_value.data() + (probs ? n * k : 0));
  const bool labelled = probs && !u.y.empty();
  out.metrics.reset(labelled ? outputs_ : 0);
  if (!labelled) return;
  // As Scorer::finish, row by row in order, from the device's argmax and log-loss terms.
  Metrics& m = out.metrics;
  for (std::size_t r = 0; r < n; ++r) {
    const std::int32_t label = u.y[r];
    if (label < 0 || label >= outputs_) {
      ++m.out_of_range;
      continue;
    }
    const std::int32_t best = h.predicted.data()[r];
    ++m.rows;
    m.correct += label == best;
    m.confusion[static_cast<std::size_t>(label) * c + static_cast<std::size_t>(best)] += 1;
    m.log_loss_sum += h.loss.data()[r];
  }
}

}  // namespace

int cuda_select_device(const mpi::Comm& comm, int requested, train::Precision precision,
                       std::string* description) {
  const tc::SelectedDevice d = tc::use_device(comm, requested, "infer");
  *description = fmt::format("cuda {} on {}", train::to_string(precision), d.description);
  return d.index;
}

std::unique_ptr<Engine> make_cuda_engine(const train::Mlp& model, const ScoreSpec& spec,
                                         train::Precision precision, int device) {
  return std::make_unique<CudaEngine>(model, spec, precision, device);
}

}  // namespace locus::infer::detail
