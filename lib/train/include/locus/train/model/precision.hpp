// Arithmetic of the matrix products on a device backend (train.precision, infer.precision):
//   fp32: full float32 (the CPU's arithmetic; the default: results comparable with the CPU
//         reference, and PyTorch's default for float32 matmuls since 1.12);
//   tf32: float32 storage, tensor-core products with 10-bit mantissas (~3e-4 relative);
//   bf16: bf16 operands with float32 accumulation; float32 master weights, optimizer state,
//         activations' epilogues and loss (relative error 1e-3..1e-2 per product).
// The CPU computes in float32 whatever this says (it accepts only fp32). Part of the model
// library because the forward pass on a device (training's evaluation and inference) uses it.
#pragma once

#include <string_view>

namespace locus::train {

enum class Precision { fp32, tf32, bf16 };
// ConfigError naming `key` and the choices.
Precision parse_precision(std::string_view name, std::string_view key = "train.precision");
std::string_view to_string(Precision p) noexcept;

}  // namespace locus::train
