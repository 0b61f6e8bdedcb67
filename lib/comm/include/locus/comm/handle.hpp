// One move-only owning handle for C library resources (HDF5 ids, CUDA streams, NCCL comms).
// Traits supply the invalid value and a noexcept close; moving nulls the source.
#pragma once

#include <utility>

namespace locus {

template <class Traits>
class Handle {
 public:
  using value_type = typename Traits::value_type;

  Handle() noexcept = default;
  explicit Handle(value_type v) noexcept : v_(v) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& o) noexcept : v_(std::exchange(o.v_, Traits::invalid())) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      v_ = std::exchange(o.v_, Traits::invalid());
    }
    return *this;
  }
  ~Handle() { reset(); }

  value_type get() const noexcept { return v_; }
  explicit operator bool() const noexcept { return v_ != Traits::invalid(); }
  // Gives up ownership without closing.
  value_type release() noexcept { return std::exchange(v_, Traits::invalid()); }
  void reset() noexcept {
    if (v_ != Traits::invalid()) Traits::close(std::exchange(v_, Traits::invalid()));
  }

 private:
  value_type v_ = Traits::invalid();
};

}  // namespace locus
