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

// The layers [first, end) of a model that a buffer holds: all of them, or one pipeline stage's
// (a contiguous range, so its parameters are one contiguous slice of the layout).
struct LayerRange {
  int first = 0;
  int end = 0;
  int layers() const noexcept { return end - first; }
  bool contains(int l) const noexcept { return l >= first && l < end; }
  bool operator==(const LayerRange&) const = default;
};

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
  int layer = 0;  // the layer it belongs to
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

  LayerRange all_layers() const noexcept { return {0, num_layers()}; }
  // Elements [begin_of(r), end_of(r)) of every buffer hold layers r (asserts a valid range).
  std::size_t begin_of(LayerRange r) const;
  std::size_t end_of(LayerRange r) const;

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
// The same values for layers `held` only: params holds elements [begin_of(held), end_of(held))
// of the layout. Every value depends on (seed, layer, element) alone, so a stage's slice equals
// that slice of the whole model's initialisation.
void init_params(const ModelSpec& spec, const ParamLayout& layout, LayerRange held,
                 std::span<float> params);

// A model: its spec, the whole model's layout and the parameters of the layers it holds (one
// contiguous buffer, initialised on construction; overwrite params() to load a checkpoint).
// A whole model holds every layer (what forward/backward need; read_model_file returns one); a
// pipeline stage's holds only its layers, so a rank's memory is its stage's share while spec() and
// layout() still describe the whole model (tensor names, shapes, offsets).
class Mlp {
 public:
  explicit Mlp(ModelSpec spec);  // every layer; validates the spec (ConfigError)
  // Only layers `held` (ConfigError unless 0 <= first < end <= layers).
  Mlp(ModelSpec spec, LayerRange held);

  const ModelSpec& spec() const noexcept { return spec_; }
  const ParamLayout& layout() const noexcept { return layout_; }  // the whole model's
  int num_layers() const noexcept { return layout_.num_layers(); }  // the whole model's
  LayerRange held() const noexcept { return held_; }
  bool whole() const noexcept { return held_ == layout_.all_layers(); }
  // Layout offset of params()[0]: layout element i is params()[i - offset()] (0 when whole).
  std::size_t offset() const noexcept { return offset_; }
  // The held layers' parameters, layout elements [offset(), offset() + params().size()).
  std::span<float> params() noexcept { return params_; }
  std::span<const float> params() const noexcept { return params_; }

 private:
  ModelSpec spec_;
  ParamLayout layout_;
  LayerRange held_;
  std::size_t offset_ = 0;
  std::vector<float> params_;
};

}  // namespace locus::train
