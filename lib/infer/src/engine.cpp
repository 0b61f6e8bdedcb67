// The engine factory (the one place that knows which backends this build has) and the cpu
// engine: the Scorer's forward passes on the compute thread, its finish() on the main thread.
#include "engine.hpp"

#include <fmt/format.h>

#include "compute_thread.hpp"
#include "locus/comm/error.hpp"
#include "locus/config.hpp"
#if LOCUS_WITH_CUDA
#include "cuda/cuda_engine.hpp"
#endif

namespace locus::infer::detail {

namespace {

class CpuEngine final : public Engine {
 public:
  CpuEngine(const train::Mlp& model, const ScoreSpec& spec) : scorer_(model, spec) {}

  const ScoreSpec& spec() const noexcept override { return scorer_.spec(); }
  int outputs() const noexcept override { return scorer_.outputs(); }

  void start_unit(UnitWork& u) override {
    u.logits.resize(u.rows.count * static_cast<std::size_t>(scorer_.outputs()));
  }

  bool run(const Stripe& s, const std::function<bool()>& stop) override {
    UnitWork& u = *s.unit;
    const auto c = static_cast<std::size_t>(scorer_.outputs());
    const std::span<float> logits(u.logits.data() + (s.first_row - u.rows.begin) * c, s.rows * c);
    return scorer_.forward(u.origin, s.first_row, s.x, logits, stop);
  }

  void finish(UnitWork& u) override { scorer_.finish(u.logits, u.y, u.scores); }

 private:
  Scorer scorer_;
};

}  // namespace

EngineChoice choose_engine(const mpi::Comm& comm, const InferOptions& o) {
  EngineChoice c;
  c.precision = train::parse_precision(o.precision, "infer.precision");
  if (o.backend == "cpu") {
    if (c.precision != train::Precision::fp32) {
      throw ConfigError(fmt::format("infer.precision = {} needs a GPU: the cpu backend computes "
                                    "in fp32 (set infer.precision = fp32, or infer.backend = "
                                    "cuda)", o.precision));
    }
    if (o.device != -1) {
      throw ConfigError(fmt::format("infer.device = {} picks a GPU, but infer.backend = cpu "
                                    "computes on the host (set infer.backend = cuda, or "
                                    "infer.device = -1)",
                                    o.device));
    }
    c.description = fmt::format("cpu (OpenBLAS, {} BLAS thread{})", o.blas_threads,
                                o.blas_threads == 1 ? "" : "s");
    return c;
  }
  if (o.backend != "cuda") {
    throw ConfigError(fmt::format("infer.backend = '{}' is unknown: use cpu or cuda", o.backend));
  }
#if LOCUS_WITH_CUDA
  c.cuda = true;
  c.device = cuda_select_device(comm, o.device, c.precision, &c.description);
  return c;
#else
  (void)comm;
  throw ConfigError("infer.backend = cuda, but this build of locus has no CUDA backend; "
                    "available: cpu (set infer.backend = cpu, or rebuild with CUDA 13 under "
                    "/usr/local/cuda and -DLOCUS_WITH_CUDA=ON)");
#endif
}

std::unique_ptr<Engine> make_engine(const EngineChoice& choice, const train::Mlp& model,
                                    const ScoreSpec& spec) {
#if LOCUS_WITH_CUDA
  if (choice.cuda) return make_cuda_engine(model, spec, choice.precision, choice.device);
#else
  LOCUS_ASSERT(!choice.cuda, "a cuda engine in a build without CUDA");
#endif
  return std::make_unique<CpuEngine>(model, spec);
}

}  // namespace locus::infer::detail
