// Private to the CUDA backend: row-major GEMMs of the MLP through cuBLASLt, which is
// column-major. A row-major [rows, cols] matrix is the column-major [cols, rows] one with the
// same bytes, so each product below is computed as its transpose (as llm.c's
// matmul_cublaslt does):
//   forward  Z[b, out]  = X[b, in] W^T      as  Z^T = op_T(W) X^T      (m out, n b,  k in)
//   weights  dW[out, in] = dZ^T X          as  dW^T = X^T op_T(dZ^T)  (m in,  n out, k b)
//   inputs   dX[b, in]  = dZ W             as  dX^T = W^T dZ^T        (m in,  n b,  k out)
// One descriptor set and one algorithm per shape, chosen once with a fixed workspace and never
// changed (deterministic: the same algorithm gives the same bits), excluding in-place
// (atomic-counter) split-K reductions: cuBLASLt's heuristic's first pick, unless timing its
// candidates on the first call shows that pick more than 2.5x and 20 us slower than the
// fastest (then the first candidate in its order within 1.5x of it; timed in interleaved
// rounds, once per process, shape and workspace size, see matmul.cpp).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/memory.hpp"
#include "locus/train/model/precision.hpp"

namespace locus::train::cuda {

// Largest power of two (<= 256) that divides the address: cuBLASLt picks algorithms by it.
inline int alignment_of(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  int align = 256;
  while (align > 1 && a % static_cast<std::uintptr_t>(align) != 0) align /= 2;
  return align;
}

enum class Operand { f32, bf16 };

// D (float32, column-major m x n, ld ldd) = op(A) op(B), where op is the transpose when the
// flag is set; A and B hold f32 or bf16 as the precision says. No epilogue: the bias and the
// activation follow in a kernel of their own (kernels.hpp, bias_act_forward), which also
// applies dropout and keeps what the backward pass needs.
struct GemmShape {
  int m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  int lda = 0, ldb = 0, ldd = 0;
  int align_a = 256, align_b = 256, align_d = 256;  // bytes the pointers are aligned to
  auto key() const {
    return std::tie(m, n, k, trans_a, trans_b, lda, ldb, ldd, align_a, align_b, align_d);
  }
  bool operator<(const GemmShape& o) const { return key() < o.key(); }
};

class Matmul {
 public:
  Matmul(Precision precision, std::size_t workspace_bytes = std::size_t{32} << 20);
  ~Matmul();
  Matmul(const Matmul&) = delete;
  Matmul& operator=(const Matmul&) = delete;

  // Enqueues D = op(A) op(B) on stream, or with accumulate D += op(A) op(B) (beta =
  // 1, D read in place: a pipeline stage's weight gradients over micro-batches). a, b are
  // float* (fp32/tf32) or __nv_bfloat16* (bf16). The first call of a shape picks its
  // algorithm (not capturable: run each shape once before capturing a graph).
  void run(const GemmShape& shape, const void* a, const void* b, float* d, cudaStream_t stream,
           bool accumulate = false);

  Precision precision() const noexcept { return precision_; }
  // Off: the heuristic's first pick, never timed (train.gemm_select = heuristic).
  void set_measure(bool on) noexcept { measure_ = on; }
  // Called with the stream before timing a new shape's candidates, which waits (on the host)
  // for the stream: the owner's waits that watch the peers the stream may wait for (a
  // reducer's, a stage link's), so a peer that died then ends the job as theirs, not in a
  // wait inside CUDA (Compute::before_host_waits).
  void set_before_wait(std::function<void(void*)> settle) { before_wait_ = std::move(settle); }
  // "cuBLASLt 130000" for checkpoint provenance.
  static std::string version();

 private:
  struct Plan;
  Plan& plan(const GemmShape& shape);
  void choose(const GemmShape& shape, Plan& p, const void* a, const void* b, float* d,
              cudaStream_t stream);
  std::vector<double> time_candidates(Plan& p, const void* a, const void* b, float* scratch,
                                      cudaStream_t stream);

  Precision precision_;
  cublasLtHandle_t handle_ = nullptr;
  DeviceBuffer<std::uint8_t> workspace_;
  std::map<GemmShape, Plan*> plans_;
  bool measure_ = true;
  std::function<void(void*)> before_wait_;
};

}  // namespace locus::train::cuda
