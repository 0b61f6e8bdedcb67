// The multilayer perceptron: its spec, the parameter layout shared by parameters, gradients and
// optimizer state, and the seeded initialisation. Inference needs only this and forward.hpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace locus::train {

// Applied after every hidden layer; the output layer is always linear (logits).
//   relu: max(z, 0), derivative 0 at z == 0 (as PyTorch).
//   gelu: the tanh approximation, 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))), i.e.
//         PyTorch's nn.GELU(approximate='tanh') -- NOT the exact-erf default nn.GELU().
//   tanh: tanh(z).
enum class Activation { relu, gelu, tanh };

// Weight initialisation; biases always start at zero.
//   he:     N(0, 2 / fan_in)                         (torch.nn.init.kaiming_normal_, fan_in, relu)
//   xavier: U(-a, a), a = sqrt(6 / (fan_in + fan_out)) (torch.nn.init.xavier_uniform_, gain 1)
// Values come from a counter-based hash of (seed, layer, element), so they are identical on
// every machine and rank and do not depend on the standard library's distributions.
enum class Init { he, xavier };

struct ModelSpec {
  std::vector<int> widths;  // input, hidden..., output: at least 2 entries, each >= 1
  Activation activation = Activation::relu;
  Init init = Init::he;
  float dropout = 0.0f;     // probability of dropping a hidden unit in training, in [0, 1)
  std::uint64_t seed = 0;   // initialisation and dropout masks
};

// Throw ConfigError naming the offending value and what to do.
Activation parse_activation(std::string_view name);  // "relu" | "gelu" | "tanh"
Init parse_init(std::string_view name);              // "he" | "xavier"
std::vector<int> parse_widths(std::string_view text);  // "784,256,128,10"
std::string_view to_string(Activation a) noexcept;
std::string_view to_string(Init i) noexcept;
std::string format_widths(std::span<const int> widths);  // "784,256,128,10"
void validate(const ModelSpec& spec);                 // throws ConfigError

// Where layer l (0-based, maps `in` features to `out`) lives in every buffer of the layout:
// weight [out, in] row-major at weight_offset, then bias [out] at bias_offset.
struct LayerLayout {
  int in = 0;
  int out = 0;
  std::size_t weight_offset = 0;
  std::size_t bias_offset = 0;
  std::size_t begin() const noexcept { return weight_offset; }
  std::size_t end() const noexcept { return bias_offset + static_cast<std::size_t>(out); }
};

// One named tensor of the PyTorch state_dict (shape {out, in} for weights, {out} for biases).
struct TensorInfo {
  std::string name;  // "layers.0.weight", "layers.0.bias", ...
  std::size_t offset = 0;
  std::vector<std::size_t> shape;
  std::size_t size() const noexcept;
};

// The single flat layout of parameters, gradients and optimizer state, in PyTorch state_dict
// order (layers.0.weight, layers.0.bias, layers.1.weight, ...) with nn.Linear's [out, in]
// convention, so each layer's weight+bias is one contiguous slice [begin(), end()) -- what a
// gradient all-reduce bucket sends -- and a model maps 1:1 onto a PyTorch module whose
// linear layers are registered as `layers` (an nn.ModuleList).
class ParamLayout {
 public:
  explicit ParamLayout(std::span<const int> widths);

  int num_layers() const noexcept { return static_cast<int>(layers_.size()); }
  const LayerLayout& layer(int l) const;
  std::span<const LayerLayout> layers() const noexcept { return layers_; }
  std::size_t size() const noexcept { return size_; }  // floats in every buffer of this layout
  std::span<const int> widths() const noexcept { return widths_; }
  int input_width() const noexcept { return widths_.front(); }
  int output_width() const noexcept { return widths_.back(); }

  std::vector<TensorInfo> tensors() const;  // state_dict order
  static std::string weight_name(int l);    // "layers.<l>.weight"
  static std::string bias_name(int l);      // "layers.<l>.bias"

  // Views of layer l inside any buffer with this layout (params, grads, optimizer state).
  template <class T> std::span<T> weight(std::span<T> buffer, int l) const {
    const LayerLayout& ly = layer(l);
    return buffer.subspan(ly.weight_offset, static_cast<std::size_t>(ly.out) * ly.in);
  }
  template <class T> std::span<T> bias(std::span<T> buffer, int l) const {
    const LayerLayout& ly = layer(l);
    return buffer.subspan(ly.bias_offset, static_cast<std::size_t>(ly.out));
  }

 private:
  std::vector<int> widths_;
  std::vector<LayerLayout> layers_;
  std::size_t size_ = 0;
};

// Fills params (layout.size() floats) from spec.init and spec.seed; deterministic.
void init_params(const ModelSpec& spec, const ParamLayout& layout, std::span<float> params);

// A model: its spec, layout and parameters (one contiguous buffer, initialised on
// construction; overwrite params() to load a checkpoint).
class Mlp {
 public:
  explicit Mlp(ModelSpec spec);  // validates the spec (ConfigError)

  const ModelSpec& spec() const noexcept { return spec_; }
  const ParamLayout& layout() const noexcept { return layout_; }
  int num_layers() const noexcept { return layout_.num_layers(); }
  std::span<float> params() noexcept { return params_; }
  std::span<const float> params() const noexcept { return params_; }

 private:
  ModelSpec spec_;
  ParamLayout layout_;
  std::vector<float> params_;
};

}  // namespace locus::train
