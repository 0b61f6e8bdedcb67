// Allocation of the step buffers (sizes only; contents are written before they are read).
#include "cuda/step_buffers.hpp"

#include <algorithm>

namespace locus::train::cuda {

namespace {
std::size_t sz(int a, int b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); }
}  // namespace

StepBuffers::StepBuffers(std::span<const int> widths, int rows, bool training, bool keeps_deriv,
                         bool bf16)
    : capacity(rows) {
  const int layers = static_cast<int>(widths.size()) - 1;
  int max_width = 0, max_hidden = 0;
  for (int l = 0; l <= layers; ++l) max_width = std::max(max_width, widths[static_cast<std::size_t>(l)]);
  for (int l = 0; l < layers; ++l) {
    const int w = widths[static_cast<std::size_t>(l) + 1];
    const bool hidden = l + 1 < layers;
    out.emplace_back(sz(rows, w));
    deriv.emplace_back(training && hidden && keeps_deriv ? sz(rows, w) : 0);
    out_bf16.emplace_back(bf16 && hidden ? sz(rows, w) : 0);
    if (hidden) max_hidden = std::max(max_hidden, w);
  }
  if (bf16) {
    x_bf16 = DeviceBuffer<__nv_bfloat16>(sz(rows, widths.front()));
    if (training) dz_bf16 = DeviceBuffer<__nv_bfloat16>(sz(rows, max_width));
  }
  if (training) {
    out_grad = DeviceBuffer<float>(sz(rows, widths.back()));
    scratch[0] = DeviceBuffer<float>(sz(rows, std::max(max_hidden, 1)));
    scratch[1] = DeviceBuffer<float>(sz(rows, std::max(max_hidden, 1)));
    column_scratch = DeviceBuffer<float>(std::max<std::size_t>(column_sums_scratch(rows, max_width), 1));
  }
  row_scratch = DeviceBuffer<double>(static_cast<std::size_t>(rows));
}

InputSlot::InputSlot(int rows, int input_width, int output_width, bool targets_needed)
    : x(sz(rows, input_width)),
      resident_rows(static_cast<std::size_t>(rows)),
      labels(static_cast<std::size_t>(rows)),
      sample_ids(static_cast<std::size_t>(rows)),
      targets(targets_needed ? sz(rows, output_width) : 0),
      copied(make_event()),
      consumed(make_event()) {}

}  // namespace locus::train::cuda
