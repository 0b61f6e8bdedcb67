// Allocation of the input slots (sizes only; contents are written before they are read).
#include "cuda/step_buffers.hpp"

namespace locus::train::cuda {

namespace {
std::size_t sz(int a, int b) { return static_cast<std::size_t>(a) * static_cast<std::size_t>(b); }
}  // namespace

InputSlot::InputSlot(int rows, int input_width, int output_width, bool targets_needed,
                     bool bf16_input)
    : x(bf16_input ? 0 : sz(rows, input_width)),
      x_bf16(bf16_input ? sz(rows, input_width) : 0),
      resident_rows(static_cast<std::size_t>(rows)),
      labels(static_cast<std::size_t>(rows)),
      sample_ids(static_cast<std::size_t>(rows)),
      targets(targets_needed ? sz(rows, output_width) : 0),
      uploaded(make_event()),
      copied(make_event()),
      consumed(make_event()) {}

}  // namespace locus::train::cuda
