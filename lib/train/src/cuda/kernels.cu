// The CUDA backend's elementwise, reduction and optimizer kernels (contract: kernels.hpp).
// Each launcher picks a float4 path when every pointer it touches is 16-byte aligned (bf16
// copies 8-byte) and the row width allows it, a scalar path otherwise; both compute the same
// expressions, so only speed depends on alignment. Reductions never use floating-point atomics:
// their order is fixed by the sizes alone (spelled out at each kernel), so a result is bitwise
// repeatable on one device kind. Nothing here allocates or synchronises (graph-capturable).
//
// Expressions mirror the CPU references operation for operation (nvcc runs with --fmad=false,
// like -ffp-contract=off on the CPU, and with IEEE division and sqrt), so the optimizers give
// the CPU's bits on the same inputs; only expf/logf/tanhf differ from glibc by an ulp or so.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "cuda/cuda_check.hpp"
#include "cuda/kernels.hpp"
#include "model/hash.hpp"

namespace locus::train::cuda {

namespace {

constexpr int kThreads = 256;                 // every kernel's block size, unless noted
constexpr unsigned kMaxBlocks = 4096;         // grid-stride kernels: ~1M threads in flight
constexpr unsigned kMaxGridY = 65535;         // CUDA's limit on gridDim.y
constexpr unsigned kFull = 0xffffffffu;       // all lanes of a warp
constexpr int kColumnRun = 32;                // column_sums: rows summed by one thread
constexpr int kColumnRuns = kColumnBlock / kColumnRun;
static_assert(kColumnRuns * kColumnRun == kColumnBlock);
constexpr int kNormThreads = 256;
constexpr int kNormVecs = kNormBlock / (4 * kNormThreads);  // float4s per thread per block
static_assert(kNormVecs * 4 * kNormThreads == kNormBlock);

// ---- host helpers ----------------------------------------------------------------------

bool aligned(const void* p, std::uintptr_t bytes) noexcept {
  return p == nullptr || reinterpret_cast<std::uintptr_t>(p) % bytes == 0;
}

unsigned ceil_div(std::size_t a, std::size_t b) noexcept {
  return static_cast<unsigned>((a + b - 1) / b);
}

unsigned flat_blocks(std::size_t work) noexcept {
  const std::size_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < kMaxBlocks ? (blocks > 0 ? blocks : 1) : kMaxBlocks);
}

// Block and grid of a [rows, units] kernel (units per row: columns or float4s): x runs along a
// row (a power of two up to 256 covering it), y over rows (grid-stride past 65535).
struct RowShape {
  dim3 grid, block;
};
RowShape row_shape(int rows, int units) noexcept {
  unsigned bx = 1;
  while (bx < static_cast<unsigned>(units) && bx < kThreads) bx *= 2;
  const unsigned by = kThreads / bx;
  const unsigned gy = ceil_div(static_cast<std::size_t>(rows), by);
  return {dim3(ceil_div(static_cast<std::size_t>(units), bx), gy < kMaxGridY ? gy : kMaxGridY),
          dim3(bx, by)};
}

// max_blocks > 0 caps the row blocks (grid.y) so that the grid holds about that many blocks;
// rows wider than max_blocks column blocks keep one row block (grid.x is never cut).
RowShape capped(RowShape sh, int max_blocks) noexcept {
  if (max_blocks > 0) {
    const unsigned y = std::max(1u, static_cast<unsigned>(max_blocks) / sh.grid.x);
    sh.grid.y = std::min(sh.grid.y, y);
  }
  return sh;
}

// ---- device helpers --------------------------------------------------------------------

template <int V>
struct Vec {
  float v[V];
};

template <int V>
__device__ __forceinline__ Vec<V> load(const float* p) {
  Vec<V> r;
  if constexpr (V == 4) {
    const float4 t = *reinterpret_cast<const float4*>(p);
    r.v[0] = t.x;
    r.v[1] = t.y;
    r.v[2] = t.z;
    r.v[3] = t.w;
  } else {
    r.v[0] = *p;
  }
  return r;
}

template <int V>
__device__ __forceinline__ void store(float* p, const Vec<V>& x) {
  if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(x.v[0], x.v[1], x.v[2], x.v[3]);
  } else {
    *p = x.v[0];
  }
}

struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};

template <int V>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* p, const Vec<V>& x) {
  if constexpr (V == 4) {
    *reinterpret_cast<Bf16x4*>(p) =
        Bf16x4{__floats2bfloat162_rn(x.v[0], x.v[1]), __floats2bfloat162_rn(x.v[2], x.v[3])};
  } else {
    *p = __float2bfloat16_rn(x.v[0]);
  }
}

// Butterfly sums: every lane ends with the same bits (each step adds the same two values).
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
  return v;
}

// Sum over a block (blockDim.x a multiple of 32, <= 1024): per-warp butterfly, then every
// warp sums the warp sums the same way, so every thread returns the same bits.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* smem /* [32] */) {
  v = warp_sum(v);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  __syncthreads();  // smem may still be read by a previous call
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  return warp_sum(lane < static_cast<int>(blockDim.x >> 5) ? smem[lane] : T(0));
}

// The first maximum, as the CPU's `best = z[j] > z[best] ? j : best`: larger value wins, a tie
// goes to the smaller index.
__device__ __forceinline__ void argmax_merge(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) {
    v = ov;
    i = oi;
  }
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    argmax_merge(v, i, __shfl_xor_sync(kFull, v, off), __shfl_xor_sync(kFull, i, off));
  }
}

__device__ __forceinline__ void block_argmax(float& v, int& i, float* sv, int* si) {
  warp_argmax(v, i);
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  __syncthreads();
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();
  const bool live = lane < static_cast<int>(blockDim.x >> 5);
  v = live ? sv[lane] : -INFINITY;
  i = live ? si[lane] : INT_MAX;
  warp_argmax(v, i);
}

// A row's loss and hit in one double of row_scratch: losses are >= 0 (logsumexp >= z[label];
// a mean of squares), so the sign bit is free to carry "argmax == label".
__device__ __forceinline__ double encode_row(double loss, bool correct) {
  return correct ? -loss : loss;
}

// ---- forward epilogue ------------------------------------------------------------------

// GELU (tanh approximation) and its derivative: model/kernels.hpp gelu_tanh, term for term.
__device__ __forceinline__ void gelu_tanh(float z, float& y, float& dy) {
  constexpr float kAlpha = 0.7978845608028654f;
  constexpr float kBeta = 0.044715f;
  const float inner = kAlpha * (z + kBeta * z * z * z);
  const float t = tanhf(inner);
  y = 0.5f * z * (1.0f + t);
  dy = 0.5f * (1.0f + t) + 0.5f * z * (1.0f - t * t) * kAlpha * (1.0f + 3.0f * kBeta * z * z);
}

template <Act kAct>
__device__ __forceinline__ void activate(float z, float& y, float& dy) {
  if constexpr (kAct == Act::relu) {
    y = z > 0.0f ? z : 0.0f;
    dy = z > 0.0f ? 1.0f : 0.0f;
  } else if constexpr (kAct == Act::gelu) {
    gelu_tanh(z, y, dy);
  } else if constexpr (kAct == Act::tanh) {
    y = tanhf(z);
    dy = 1.0f - y * y;
  } else {
    y = z;
    dy = 1.0f;
  }
}

struct ForwardArgs {
  float* z;
  float* deriv;
  __nv_bfloat16* out_bf16;
  const float* bias;
  int rows, cols;
  // dropout (used when the kernel's kDropout is set)
  std::uint64_t threshold;
  float scale;
  std::uint64_t seed;
  int layer;
  const std::uint64_t* step;
  const std::uint64_t* sample_ids;
};

// Thread (x, y) owns V consecutive columns of rows y, y + gridDim.y * blockDim.y, ...: the
// bias is loaded once and a row's dropout key is derived once per V units.
template <Act kAct, int V, bool kDropout>
__global__ void __launch_bounds__(kThreads) bias_act_kernel(ForwardArgs a) {
  const int unit = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (unit >= a.cols / V) return;
  const int j0 = unit * V;
  const Vec<V> b = load<V>(a.bias + j0);
  const std::uint64_t step = kDropout ? *a.step : 0;
  for (int r = static_cast<int>(blockIdx.y * blockDim.y + threadIdx.y); r < a.rows;
       r += static_cast<int>(gridDim.y * blockDim.y)) {
    const std::size_t off = static_cast<std::size_t>(r) * static_cast<std::size_t>(a.cols) +
                            static_cast<std::size_t>(j0);
    Vec<V> y = load<V>(a.z + off);
    Vec<V> dy;
    std::uint64_t key = 0;
    if constexpr (kDropout) key = detail::dropout_row_key(a.seed, step, a.layer, a.sample_ids[r]);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      activate<kAct>(y.v[k] + b.v[k], y.v[k], dy.v[k]);
      if constexpr (kDropout) {
        const float factor = detail::keep_unit(key, j0 + k, a.threshold) ? a.scale : 0.0f;
        y.v[k] *= factor;
        dy.v[k] *= factor;
      }
    }
    store<V>(a.z + off, y);
    if (a.deriv != nullptr) store<V>(a.deriv + off, dy);
    if (a.out_bf16 != nullptr) store_bf16<V>(a.out_bf16 + off, y);
  }
}

template <Act kAct>
void launch_bias_act(const ForwardArgs& a, bool vec4, bool dropout, cudaStream_t s) {
  const RowShape sh = row_shape(a.rows, vec4 ? a.cols / 4 : a.cols);
  if (vec4 && dropout) {
    bias_act_kernel<kAct, 4, true><<<sh.grid, sh.block, 0, s>>>(a);
  } else if (vec4) {
    bias_act_kernel<kAct, 4, false><<<sh.grid, sh.block, 0, s>>>(a);
  } else if (dropout) {
    bias_act_kernel<kAct, 1, true><<<sh.grid, sh.block, 0, s>>>(a);
  } else {
    bias_act_kernel<kAct, 1, false><<<sh.grid, sh.block, 0, s>>>(a);
  }
  LOCUS_CUDA_CHECK_LAUNCH("bias_act_kernel");
}

// ---- flat elementwise passes -----------------------------------------------------------

// Op::apply<V>(i) handles elements [i, i + V); Op::prepare() loads the per-launch scalars it
// reads from device memory once per thread. Float4s first, then the n % 4 tail one by one.
template <class Op, int V>
__global__ void __launch_bounds__(kThreads) flat_kernel(Op op, std::size_t n) {
  Op o = op;
  o.prepare();
  const std::size_t nvec = n / V;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  const std::size_t tid = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (std::size_t i = tid; i < nvec; i += stride) o.template apply<V>(i * V);
  if constexpr (V > 1) {
    if (tid < n - nvec * V) o.template apply<1>(nvec * V + tid);
  }
}

template <class Op>
void launch_flat(const Op& op, std::size_t n, bool vec4, cudaStream_t s) {
  if (vec4) {
    flat_kernel<Op, 4><<<flat_blocks(n / 4), kThreads, 0, s>>>(op, n);
  } else {
    flat_kernel<Op, 1><<<flat_blocks(n), kThreads, 0, s>>>(op, n);
  }
  LOCUS_CUDA_CHECK_LAUNCH("flat_kernel");
}

template <bool kDeriv>
struct ActBackwardOp {
  float* g;
  const float* deriv;
  const float* h;
  float scale;
  __nv_bfloat16* g_bf16;
  __device__ void prepare() {}
  template <int V>
  __device__ void apply(std::size_t i) const {
    Vec<V> x = load<V>(g + i);
    if constexpr (kDeriv) {
      const Vec<V> d = load<V>(deriv + i);
#pragma unroll
      for (int k = 0; k < V; ++k) x.v[k] = x.v[k] * d.v[k];
    } else {
      const Vec<V> hv = load<V>(h + i);
#pragma unroll
      for (int k = 0; k < V; ++k) x.v[k] = hv.v[k] > 0.0f ? x.v[k] * scale : 0.0f;
    }
    store<V>(g + i, x);
    if (g_bf16 != nullptr) store_bf16<V>(g_bf16 + i, x);
  }
};

struct AddIntoOp {
  float* dst;
  const float* src;
  __device__ void prepare() {}
  template <int V>
  __device__ void apply(std::size_t i) const {
    Vec<V> d = load<V>(dst + i);
    const Vec<V> x = load<V>(src + i);
#pragma unroll
    for (int k = 0; k < V; ++k) d.v[k] = d.v[k] + x.v[k];
    store<V>(dst + i, d);
  }
};

struct ToBf16Op {
  const float* src;
  __nv_bfloat16* dst;
  __device__ void prepare() {}
  template <int V>
  __device__ void apply(std::size_t i) const {
    store_bf16<V>(dst + i, load<V>(src + i));
  }
};

// optim/sgd.cpp sgd_loop, with the buffer read as 0 on the first step (the CPU zero-fills it).
template <bool kDecay, bool kMomentum, bool kNesterov>
struct SgdOp {
  float* p;
  const float* g;
  float* buf;
  __nv_bfloat16* p16;
  float decay, momentum;
  const OptimizerScalars* scalars;
  const float* grad_scale;
  const double* gate;
  float neg_lr, grad_coef, scale;
  int first;
  bool live;
  __device__ void prepare() {
    neg_lr = scalars->neg_lr;
    grad_coef = scalars->grad_coef;
    first = scalars->first_step;
    scale = *grad_scale;
    live = gate == nullptr || isfinite(*gate);
  }
  template <int V>
  __device__ void apply(std::size_t i) const {
    if (!live) return;
    Vec<V> pv = load<V>(p + i);
    const Vec<V> gv = load<V>(g + i);
    Vec<V> bv{};
    if constexpr (kMomentum) {
      if (first == 0) bv = load<V>(buf + i);
    }
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float d = gv.v[k] * scale;
      if constexpr (kDecay) d = d + decay * pv.v[k];
      if constexpr (kMomentum) {
        const float b = bv.v[k] * momentum + grad_coef * d;
        bv.v[k] = b;
        d = kNesterov ? d + momentum * b : b;
      }
      pv.v[k] = pv.v[k] + neg_lr * d;
    }
    if constexpr (kMomentum) store<V>(buf + i, bv);
    store<V>(p + i, pv);
    if (p16 != nullptr) store_bf16<V>(p16 + i, pv);
  }
};

enum class Decay { none, l2, decoupled };

// optim/adam.cpp adam_loop.
template <Decay kDecay>
struct AdamOp {
  float* p;
  const float* g;
  float* m;
  float* v;
  __nv_bfloat16* p16;
  float decay, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
  const OptimizerScalars* scalars;
  const float* grad_scale;
  const double* gate;
  float scale, decay_factor, bias2_sqrt, neg_step_size;
  bool live;
  __device__ void prepare() {
    scale = *grad_scale;
    decay_factor = scalars->decay_factor;
    bias2_sqrt = scalars->bias2_sqrt;
    neg_step_size = scalars->neg_step_size;
    live = gate == nullptr || isfinite(*gate);
  }
  template <int V>
  __device__ void apply(std::size_t i) const {
    if (!live) return;
    Vec<V> pv = load<V>(p + i);
    const Vec<V> gv = load<V>(g + i);
    Vec<V> mv = load<V>(m + i);
    Vec<V> vv = load<V>(v + i);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      float grad = gv.v[k] * scale;
      float param = pv.v[k];
      if constexpr (kDecay == Decay::l2) grad = grad + decay * param;
      if constexpr (kDecay == Decay::decoupled) param = param * decay_factor;
      const float mi = mv.v[k] * beta1 + one_minus_beta1 * grad;
      const float vi = vv.v[k] * beta2 + one_minus_beta2 * grad * grad;
      mv.v[k] = mi;
      vv.v[k] = vi;
      const float denom = sqrtf(vi) / bias2_sqrt + eps;
      pv.v[k] = param + neg_step_size * mi / denom;
    }
    store<V>(m + i, mv);
    store<V>(v + i, vv);
    store<V>(p + i, pv);
    if (p16 != nullptr) store_bf16<V>(p16 + i, pv);
  }
};

// ---- column sums -----------------------------------------------------------------------

// Block (32 columns, kColumnRuns) per kColumnBlock rows of 32 columns: thread (x, y) sums the
// kColumnRun rows r0 + y*kColumnRun ... in order (loads coalesced along x), then y = 0 adds the
// kColumnRuns run sums in order. out: db itself when one block of rows covers them all.
__global__ void __launch_bounds__(kColumnRun * kColumnRuns)
    column_block_kernel(const float* __restrict__ g, float* __restrict__ out, int rows,
                        int cols) {
  __shared__ float runs[kColumnRuns][kColumnRun];
  const int j = static_cast<int>(blockIdx.x) * kColumnRun + static_cast<int>(threadIdx.x);
  const int r0 = static_cast<int>(blockIdx.y) * kColumnBlock +
                 static_cast<int>(threadIdx.y) * kColumnRun;
  const int r1 = min(rows, r0 + kColumnRun);
  float acc = 0.0f;
  if (j < cols) {
    const float* p = g + static_cast<std::size_t>(r0) * static_cast<std::size_t>(cols) +
                     static_cast<std::size_t>(j);
#pragma unroll 8
    for (int r = r0; r < r1; ++r, p += cols) acc += *p;
  }
  runs[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kColumnRuns; ++k) sum += runs[k][threadIdx.x];
    out[static_cast<std::size_t>(blockIdx.y) * static_cast<std::size_t>(cols) +
        static_cast<std::size_t>(j)] = sum;
  }
}

// db[j] = the row blocks' sums of column j, in block order.
__global__ void __launch_bounds__(kThreads)
    column_total_kernel(const float* __restrict__ partial, float* __restrict__ db, int blocks,
                        int cols) {
  const int j = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (j >= cols) return;
  float sum = 0.0f;
  for (int b = 0; b < blocks; ++b) {
    sum += partial[static_cast<std::size_t>(b) * static_cast<std::size_t>(cols) +
                   static_cast<std::size_t>(j)];
  }
  db[j] = sum;
}

// ---- losses ----------------------------------------------------------------------------

// classes <= 32: one warp per row, lane j holding z[j].
__global__ void __launch_bounds__(kThreads)
    softmax_ce_warp_kernel(const float* __restrict__ logits, const std::int32_t* __restrict__ labels,
                           float* __restrict__ dlogits, const float* __restrict__ inv_divisor,
                           double* __restrict__ row_out, int rows, int classes) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int row = static_cast<int>(blockIdx.x) * (kThreads / 32) + (static_cast<int>(threadIdx.x) >> 5);
  if (row >= rows) return;  // the whole warp
  const std::size_t base = static_cast<std::size_t>(row) * static_cast<std::size_t>(classes);
  const bool live = lane < classes;
  const float x = live ? logits[base + static_cast<std::size_t>(lane)] : -INFINITY;
  float m = x;
  int best = live ? lane : INT_MAX;
  warp_argmax(m, best);
  const float e = live ? expf(x - m) : 0.0f;
  const float sum = warp_sum(e);
  const int label = labels[row];
  const float z_label = __shfl_sync(kFull, x, label);
  if (lane == 0) {
    const float log_sum = logf(sum);
    row_out[row] = encode_row(static_cast<double>(m + log_sum - z_label), best == label);
  }
  if (dlogits != nullptr && live) {
    const float inv = *inv_divisor;
    const float scale = inv / sum;
    float gj = e * scale;
    if (lane == label) gj -= inv;
    dlogits[base + static_cast<std::size_t>(lane)] = gj;
  }
}

// classes > 32: one block per row; thread t takes classes t, t + blockDim.x, ... (first-max and
// exp sums in that order, then block_argmax / block_sum); exps are recomputed for dlogits.
__global__ void __launch_bounds__(kThreads)
    softmax_ce_block_kernel(const float* __restrict__ logits, const std::int32_t* __restrict__ labels,
                            float* __restrict__ dlogits, const float* __restrict__ inv_divisor,
                            double* __restrict__ row_out, int classes) {
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ float ss[32];
  const int row = static_cast<int>(blockIdx.x);
  const int t = static_cast<int>(threadIdx.x);
  const int step = static_cast<int>(blockDim.x);
  const float* z = logits + static_cast<std::size_t>(row) * static_cast<std::size_t>(classes);
  float m = -INFINITY;
  int best = INT_MAX;
  if (t < classes) {
    m = z[t];
    best = t;
  }
  for (int j = t + step; j < classes; j += step) {
    if (z[j] > m) {
      m = z[j];
      best = j;
    }
  }
  block_argmax(m, best, sv, si);
  float part = 0.0f;
  for (int j = t; j < classes; j += step) part += expf(z[j] - m);
  const float sum = block_sum(part, ss);
  const int label = labels[row];
  if (t == 0) {
    const float log_sum = logf(sum);
    row_out[row] = encode_row(static_cast<double>(m + log_sum - z[label]), best == label);
  }
  if (dlogits != nullptr) {
    const float inv = *inv_divisor;
    const float scale = inv / sum;
    float* g = dlogits + static_cast<std::size_t>(row) * static_cast<std::size_t>(classes);
    for (int j = t; j < classes; j += step) {
      float gj = expf(z[j] - m) * scale;
      if (j == label) gj -= inv;
      g[j] = gj;
    }
  }
}

// One warp per row at any width: lane l takes columns l, l + 32, ... (sum of squares in
// double, first max), then butterflies.
__global__ void __launch_bounds__(kThreads)
    mse_warp_kernel(const float* __restrict__ out, const float* __restrict__ targets,
                    const std::int32_t* __restrict__ labels, float* __restrict__ dout,
                    const float* __restrict__ inv_divisor, double* __restrict__ row_out, int rows,
                    int width) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int row = static_cast<int>(blockIdx.x) * (kThreads / 32) + (static_cast<int>(threadIdx.x) >> 5);
  if (row >= rows) return;
  const std::size_t base = static_cast<std::size_t>(row) * static_cast<std::size_t>(width);
  // (z - t) * 2 / width * inv, the factor formed in double and rounded once, as loss.cpp does
  // with 2 / (width * divisor); inv is 1 / divisor already rounded to float.
  const float scale =
      dout != nullptr ? static_cast<float>(2.0 / static_cast<double>(width) *
                                           static_cast<double>(*inv_divisor))
                      : 0.0f;
  double acc = 0.0;
  float m = -INFINITY;
  int best = INT_MAX;
  for (int j = lane; j < width; j += 32) {
    const float o = out[base + static_cast<std::size_t>(j)];
    const float d = o - targets[base + static_cast<std::size_t>(j)];
    acc += static_cast<double>(d) * d;
    if (dout != nullptr) dout[base + static_cast<std::size_t>(j)] = d * scale;
    if (j == lane || o > m) {
      m = o;
      best = j;
    }
  }
  acc = warp_sum(acc);
  bool correct = false;
  if (labels != nullptr) {
    warp_argmax(m, best);
    correct = best == labels[row];
  }
  if (lane == 0) row_out[row] = encode_row(acc / width, correct);
}

// stats = the rows' (loss, hit) summed in a fixed order: thread t takes rows t, t + 256, ...
// sequentially, then block_sum. Also runs for rows == 0 (stats = 0).
__global__ void __launch_bounds__(kThreads)
    loss_total_kernel(const double* __restrict__ row_in, DeviceLossStats* __restrict__ stats,
                      int rows) {
  __shared__ double sd[32];
  __shared__ long long sc[32];
  double loss = 0.0;
  long long correct = 0;
  for (int r = static_cast<int>(threadIdx.x); r < rows; r += kThreads) {
    const double v = row_in[r];
    loss += fabs(v);
    correct += signbit(v) ? 1 : 0;
  }
  loss = block_sum(loss, sd);
  correct = block_sum(correct, sc);
  if (threadIdx.x == 0) {
    stats->loss_sum = loss;
    stats->correct = correct;
  }
}

// ---- gradient norm ---------------------------------------------------------------------

// Block b sums g^2 over [b * kNormBlock, min(n, (b + 1) * kNormBlock)) in double: thread t
// takes the float4 groups t, t + 256, ... (kNormVecs of them), each group's four squares in
// order, then block_sum. The scalar path reads the same groups element by element, so the
// bits do not depend on alignment.
__global__ void __launch_bounds__(kNormThreads)
    norm_block_kernel(const float* __restrict__ g, std::size_t n, bool vec4,
                      double* __restrict__ partial) {
  __shared__ double smem[32];
  const std::size_t begin = static_cast<std::size_t>(blockIdx.x) * kNormBlock;
  const std::size_t len = n - begin < static_cast<std::size_t>(kNormBlock) ? n - begin : kNormBlock;
  const float* p = g + begin;
  double acc = 0.0;
#pragma unroll
  for (int k = 0; k < kNormVecs; ++k) {
    const std::size_t e = 4 * (threadIdx.x + static_cast<std::size_t>(k) * kNormThreads);
    if (vec4 && e + 4 <= len) {
      const float4 x = *reinterpret_cast<const float4*>(p + e);
      acc += static_cast<double>(x.x) * x.x;
      acc += static_cast<double>(x.y) * x.y;
      acc += static_cast<double>(x.z) * x.z;
      acc += static_cast<double>(x.w) * x.w;
    } else {
      for (std::size_t c = e; c < e + 4 && c < len; ++c) acc += static_cast<double>(p[c]) * p[c];
    }
  }
  acc = block_sum(acc, smem);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// *norm = sqrt(sum of the block sums) (thread t takes blocks t, t + 256, ..., then block_sum)
// and the clipping factor of optim/clip.cpp clip_factor; with grad_scale null, *norm = the sum
// itself (no root, no factor: a pipeline stage's share of a norm summed across stages).
__global__ void __launch_bounds__(kNormThreads)
    norm_total_kernel(const double* __restrict__ partial, unsigned blocks, double max_norm,
                      double* __restrict__ norm, float* __restrict__ grad_scale) {
  __shared__ double smem[32];
  double acc = 0.0;
  for (unsigned b = threadIdx.x; b < blocks; b += kNormThreads) acc += partial[b];
  acc = block_sum(acc, smem);
  if (threadIdx.x == 0 && grad_scale == nullptr) {
    *norm = acc;
  } else if (threadIdx.x == 0) {
    const double total = sqrt(acc);
    *norm = total;
    float factor = 1.0f;
    if (max_norm > 0.0) {
      const double coef = max_norm / (total + 1e-6);
      factor = coef < 1.0 ? static_cast<float>(coef) : 1.0f;
    }
    *grad_scale = factor;
  }
}

// ---- gather ----------------------------------------------------------------------------

template <int V>
__global__ void __launch_bounds__(kThreads)
    gather_kernel(const float* __restrict__ src, const std::int64_t* __restrict__ index,
                  float* __restrict__ dst, int rows, int cols,
                  const std::int32_t* __restrict__ src_labels, std::int32_t* __restrict__ dst_labels) {
  const int unit = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (unit >= cols / V) return;
  const std::size_t j0 = static_cast<std::size_t>(unit) * V;
  const auto c = static_cast<std::size_t>(cols);
  for (int r = static_cast<int>(blockIdx.y * blockDim.y + threadIdx.y); r < rows;
       r += static_cast<int>(gridDim.y * blockDim.y)) {
    const std::int64_t from = index[r];
    store<V>(dst + static_cast<std::size_t>(r) * c + j0,
             load<V>(src + static_cast<std::size_t>(from) * c + j0));
    if (unit == 0 && dst_labels != nullptr) dst_labels[r] = src_labels[from];
  }
}

// A row of `units` values of U (16, 4 or 2 bytes) copied as it is: bf16 rows.
template <class U>
__global__ void __launch_bounds__(kThreads)
    gather_units_kernel(const U* __restrict__ src, const std::int64_t* __restrict__ index,
                        U* __restrict__ dst, int rows, int units) {
  const int unit = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (unit >= units) return;
  const auto u = static_cast<std::size_t>(units);
  for (int r = static_cast<int>(blockIdx.y * blockDim.y + threadIdx.y); r < rows;
       r += static_cast<int>(gridDim.y * blockDim.y)) {
    dst[static_cast<std::size_t>(r) * u + static_cast<std::size_t>(unit)] =
        src[static_cast<std::size_t>(index[r]) * u + static_cast<std::size_t>(unit)];
  }
}

template <class U>
void gather_units(const void* src, const std::int64_t* index, void* dst, int rows, int units,
                  int max_blocks, cudaStream_t s) {
  const RowShape sh = capped(row_shape(rows, units), max_blocks);
  gather_units_kernel<U><<<sh.grid, sh.block, 0, s>>>(static_cast<const U*>(src), index,
                                                      static_cast<U*>(dst), rows, units);
}

}  // namespace

// ---- launchers -------------------------------------------------------------------------

void bias_act_forward(float* z, float* deriv, __nv_bfloat16* out_bf16, const float* bias,
                      int rows, int cols, Act act, const DropoutArgs& dropout, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return;
  ForwardArgs a{};
  a.z = z;
  a.deriv = deriv;
  a.out_bf16 = out_bf16;
  a.bias = bias;
  a.rows = rows;
  a.cols = cols;
  if (dropout.enabled) {
    // model/kernels.cpp add_bias_activate's threshold and scale, computed the same way.
    a.threshold = detail::drop_threshold(dropout.p);
    a.scale = 1.0f / (1.0f - dropout.p);
    a.seed = dropout.seed;
    a.layer = dropout.layer;
    a.step = dropout.step;
    a.sample_ids = dropout.sample_ids;
  }
  const bool vec4 = cols % 4 == 0 && aligned(z, 16) && aligned(deriv, 16) && aligned(bias, 16) &&
                    aligned(out_bf16, 8);
  switch (act) {
    case Act::relu: launch_bias_act<Act::relu>(a, vec4, dropout.enabled, s); break;
    case Act::gelu: launch_bias_act<Act::gelu>(a, vec4, dropout.enabled, s); break;
    case Act::tanh: launch_bias_act<Act::tanh>(a, vec4, dropout.enabled, s); break;
    case Act::none: launch_bias_act<Act::none>(a, vec4, dropout.enabled, s); break;
  }
}

void act_backward(float* g, const float* deriv, const float* h, float scale,
                  __nv_bfloat16* g_bf16, int rows, int cols, cudaStream_t s) {
  if (rows <= 0 || cols <= 0) return;
  const std::size_t n = static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols);
  const bool vec4 = aligned(g, 16) && aligned(deriv, 16) && aligned(h, 16) && aligned(g_bf16, 8);
  if (deriv != nullptr) {
    launch_flat(ActBackwardOp<true>{g, deriv, h, scale, g_bf16}, n, vec4, s);
  } else {
    launch_flat(ActBackwardOp<false>{g, deriv, h, scale, g_bf16}, n, vec4, s);
  }
}

std::size_t column_sums_scratch(int rows, int cols) noexcept {
  if (rows <= kColumnBlock || cols <= 0) return 0;
  const std::size_t blocks = (static_cast<std::size_t>(rows) + kColumnBlock - 1) / kColumnBlock;
  return blocks * static_cast<std::size_t>(cols);
}

void column_sums(const float* g, float* db, float* scratch, int rows, int cols, cudaStream_t s) {
  if (cols <= 0) return;
  if (rows <= 0) {  // an empty sum: db = 0, as the CPU's column_sums leaves it
    LOCUS_CUDA_CHECK(cudaMemsetAsync(db, 0, static_cast<std::size_t>(cols) * sizeof(float), s));
    return;
  }
  const unsigned blocks = ceil_div(static_cast<std::size_t>(rows), kColumnBlock);
  const dim3 grid(ceil_div(static_cast<std::size_t>(cols), kColumnRun), blocks);
  const dim3 block(kColumnRun, kColumnRuns);
  column_block_kernel<<<grid, block, 0, s>>>(g, blocks == 1 ? db : scratch, rows, cols);
  LOCUS_CUDA_CHECK_LAUNCH("column_block_kernel");
  if (blocks > 1) {
    column_total_kernel<<<ceil_div(static_cast<std::size_t>(cols), kThreads), kThreads, 0, s>>>(
        scratch, db, static_cast<int>(blocks), cols);
    LOCUS_CUDA_CHECK_LAUNCH("column_total_kernel");
  }
}

// rows == 0 still writes *stats (zeros), so a caller never reads a stale batch's sums.
void softmax_cross_entropy(const float* logits, const std::int32_t* labels, float* dlogits,
                           const float* inv_divisor, double* row_scratch, DeviceLossStats* stats,
                           int rows, int classes, cudaStream_t s) {
  if (rows > 0 && classes > 0) {
    if (classes <= 32) {
      softmax_ce_warp_kernel<<<ceil_div(static_cast<std::size_t>(rows), kThreads / 32), kThreads,
                               0, s>>>(logits, labels, dlogits, inv_divisor, row_scratch, rows,
                                       classes);
    } else {
      // Fixed per class count: 128 threads up to 1024 classes, 256 beyond.
      const int threads = classes <= 1024 ? 128 : kThreads;
      softmax_ce_block_kernel<<<static_cast<unsigned>(rows), threads, 0, s>>>(
          logits, labels, dlogits, inv_divisor, row_scratch, classes);
    }
    LOCUS_CUDA_CHECK_LAUNCH("softmax_ce_kernel");
  }
  loss_total_kernel<<<1, kThreads, 0, s>>>(row_scratch, stats, rows > 0 && classes > 0 ? rows : 0);
  LOCUS_CUDA_CHECK_LAUNCH("loss_total_kernel");
}

void mean_squared_error(const float* out, const float* targets, const std::int32_t* labels,
                        float* dout, const float* inv_divisor, double* row_scratch,
                        DeviceLossStats* stats, int rows, int width, cudaStream_t s) {
  if (rows > 0 && width > 0) {
    mse_warp_kernel<<<ceil_div(static_cast<std::size_t>(rows), kThreads / 32), kThreads, 0, s>>>(
        out, targets, labels, dout, inv_divisor, row_scratch, rows, width);
    LOCUS_CUDA_CHECK_LAUNCH("mse_warp_kernel");
  }
  loss_total_kernel<<<1, kThreads, 0, s>>>(row_scratch, stats, rows > 0 && width > 0 ? rows : 0);
  LOCUS_CUDA_CHECK_LAUNCH("loss_total_kernel");
}

void sgd_update(float* params, const float* grads, float* momentum_buffer,
                __nv_bfloat16* params_bf16, std::size_t n, const SgdConfig& config,
                const OptimizerScalars* scalars, const float* grad_scale, cudaStream_t s,
                const double* gate) {
  if (n == 0) return;
  const bool vec4 = aligned(params, 16) && aligned(grads, 16) && aligned(momentum_buffer, 16) &&
                    aligned(params_bf16, 8);
  const bool decay = config.weight_decay != 0.0f;
  const auto run = [&]<bool kDecay, bool kMomentum, bool kNesterov>() {
    SgdOp<kDecay, kMomentum, kNesterov> op{};
    op.p = params;
    op.g = grads;
    op.buf = momentum_buffer;
    op.p16 = params_bf16;
    op.decay = config.weight_decay;
    op.momentum = config.momentum;
    op.scalars = scalars;
    op.grad_scale = grad_scale;
    op.gate = gate;
    launch_flat(op, n, vec4, s);
  };
  // As sgd.cpp: momentum is on when its buffer exists; nesterov only with momentum.
  if (momentum_buffer == nullptr) {
    decay ? run.operator()<true, false, false>() : run.operator()<false, false, false>();
  } else if (!config.nesterov) {
    decay ? run.operator()<true, true, false>() : run.operator()<false, true, false>();
  } else {
    decay ? run.operator()<true, true, true>() : run.operator()<false, true, true>();
  }
}

void adam_update(float* params, const float* grads, float* exp_avg, float* exp_avg_sq,
                 __nv_bfloat16* params_bf16, std::size_t n, const AdamConfig& config,
                 const OptimizerScalars* scalars, const float* grad_scale, cudaStream_t s,
                 const double* gate) {
  if (n == 0) return;
  const bool vec4 = aligned(params, 16) && aligned(grads, 16) && aligned(exp_avg, 16) &&
                    aligned(exp_avg_sq, 16) && aligned(params_bf16, 8);
  const auto run = [&]<Decay kDecay>() {
    AdamOp<kDecay> op{};
    op.p = params;
    op.g = grads;
    op.m = exp_avg;
    op.v = exp_avg_sq;
    op.p16 = params_bf16;
    op.decay = config.weight_decay;
    op.beta1 = static_cast<float>(config.beta1);
    op.one_minus_beta1 = static_cast<float>(1.0 - config.beta1);
    op.beta2 = static_cast<float>(config.beta2);
    op.one_minus_beta2 = static_cast<float>(1.0 - config.beta2);
    op.eps = static_cast<float>(config.eps);
    op.scalars = scalars;
    op.grad_scale = grad_scale;
    op.gate = gate;
    launch_flat(op, n, vec4, s);
  };
  if (config.weight_decay == 0.0f) {
    run.operator()<Decay::none>();
  } else if (config.decoupled) {
    run.operator()<Decay::decoupled>();
  } else {
    run.operator()<Decay::l2>();
  }
}

std::size_t grad_norm_scratch(std::size_t n) noexcept {
  const std::size_t blocks = (n + kNormBlock - 1) / kNormBlock;
  return blocks > 0 ? blocks : 1;
}

// n == 0 still writes *norm = 0 and *grad_scale (1), so the update never reads a stale factor.
void grad_norm_and_scale(const float* g, std::size_t n, double max_norm, double* scratch,
                         double* norm, float* grad_scale, cudaStream_t s) {
  const std::size_t blocks = (n + kNormBlock - 1) / kNormBlock;
  if (blocks > 0) {
    norm_block_kernel<<<static_cast<unsigned>(blocks), kNormThreads, 0, s>>>(g, n, aligned(g, 16),
                                                                            scratch);
    LOCUS_CUDA_CHECK_LAUNCH("norm_block_kernel");
  }
  norm_total_kernel<<<1, kNormThreads, 0, s>>>(scratch, static_cast<unsigned>(blocks), max_norm,
                                               norm, grad_scale);
  LOCUS_CUDA_CHECK_LAUNCH("norm_total_kernel");
}

void grad_sum_of_squares(const float* g, std::size_t n, double* scratch, double* sum,
                         cudaStream_t s) {
  const std::size_t blocks = (n + kNormBlock - 1) / kNormBlock;
  if (blocks > 0) {
    norm_block_kernel<<<static_cast<unsigned>(blocks), kNormThreads, 0, s>>>(g, n, aligned(g, 16),
                                                                            scratch);
    LOCUS_CUDA_CHECK_LAUNCH("norm_block_kernel");
  }
  norm_total_kernel<<<1, kNormThreads, 0, s>>>(scratch, static_cast<unsigned>(blocks), 0.0, sum,
                                               nullptr);
  LOCUS_CUDA_CHECK_LAUNCH("norm_total_kernel");
}

void add_into(float* dst, const float* src, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_flat(AddIntoOp{dst, src}, n, aligned(dst, 16) && aligned(src, 16), s);
}

void gather_rows(const float* src, const std::int64_t* index, float* dst, int rows, int cols,
                 const std::int32_t* src_labels, std::int32_t* dst_labels, cudaStream_t s,
                 int max_blocks) {
  if (rows <= 0 || cols <= 0) return;
  const std::int32_t* from_labels = dst_labels != nullptr ? src_labels : nullptr;
  std::int32_t* to_labels = src_labels != nullptr ? dst_labels : nullptr;
  if (cols % 4 == 0 && aligned(src, 16) && aligned(dst, 16)) {
    const RowShape sh = capped(row_shape(rows, cols / 4), max_blocks);
    gather_kernel<4><<<sh.grid, sh.block, 0, s>>>(src, index, dst, rows, cols, from_labels,
                                                  to_labels);
  } else {
    const RowShape sh = capped(row_shape(rows, cols), max_blocks);
    gather_kernel<1><<<sh.grid, sh.block, 0, s>>>(src, index, dst, rows, cols, from_labels,
                                                  to_labels);
  }
  LOCUS_CUDA_CHECK_LAUNCH("gather_kernel");
}

void gather_bf16_rows(const __nv_bfloat16* src, const std::int64_t* index, __nv_bfloat16* dst,
                      int rows, int cols, cudaStream_t s, int max_blocks) {
  if (rows <= 0 || cols <= 0) return;
  if (cols % 8 == 0 && aligned(src, 16) && aligned(dst, 16)) {
    gather_units<uint4>(src, index, dst, rows, cols / 8, max_blocks, s);
  } else if (cols % 2 == 0 && aligned(src, 4) && aligned(dst, 4)) {
    gather_units<unsigned>(src, index, dst, rows, cols / 2, max_blocks, s);
  } else {
    gather_units<unsigned short>(src, index, dst, rows, cols, max_blocks, s);
  }
  LOCUS_CUDA_CHECK_LAUNCH("gather_units_kernel");
}

void to_bf16(const float* src, __nv_bfloat16* dst, std::size_t n, cudaStream_t s) {
  if (n == 0) return;
  launch_flat(ToBf16Op{src, dst}, n, aligned(src, 16) && aligned(dst, 8), s);
}

}  // namespace locus::train::cuda
