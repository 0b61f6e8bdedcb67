// cuBLASLt plans per GEMM shape: descriptors, layouts and one heuristic-chosen algorithm.
#include "cuda/matmul.hpp"

#include <fmt/format.h>

namespace locus::train::cuda {

struct Matmul::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

Matmul::Matmul(Precision precision, std::size_t workspace_bytes)
    : precision_(precision), workspace_(workspace_bytes) {
  LOCUS_CUBLAS_CHECK(cublasLtCreate(&handle_));
}

Matmul::~Matmul() {
  for (auto& [shape, p] : plans_) delete p;
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

std::string Matmul::version() { return fmt::format("cuBLASLt {}", cublasLtGetVersion()); }

Matmul::Plan& Matmul::plan(const GemmShape& s) {
  if (auto it = plans_.find(s); it != plans_.end()) return *it->second;
  auto* p = new Plan;
  try {
    const cublasComputeType_t compute =
        precision_ == Precision::tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    const cudaDataType_t in_type = precision_ == Precision::bf16 ? CUDA_R_16BF : CUDA_R_32F;
    LOCUS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->op, compute, CUDA_R_32F));
    const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    LOCUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta,
                                                      sizeof(ta)));
    LOCUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb,
                                                      sizeof(tb)));
    const cublasLtEpilogue_t epilogue = s.bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    LOCUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                      &epilogue, sizeof(epilogue)));
    if (s.bias) {
      const cudaDataType_t bias_type = CUDA_R_32F;
      LOCUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          p->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    }
    // Stored shapes: A is (m x k) after op, so (k x m) stored when transposed.
    const int a_rows = s.trans_a ? s.k : s.m, a_cols = s.trans_a ? s.m : s.k;
    const int b_rows = s.trans_b ? s.n : s.k, b_cols = s.trans_b ? s.k : s.n;
    LOCUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->a, in_type, static_cast<std::uint64_t>(a_rows),
                                                  static_cast<std::uint64_t>(a_cols), s.lda));
    LOCUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->b, in_type, static_cast<std::uint64_t>(b_rows),
                                                  static_cast<std::uint64_t>(b_cols), s.ldb));
    LOCUS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->d, CUDA_R_32F, static_cast<std::uint64_t>(s.m),
                                                  static_cast<std::uint64_t>(s.n), s.ldd));

    cublasLtMatmulPreference_t pref = nullptr;
    LOCUS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const std::uint64_t ws = workspace_.bytes();
    // Split-K reductions in place use atomic counters in the workspace: excluded, so the
    // summation order of a shape never changes between runs.
    const std::uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_MASK & ~CUBLASLT_REDUCTION_SCHEME_INPLACE;
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    cublasStatus_t rc = cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    if (rc == CUBLAS_STATUS_SUCCESS) {
      rc = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
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
      rc = cublasLtMatmulPreferenceSetAttribute(pref, align_attr[i], &align[i < 2 ? i : 2],
                                                sizeof(std::uint32_t));
    }
    if (rc == CUBLAS_STATUS_SUCCESS) {
      rc = cublasLtMatmulAlgoGetHeuristic(handle_, p->op, p->a, p->b, p->d, p->d, pref, 1,
                                          &result, &found);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    LOCUS_CUBLAS_CHECK(rc);
    if (found == 0) {
      throw CublasError(fmt::format(
          "cuBLASLt has no algorithm for a {} GEMM m={} n={} k={} (trans {}{}, ld {}/{}/{}) on "
          "{}: try train.precision = fp32",
          to_string(precision_), s.m, s.n, s.k, s.trans_a ? 'T' : 'N', s.trans_b ? 'T' : 'N',
          s.lda, s.ldb, s.ldd, device_text()));
    }
    p->algo = result.algo;
  } catch (...) {
    delete p;
    throw;
  }
  plans_.emplace(s, p);
  return *p;
}

void Matmul::run(const GemmShape& s, const void* a, const void* b, float* d, const float* bias,
                 cudaStream_t stream, bool accumulate) {
  if (s.m == 0 || s.n == 0) return;
  Plan& p = plan(s);
  if (s.bias) {
    LOCUS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &bias, sizeof(bias)));
  }
  const float one = 1.0f, zero = 0.0f;
  LOCUS_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &one, a, p.a, b, p.b, accumulate ? &one : &zero,
                                    d, p.d, d, p.d, &p.algo, workspace_.data(), workspace_.bytes(),
                                    stream));
}

}  // namespace locus::train::cuda
