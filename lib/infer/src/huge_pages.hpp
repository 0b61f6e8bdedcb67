// An allocator for the scoring loop's large, long-lived buffers (private): whole 2 MiB
// transparent huge pages instead of 4 KiB pages.
//
// Why: the read-ahead ring is refilled with every stripe of input. Faulting such a buffer in
// 4 KiB at a time costs ~4 s per GB on the project's VM (every first touch of a page traps to
// the hypervisor: 64 MB took 0.21-0.27 s, on huge pages 6-11 ms), and the kernel's copy of the
// input into it, and the GEMM's reads out of it, take fewer TLB misses. With 27 MB slots instead
// of the ring, huge pages alone cut a 2-rank run's reads from ~0.5 s to ~0.2 s per rank. Where
// THP is off (`never`) the hint is ignored and nothing else changes.
#pragma once

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <new>

namespace locus::infer::detail {

template <class T>
struct HugePageAllocator {
  using value_type = T;
  static constexpr std::size_t kHugePage = std::size_t{2} << 20;

  HugePageAllocator() noexcept = default;
  template <class U>
  HugePageAllocator(const HugePageAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor)

  static std::size_t bytes_for(std::size_t n) noexcept {
    return (n * sizeof(T) + kHugePage - 1) / kHugePage * kHugePage;
  }
  T* allocate(std::size_t n) {
    if (n == 0) return nullptr;
    // Map one huge page more than needed and trim both ends, so the buffer starts on a 2 MiB
    // boundary (only aligned 2 MiB ranges get huge pages; mmap aligns to 4 KiB).
    const std::size_t bytes = bytes_for(n);
    void* raw = ::mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) throw std::bad_alloc();
    const auto base = reinterpret_cast<std::uintptr_t>(raw);
    const std::uintptr_t aligned = (base + kHugePage - 1) / kHugePage * kHugePage;
    if (aligned > base) ::munmap(raw, aligned - base);
    if (const std::size_t tail = base + kHugePage - aligned; tail > 0)
      ::munmap(reinterpret_cast<void*>(aligned + bytes), tail);
    void* p = reinterpret_cast<void*>(aligned);
    ::madvise(p, bytes, MADV_HUGEPAGE);  // a refused hint (THP off) is harmless
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (p != nullptr) ::munmap(p, bytes_for(n));
  }
  template <class U>
  bool operator==(const HugePageAllocator<U>&) const noexcept { return true; }
};

}  // namespace locus::infer::detail
