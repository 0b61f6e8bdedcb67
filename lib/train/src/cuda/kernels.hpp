// Private to the CUDA backend: the elementwise, reduction and optimizer kernels of a training
// step, as host-callable launchers (implemented in kernels.cu). Every launcher enqueues on the
// given stream, checks the launch (CudaError) and never synchronises, so a whole step can be
// captured into a CUDA graph. Every reduction has a fixed order that depends only on the
// sizes (no floating-point atomics), so results are bitwise repeatable on one device kind.
// Each kernel mirrors a CPU reference in src/model or src/optim (named below); the tests in
// tests/train/gpu check them against float64 references.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace locus::train::cuda {

// The hidden-layer activation (model.hpp's Activation: 0 relu, 1 gelu (tanh approx.), 2 tanh).
enum class Act : int { relu = 0, gelu = 1, tanh = 2, none = 3 };

// Dropout of a hidden layer, keyed exactly as the CPU (model/hash.hpp): unit j of row r is kept
// when (unit_hash(dropout_row_key(seed, step, layer, sample_ids[r]), j) >> 32) >= threshold.
// step is read from device memory (*step) so a captured graph sees each replay's step.
struct DropoutArgs {
  bool enabled = false;
  float p = 0.0f;                            // drop probability (threshold = p * 2^32)
  std::uint64_t seed = 0;
  int layer = 0;                             // the MODEL's layer index
  const std::uint64_t* step = nullptr;       // device
  const std::uint64_t* sample_ids = nullptr; // device, [rows]
};

// Forward epilogue of one layer, in place on z [rows, cols] row-major (the GEMM's output):
//   z = act(z + bias[j]), then dropout (kept units scaled by 1/(1-p), dropped ones 0).
// deriv (may be null): act'(z + bias) times the dropout factor (0 or 1/(1-p)), what backward
// multiplies by (gelu/tanh, or relu with dropout). act = none: bias only (the output layer).
// out_bf16 (may be null): a bf16 copy of the result, the next GEMM's operand in bf16 mode.
// CPU reference: model/kernels.hpp add_bias / add_bias_relu / add_bias_activate.
void bias_act_forward(float* z, float* deriv, __nv_bfloat16* out_bf16, const float* bias,
                      int rows, int cols, Act act, const DropoutArgs& dropout, cudaStream_t s);

// Backward through a hidden layer's activation, in place on g [rows, cols] (dL/dh -> dL/dz):
//   deriv != null: g *= deriv;  deriv == null (relu, no dropout stored): g = h > 0 ? g * scale : 0
//   with h the layer's stored output [rows, cols].
// g_bf16 (may be null): a bf16 copy of the result. CPU reference: relu_backward /
// deriv_backward without the bias sums (column_sums does those).
void act_backward(float* g, const float* deriv, const float* h, float scale,
                  __nv_bfloat16* g_bf16, int rows, int cols, cudaStream_t s);

// db[j] = sum_r g[r, j] (db overwritten), fixed summation order. Each column's rows are summed
// in float in blocks of kColumnBlock rows, then the block sums in order, in float.
// scratch: column_sums_scratch(rows, cols) floats. CPU reference: column_sums.
inline constexpr int kColumnBlock = 256;
std::size_t column_sums_scratch(int rows, int cols) noexcept;
void column_sums(const float* g, float* db, float* scratch, int rows, int cols, cudaStream_t s);

// What a loss kernel leaves for one batch: the sums the CPU's LossStats holds.
struct DeviceLossStats {
  double loss_sum;
  long long correct;
};

// Softmax cross-entropy on logits [rows, classes] (labels in [0, classes), checked on the host
// before upload). Writes *stats (loss_sum: sum over rows of logsumexp(z) - z[label], summed
// in double in a fixed order; correct: rows whose FIRST argmax equals the label) and, when
// dlogits is non-null, dlogits = (softmax(z) - onehot(label)) * (*inv_divisor), where
// inv_divisor (device) is 1 / the global batch. row_scratch: rows doubles.
// CPU reference: model/loss.cpp softmax_cross_entropy.
void softmax_cross_entropy(const float* logits, const std::int32_t* labels, float* dlogits,
                           const float* inv_divisor, double* row_scratch, DeviceLossStats* stats,
                           int rows, int classes, cudaStream_t s);

// Mean squared error against targets [rows, width]: per-row mean of squared differences
// summed in double into stats->loss_sum; stats->correct = argmax hits when labels != null
// (else 0); dout (may be null) = (z - t) * 2 / width * (*inv_divisor).
// CPU reference: mean_squared_error + count_correct.
void mean_squared_error(const float* out, const float* targets, const std::int32_t* labels,
                        float* dout, const float* inv_divisor, double* row_scratch,
                        DeviceLossStats* stats, int rows, int width, cudaStream_t s);

// Per-step scalars of the optimizer, in device memory so a captured step reads each replay's
// values (the host writes them before the launch). Computed on the host exactly as the CPU
// optimizers compute theirs (optim/sgd.cpp, optim/adam.cpp), rounded to float once.
struct OptimizerScalars {
  float neg_lr;          // sgd: -lr
  float grad_coef;       // sgd: 1 - dampening, or 1 on the first step
  float decay_factor;    // adamw: 1 - lr * weight_decay
  float bias2_sqrt;      // adam: sqrt(1 - beta2^t)
  float neg_step_size;   // adam: -lr / (1 - beta1^t)
  int first_step;        // sgd: 1 on the first step (the momentum buffer starts from zero)
};

struct SgdConfig {
  float weight_decay = 0, momentum = 0;
  bool nesterov = false;
};
// The betas and eps as configured (double): the kernel rounds beta, 1 - beta and eps to float
// once, as optim/adam.cpp does (float(1 - 0.999) is not 1 - float(0.999)).
struct AdamConfig {
  float weight_decay = 0;  // adam: L2 added to the gradient
  bool decoupled = false;  // adamw
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
};

// One fused pass over n parameters, reading grads * (*grad_scale) (the clipping factor,
// device). momentum_buffer may be null (momentum 0). params_bf16 (may be null): a bf16 copy of
// the updated parameters (the GEMM operands in bf16 mode). Same operation order as the CPU.
// gate (device, may be null): when *gate is not finite (the gradient's sum of squares of a
// diverged step) the update writes nothing -- parameters and optimizer state stay as they
// were, which lets the host judge the step after it has enqueued the update.
void sgd_update(float* params, const float* grads, float* momentum_buffer,
                __nv_bfloat16* params_bf16, std::size_t n, const SgdConfig& config,
                const OptimizerScalars* scalars, const float* grad_scale, cudaStream_t s,
                const double* gate = nullptr);
void adam_update(float* params, const float* grads, float* exp_avg, float* exp_avg_sq,
                 __nv_bfloat16* params_bf16, std::size_t n, const AdamConfig& config,
                 const OptimizerScalars* scalars, const float* grad_scale, cudaStream_t s,
                 const double* gate = nullptr);

// Global-norm clipping on the device: *norm = sqrt(sum g^2) (double, fixed order: blocks of
// kNormBlock elements summed in double, then the block sums in order) and, when max_norm > 0,
// *grad_scale = min(1, max_norm / (norm + 1e-6)) as a float (clip_factor in optim/clip.cpp);
// max_norm <= 0 writes *grad_scale = 1. scratch: grad_norm_scratch(n) doubles.
inline constexpr int kNormBlock = 4096;
std::size_t grad_norm_scratch(std::size_t n) noexcept;
void grad_norm_and_scale(const float* g, std::size_t n, double max_norm, double* scratch,
                         double* norm, float* grad_scale, cudaStream_t s);

// *sum = sum g^2 (double), the same blocks and order as grad_norm_and_scale (so its sqrt is
// that norm): a pipeline stage's share, which the stages add up before the root.
// scratch: grad_norm_scratch(n) doubles. CPU reference: optim/clip.cpp sum_of_squares.
void grad_sum_of_squares(const float* g, std::size_t n, double* scratch, double* sum,
                         cudaStream_t s);

// dst[i] += src[i] (float): micro-batch bias gradients added into the accumulated ones.
// CPU reference: cpu_layer_ops.cpp finish_bias.
void add_into(float* dst, const float* src, std::size_t n, cudaStream_t s);

// dst[r, :] = src[index[r], :] for r < rows (device cache: batches gathered by index; src may
// also be mapped host memory, loader.gather = device), and the same for int32 labels when both
// label pointers are non-null. max_blocks > 0 caps the grid (the rows are strided over it), so
// a gather beside the compute stream's kernels leaves them most of the SMs.
void gather_rows(const float* src, const std::int64_t* index, float* dst, int rows, int cols,
                 const std::int32_t* src_labels, std::int32_t* dst_labels, cudaStream_t s,
                 int max_blocks = 0);

// The same gather of bf16 rows, without labels (loader.gather = device at bf16: the samples
// are page-locked as bf16, so a row crosses the host link in 2 bytes a feature, not 4); the
// bytes are copied as they are, 16 at a time where the row width and the pointers allow.
void gather_bf16_rows(const __nv_bfloat16* src, const std::int64_t* index, __nv_bfloat16* dst,
                      int rows, int cols, cudaStream_t s, int max_blocks = 0);

// dst[i] = bf16(src[i]) (round to nearest even).
void to_bf16(const float* src, __nv_bfloat16* dst, std::size_t n, cudaStream_t s);

}  // namespace locus::train::cuda
