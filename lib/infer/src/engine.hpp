// The compute engine of the scoring loop (private): what turns the stripes of a unit into its
// results, behind one small interface chosen once per run (infer.backend), so the loop never
// branches on the backend.
//   cpu:  the Scorer's forward passes into the unit's logits on the compute thread; softmax,
//         argmax, top-k and metrics on the main thread (Scorer::finish).
//   cuda: (src/cuda) each stripe copied to the GPU on a copy stream, the forward pass, softmax,
//         argmax, top-k and per-row log-loss on the device, only those outputs copied back
//         into page-locked memory; the main thread adds up the metrics.
// Every engine computes each batch as a full batch_rows-row product on the unit's batch grid,
// so a row's results do not depend on the unit, stripe, rank or run that scores it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "locus/comm/mpi.hpp"
#include "locus/infer/infer.hpp"
#include "locus/infer/scorer.hpp"
#include "locus/train/model/model.hpp"
#include "locus/train/model/precision.hpp"

namespace locus::infer::detail {

struct UnitWork;
struct Stripe;

class Engine {
 public:
  Engine() = default;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;
  virtual ~Engine() = default;

  virtual const ScoreSpec& spec() const noexcept = 0;
  virtual int outputs() const noexcept = 0;

  // Main thread, once before the first stripe: the host ring the stripes are read into, the
  // rows of a stripe and the most rows of a unit. What it returns (a device engine: the ring's
  // page-locking) must be destroyed after the compute thread stops and before the ring goes.
  struct Attachment {
    virtual ~Attachment() = default;
  };
  virtual std::unique_ptr<Attachment> attach(std::span<float> ring, std::uint64_t stripe_rows,
                                             std::uint64_t unit_rows) {
    (void)ring, (void)stripe_rows, (void)unit_rows;
    return nullptr;
  }
  // Compute thread, once before its first stripe (a device engine makes its GPU current).
  virtual void on_compute_thread() {}
  // Main thread, when unit u is claimed (u.rows, u.slot set): sizes its result buffers.
  virtual void start_unit(UnitWork& u) = 0;
  // Compute thread: stripe s of its unit (s.x: the features of s.rows rows from s.first_row on
  // the unit's batch grid). stop() is polled after every batch; false when it returned true
  // (the unit is abandoned). s.x may be reused once this returns.
  virtual bool run(const Stripe& s, const std::function<bool()>& stop) = 0;
  // Main thread, once every stripe of u ran to its end: u.scores (values, argmax, top-k and,
  // with labels in u.y, metrics).
  virtual void finish(UnitWork& u) = 0;
};

// What run_inference decided about the backend, identical on every rank.
struct EngineChoice {
  bool cuda = false;
  train::Precision precision = train::Precision::fp32;
  int device = -1;          // cuda: the device this rank uses
  std::string description;  // "cpu (OpenBLAS, 1 BLAS thread)", "cuda fp32 on device 0 ..."
};

// Collective over comm (the node-local split that picks the GPU): validates infer.backend,
// infer.precision and infer.device and selects this rank's device. ConfigError, agreed by the
// caller: an unknown backend or precision, a precision other than fp32 on the cpu, cuda in a
// build without CUDA or on a host without a usable GPU, a device index out of range.
EngineChoice choose_engine(const mpi::Comm& comm, const InferOptions& opts);

// The engine for this rank; the model must outlive it. ConfigError for a bad ScoreSpec (as
// Scorer); CudaError when the device cannot hold the model or the buffers.
std::unique_ptr<Engine> make_engine(const EngineChoice& choice, const train::Mlp& model,
                                    const ScoreSpec& spec);

}  // namespace locus::infer::detail
