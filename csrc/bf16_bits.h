// bf16 <-> fp32 as bit patterns: bf16 is fp32's upper half, rounded to nearest even on the way down
// (as torch rounds; a NaN stays a NaN).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_matmul.h"

#ifdef ZEROLITE_X86
#include <immintrin.h>
#endif

namespace zerolite {

// A float's bits and the float of some bits (memcpy: the cast between them that C++ defines).
inline uint32_t bits_of(float value) {
  uint32_t word;
  std::memcpy(&word, &value, 4);
  return word;
}

inline float float_of(uint32_t word) {
  float value;
  std::memcpy(&value, &word, 4);
  return value;
}

// fp32 bits rounded in place to nearest even at bf16's precision: the bf16 is then the upper 16
// bits, what is left below them to be shifted out or cleared. One word, or each lane of a GCC
// vector of uint32_t (a path's __m256i or __m512i seen as one), so that every path rounds alike;
// NaNs are the caller's. In place, not by value: a vector passed to a function of no target
// attribute would draw GCC's ABI warning, though the call is always inlined.
template <class Words>
__attribute__((always_inline)) inline void round_to_bf16(Words& words) {
  words += 0x7FFFu + ((words >> 16) & 1u);
}

inline float widen_bf16(uint16_t bits) { return float_of(static_cast<uint32_t>(bits) << 16); }

inline uint16_t narrow_bf16(float value) {
  uint32_t word = bits_of(value);
  if ((word & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  round_to_bf16(word);
  return static_cast<uint16_t>(word >> 16);
}

// Output y of row m, column n, as the rows take it: rounded to bf16 where they are bf16.
inline void store_output(const Rows& r, int64_t m, int64_t n, float y) {
  if (r.y_bf16) r.y_bf16[m * r.y_stride + n] = narrow_bf16(y);
  else r.y[m * r.y_stride + n] = y;
}

// Runs kernel(fp32 rows) on fp32 copies of bf16 rows (in_features wide), its outputs
// (out_features wide) rounded back into the bf16 rows: for the paths that take fp32 only.
template <class Kernel>
void through_fp32(const Rows& r, int64_t in_features, int64_t out_features, Kernel&& kernel) {
  std::vector<float> x(r.count * in_features), y(r.count * out_features);
  for (int64_t m = 0; m < r.count; ++m)
    for (int64_t k = 0; k < in_features; ++k) x[m * in_features + k] = widen_bf16(r.x_bf16[m * r.x_stride + k]);
  kernel(Rows{x.data(), r.count, in_features, y.data(), out_features});
  for (int64_t m = 0; m < r.count; ++m)
    for (int64_t n = 0; n < out_features; ++n) r.y_bf16[m * r.y_stride + n] = narrow_bf16(y[m * out_features + n]);
}

#ifdef ZEROLITE_X86
// A vector's lanes as GCC's vector extension sees them, for round_to_bf16.
using Words8 = uint32_t __attribute__((vector_size(32)));
using Words16 = uint32_t __attribute__((vector_size(64)));

// 16 floats to 16 bf16, to nearest even (NaNs not kept: its callers round finite values, sums of
// finite products, decoded K/V).
ZEROLITE_AVX512 inline __m256i narrow_bf16_avx512(__m512 v) {
  Words16 words = reinterpret_cast<Words16>(v);
  round_to_bf16(words);
  return _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(words >> 16));
}
#endif

}  // namespace zerolite
