// zlib's CRC-32 (reflected polynomial 0xEDB88320) of large buffers by carry-less multiplication
// (PCLMULQDQ folding, Gopal et al., "Fast CRC Computation for Generic Polynomials Using
// PCLMULQDQ Instruction", Intel 2009; the constants of Linux's crc32-pclmul), several times
// zlib 1.2's table-driven speed: the CRC of every checkpoint byte sits on the critical path of
// a save (bench/RESULTS.md, "Checkpoints"). Other CPUs, short buffers and tails use zlib.
#include <zlib.h>

#include <cstdint>
#include <span>

#include "locus/io/raw_io.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace locus::io {

namespace {

std::uint32_t crc32_zlib(const std::byte* p, std::size_t n, std::uint32_t crc) {
  return static_cast<std::uint32_t>(::crc32_z(crc, reinterpret_cast<const Bytef*>(p), n));
}

#if defined(__x86_64__)

#define LOCUS_PCLMUL __attribute__((target("pclmul,sse4.1")))

LOCUS_PCLMUL inline __m128i load(const std::byte* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// a * k (low halves) ^ a * k (high halves) ^ b: one 128-bit fold of a onto b.
LOCUS_PCLMUL inline __m128i fold_onto(__m128i a, __m128i k, __m128i b) {
  return _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, k, 0x00),
                                     _mm_clmulepi64_si128(a, k, 0x11)), b);
}

// The CRC register (pre-inverted, as zlib keeps it internally) after `n` bytes, n >= 64 and a
// multiple of 16: four 128-bit lanes folded 64 bytes at a time, then into one lane, 16 bytes
// at a time, then to 64 and 32 bits, and a Barrett reduction.
LOCUS_PCLMUL std::uint32_t fold(const std::byte* buf, std::size_t n, std::uint32_t crc) {
  alignas(16) static const std::uint64_t k1k2[] = {0x0154442bd4, 0x01c6e41596};
  alignas(16) static const std::uint64_t k3k4[] = {0x01751997d0, 0x00ccaa009e};
  alignas(16) static const std::uint64_t k5k0[] = {0x0163cd6124, 0x0000000000};
  alignas(16) static const std::uint64_t poly[] = {0x01db710641, 0x01f7011641};
  __m128i x1 = _mm_xor_si128(load(buf), _mm_cvtsi32_si128(static_cast<int>(crc)));
  __m128i x2 = load(buf + 16), x3 = load(buf + 32), x4 = load(buf + 48);
  buf += 64;
  n -= 64;
  __m128i k = _mm_load_si128(reinterpret_cast<const __m128i*>(k1k2));
  for (; n >= 64; buf += 64, n -= 64) {
    x1 = fold_onto(x1, k, load(buf));
    x2 = fold_onto(x2, k, load(buf + 16));
    x3 = fold_onto(x3, k, load(buf + 32));
    x4 = fold_onto(x4, k, load(buf + 48));
  }
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(k3k4));
  x1 = fold_onto(x1, k, x2);
  x1 = fold_onto(x1, k, x3);
  x1 = fold_onto(x1, k, x4);
  for (; n >= 16; buf += 16, n -= 16) x1 = fold_onto(x1, k, load(buf));
  // 128 -> 64 bits.
  __m128i x2b = _mm_clmulepi64_si128(x1, k, 0x10);
  const __m128i mask32 = _mm_setr_epi32(~0, 0, ~0, 0);
  x1 = _mm_xor_si128(_mm_srli_si128(x1, 8), x2b);
  k = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(k5k0));
  x2b = _mm_srli_si128(x1, 4);
  x1 = _mm_xor_si128(_mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k, 0x00), x2b);
  // Barrett reduction to 32 bits.
  k = _mm_load_si128(reinterpret_cast<const __m128i*>(poly));
  x2b = _mm_clmulepi64_si128(_mm_and_si128(x1, mask32), k, 0x10);
  x2b = _mm_clmulepi64_si128(_mm_and_si128(x2b, mask32), k, 0x00);
  x1 = _mm_xor_si128(x1, x2b);
  return static_cast<std::uint32_t>(_mm_extract_epi32(x1, 1));
}

#undef LOCUS_PCLMUL

bool have_pclmul() {
  static const bool have = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return have;
}

#endif

}  // namespace

std::uint32_t crc32_bytes(std::span<const std::byte> bytes, std::uint32_t crc) {
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
#if defined(__x86_64__)
  if (n >= 64 && have_pclmul()) {
    const std::size_t bulk = n & ~std::size_t{15};
    crc = ~fold(p, bulk, ~crc);
    p += bulk;
    n -= bulk;
  }
#endif
  return n == 0 ? crc : crc32_zlib(p, n, crc);
}

}  // namespace locus::io
