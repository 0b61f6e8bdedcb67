// cuBLASLt plans per GEMM shape: descriptors, layouts and one algorithm, the heuristic's first
// unless a measurement shows it pathological (below).
#include "cuda/matmul.hpp"

#include <cstdio>

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <limits>
#include <mutex>
#include <vector>

#include "cuda/cublaslt_api.hpp"

namespace locus::train::cuda {

namespace {

// cuBLASLt's heuristic ranks candidates by a model that can be far off for small fp32 GEMMs
// (measured on an H200: its first pick for the last layer's weight gradient of the
// Fashion-MNIST MLP, m 128 x n 10 x k batch, took 55-63 us where others take 12-16, a third of
// the step). So the first call of a shape times the heuristic's candidates on the real
// operands and keeps the heuristic's pick unless it is pathological: over kSlowest times the
// fastest candidate AND slower by kMinSaving or more. Then it takes the FIRST candidate (in
// the heuristic's order) within kPickWithin of the fastest. Thresholds, not the fastest, so that
// the choice (and with it the bits of every result) does not follow the timing noise of
// near-equal candidates: the times of small GEMMs are mostly launch latency, and a
// replacement must save far more than their noise (an H200's pathological picks took 55-63 us
// against 12-16 for the one taken; the small shapes of the tests differ by under 10 us and
// keep the heuristic's pick). The candidates are timed in interleaved rounds (each once a
// round, the fastest of its rounds kept), so a drift during the measurement -- the clocks
// ramping up after an idle spell, another process's kernels -- falls on every candidate alike
// rather than on those timed first, the heuristic's pick among them. Chosen once per process,
// shape and workspace size: every Matmul of the process reuses it, so two trainers in one
// process compute the same bits.
constexpr int kCandidates = 8;
constexpr double kSlowest = 2.5;
constexpr double kPickWithin = 1.5;
constexpr double kMinSavingMs = 0.020;
constexpr int kTimedRuns = 5;

struct ChoiceKey {
  int device;
  Precision precision;
  std::size_t workspace;  // bytes: what an algorithm may use depends on it
  GemmShape shape;
  bool operator<(const ChoiceKey& o) const {
    return std::tie(device, precision, workspace, shape) <
           std::tie(o.device, o.precision, o.workspace, o.shape);
  }
};

std::mutex choices_mutex;
std::map<ChoiceKey, cublasLtMatmulAlgo_t>& choices() {
  static std::map<ChoiceKey, cublasLtMatmulAlgo_t> m;
  return m;
}

int current_device() {
  int d = 0;
  LOCUS_CUDA_CHECK(cudaGetDevice(&d));
  return d;
}

}  // namespace

struct Matmul::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  std::vector<cublasLtMatmulAlgo_t> candidates;  // the heuristic's, in its order
  bool chosen = false;  // algo settled (measured, or taken from the process's choices)
  ~Plan() {
    if (d != nullptr) lt().MatrixLayoutDestroy(d);
    if (b != nullptr) lt().MatrixLayoutDestroy(b);
    if (a != nullptr) lt().MatrixLayoutDestroy(a);
    if (op != nullptr) lt().MatmulDescDestroy(op);
  }
};

Matmul::Matmul(Precision precision, std::size_t workspace_bytes)
    : precision_(precision), workspace_(workspace_bytes) {
  LOCUS_CUBLAS_CHECK(lt().Create(&handle_));
}

Matmul::~Matmul() {
  for (auto& [shape, p] : plans_) delete p;
  if (handle_ != nullptr) lt().Destroy(handle_);
}

std::string Matmul::version() { return fmt::format("cuBLASLt {}", lt().GetVersion()); }

Matmul::Plan& Matmul::plan(const GemmShape& s) {
  if (auto it = plans_.find(s); it != plans_.end()) return *it->second;
  auto* p = new Plan;
  try {
    const cublasComputeType_t compute =
        precision_ == Precision::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const cudaDataType_t in_type = precision_ == Precision::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    LOCUS_CUBLAS_CHECK(lt().MatmulDescCreate(&p->op, compute, CUDA_R_32F));
    const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    LOCUS_CUBLAS_CHECK(lt().MatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                                      sizeof(ta)));
    LOCUS_CUBLAS_CHECK(lt().MatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                                      sizeof(tb)));
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    LOCUS_CUBLAS_CHECK(lt().MatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                      &epilogue, sizeof(epilogue)));
    // Stored shapes: A is (m x k) after op, so (k x m) stored when transposed.
    const int a_rows = s.trans_a ? s.k : s.m, a_cols = s.trans_a ? s.m : s.k;
    const int b_rows = s.trans_b ? s.n : s.k, b_cols = s.trans_b ? s.k : s.n;
    LOCUS_CUBLAS_CHECK(lt().MatrixLayoutCreate(&p->a, in_type, static_cast<std::uint64_t>(a_rows),
                                                  static_cast<std::uint64_t>(a_cols), s.lda));
    LOCUS_CUBLAS_CHECK(lt().MatrixLayoutCreate(&p->b, in_type, static_cast<std::uint64_t>(b_rows),
                                                  static_cast<std::uint64_t>(b_cols), s.ldb));
    LOCUS_CUBLAS_CHECK(lt().MatrixLayoutCreate(&p->d, CUDA_R_32F, static_cast<std::uint64_t>(s.m),
                                                  static_cast<std::uint64_t>(s.n), s.ldd));

    cublasLtMatmulPreference_t pref = nullptr;
    LOCUS_CUBLAS_CHECK(lt().MatmulPreferenceCreate(&pref));
    const std::uint64_t ws = workspace_.bytes();
    // Split-K reductions in place use atomic counters in the workspace: excluded, so the
    // summation order of a shape never changes between runs.
    const std::uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_MASK & ~CUBLASLT_REDUCTION_SCHEME_INPLACE;
    std::array<cublasLtMatmulHeuristicResult_t, kCandidates> results{};
    int found = 0;
    cublasStatus_t rc = lt().MatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (rc == CUBLAS_STATUS_SUCCESS) {
      rc = lt().MatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                &schemes, sizeof(schemes));
    }
    // Offsets inside the parameter buffer follow the PyTorch layout (a 10-float bias moves the
    // next layer by 40 bytes): tell the heuristic what the pointers really are.
    const std::uint32_t align[3] = {static_cast<std::uint32_t>(s.align_a),
                                    static_cast<std::uint32_t>(s.align_b),
                                    static_cast<std::uint32_t>(s.align_d)};
    const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4 && rc == CUBLAS_STATUS_SUCCESS; ++i) {
      rc = lt().MatmulPreferenceSetAttribute(pref, align_attr[i], &align[i < 2 ? i : 2],
                                                sizeof(std::uint32_t));
    }
    if (rc == CUBLAS_STATUS_SUCCESS) {
      rc = lt().MatmulAlgoGetHeuristic(handle_, p->op, p->a, p->b, p->d, p->d, pref,
                                          kCandidates, results.data(), &found);
    }
    lt().MatmulPreferenceDestroy(pref);
    // NOT_SUPPORTED: the heuristic found nothing for these types and alignments (cublasLt.h).
    if (rc == CUBLAS_STATUS_NOT_SUPPORTED) {
      found = 0;
    } else {
      LOCUS_CUBLAS_CHECK(rc);
    }
    if (found == 0) {
      throw CublasError(fmt::format(
          "cuBLASLt has no algorithm for a {} GEMM m={} n={} k={} (trans {}{}, ld {}/{}/{}) on "
          "{}: try train.precision = fp32",
          to_string(precision_), s.m, s.n, s.k, s.trans_a ? 'T' : 'N', s.trans_b ? 'T' : 'N',
          s.lda, s.ldb, s.ldd, device_text()));
    }
    p->candidates.clear();
    for (int i = 0; i < found; ++i) {
      if (results[static_cast<std::size_t>(i)].state == CUBLAS_STATUS_SUCCESS) {
        p->candidates.push_back(results[static_cast<std::size_t>(i)].algo);
      }
    }
    LOCUS_ASSERT(!p->candidates.empty(), "cuBLASLt returned no usable algorithm");
    p->algo = p->candidates.front();
  } catch (...) {
    delete p;
    throw;
  }
  plans_.emplace(s, p);
  return *p;
}

void Matmul::run(const GemmShape& s, const void* a, const void* b, float* d, cudaStream_t stream,
                 bool accumulate) {
  if (s.m == 0 || s.n == 0) return;
  Plan& p = plan(s);
  if (!p.chosen) choose(s, p, a, b, accumulate ? nullptr : d, stream);
  const float one = 1.0f, zero = 0.0f;
  LOCUS_CUBLAS_CHECK(lt().Matmul(handle_, p.op, &one, a, p.a, b, p.b, accumulate ? &one : &zero,
                                    d, p.d, d, p.d, &p.algo, workspace_.data(), workspace_.bytes(),
                                    stream));
}

}  // namespace locus::train::cuda

namespace locus::train::cuda {

// Times the candidates on the real operands into scratch: each launched once untimed, then
// kTimedRuns rounds in which each is timed once, in order. The fastest of a candidate's rounds
// in ms; +inf for one cuBLASLt refuses for these operands.
std::vector<double> Matmul::time_candidates(Plan& p, const void* a, const void* b,
                                            float* scratch, cudaStream_t stream) {
  const float one = 1.0f, zero = 0.0f;
  auto launch = [&](const cublasLtMatmulAlgo_t& algo) {
    return lt().Matmul(handle_, p.op, &one, a, p.a, b, p.b, &zero, scratch, p.d, scratch, p.d,
                          &algo, workspace_.data(), workspace_.bytes(), stream);
  };
  constexpr double kRefused = std::numeric_limits<double>::infinity();
  std::vector<double> ms(p.candidates.size(), kRefused);
  std::vector<bool> usable(p.candidates.size());
  for (std::size_t i = 0; i < p.candidates.size(); ++i) {
    usable[i] = launch(p.candidates[i]) == CUBLAS_STATUS_SUCCESS;
    // A refusal may come from a failed launch: its error is not the stream's, and left
    // pending it would fail the next kernel's check (cudaPeekAtLastError).
    if (!usable[i]) (void)cudaGetLastError();
  }
  const Event begin = make_timing_event(), end = make_timing_event();
  for (int round = 0; round < kTimedRuns; ++round) {
    for (std::size_t i = 0; i < p.candidates.size(); ++i) {
      if (!usable[i]) continue;
      float t = 0;
      usable[i] = cudaEventRecord(begin.get(), stream) == cudaSuccess &&
                  launch(p.candidates[i]) == CUBLAS_STATUS_SUCCESS &&
                  cudaEventRecord(end.get(), stream) == cudaSuccess &&
                  cudaEventSynchronize(end.get()) == cudaSuccess &&
                  cudaEventElapsedTime(&t, begin.get(), end.get()) == cudaSuccess;
      if (!usable[i]) {
        (void)cudaGetLastError();  // a refused launch is not the stream's error
        ms[i] = kRefused;
      } else {
        ms[i] = std::min(ms[i], static_cast<double>(t));
      }
    }
  }
  return ms;
}

namespace {

// Device memory allocated and freed in stream order (cudaMallocAsync / cudaFreeAsync), so
// neither waits for the rest of the device; cudaMalloc / cudaFree where the device has no
// memory pools (the free then waits for the whole device, as before).
class StreamScratch {
 public:
  StreamScratch(std::size_t bytes, cudaStream_t s) : stream_(s) {
    if (bytes == 0) return;
    int device = 0, pools = 0;
    LOCUS_CUDA_CHECK(cudaGetDevice(&device));
    LOCUS_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
    pooled_ = pools != 0;
    LOCUS_CUDA_CHECK(pooled_ ? cudaMallocAsync(&p_, bytes, s) : cudaMalloc(&p_, bytes));
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  ~StreamScratch() {
    if (p_ == nullptr) return;
    // Never throws; a failure is not left as the last error for the next launch's check.
    if ((pooled_ ? cudaFreeAsync(p_, stream_) : cudaFree(p_)) != cudaSuccess) {
      (void)cudaGetLastError();
    }
  }
  void* get() const noexcept { return p_; }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
  bool pooled_ = true;
};

}  // namespace

// d: where the candidates may write (the run that follows overwrites it), or null (an
// accumulating run reads it): a scratch buffer then.
void Matmul::choose(const GemmShape& s, Plan& p, const void* a, const void* b, float* d,
                    cudaStream_t stream) {
  if (!measure_ || p.candidates.size() < 2) {  // the heuristic's first, never timed
    p.chosen = true;
    return;
  }
  const ChoiceKey key{current_device(), precision_, workspace_.bytes(), s};
  {
    const std::lock_guard lock(choices_mutex);
    if (auto it = choices().find(key); it != choices().end()) {
      p.algo = it->second;
      p.chosen = true;
      return;
    }
  }
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  LOCUS_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return;  // a capture measures nothing
  if (before_wait_) before_wait_(stream);
  // Where d will not do (an accumulating GEMM reads it), scratch in stream order: a cudaFree
  // would wait for the whole device, a reduction or a stage transfer in flight included.
  StreamScratch scratch(d != nullptr ? std::size_t{0}
                                     : static_cast<std::size_t>(s.ldd) *
                                           static_cast<std::size_t>(s.n) * sizeof(float),
                        stream);
  const std::vector<double> ms =
      time_candidates(p, a, b, d != nullptr ? d : static_cast<float*>(scratch.get()), stream);
  const double best = *std::min_element(ms.begin(), ms.end());
  std::size_t pick = 0;  // a candidate refused by cuBLASLt times +inf
  if (!(ms[0] <= kSlowest * best) && !(ms[0] - best < kMinSavingMs)) {
    while (!(ms[pick] <= kPickWithin * best)) ++pick;  // stops at the fastest at the latest
  }
  p.algo = p.candidates[pick];
  p.chosen = true;
  if (pick != 0) {
    // On stderr, once per process and shape: every rank measures its own.
    fmt::print(stderr,
               "note: GPU {}: {} GEMM m={} n={} k={} ({}{}): cuBLASLt's first algorithm took "
               "{:.1f} us, the fastest of {} {:.1f} us: candidate {} ({:.1f} us) taken\n",
               device_text(), to_string(precision_), s.m, s.n, s.k, s.trans_a ? 'T' : 'N',
               s.trans_b ? 'T' : 'N', ms[0] * 1e3, ms.size(), best * 1e3, pick, ms[pick] * 1e3);
  }
  const std::lock_guard lock(choices_mutex);
  const auto [it, fresh] = choices().emplace(key, p.algo);
  if (!fresh) p.algo = it->second;  // another thread of the process chose first: share it
}

}  // namespace locus::train::cuda
