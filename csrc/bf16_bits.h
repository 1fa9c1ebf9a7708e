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

inline float widen_bf16(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, 4);
  return value;
}

inline uint16_t narrow_bf16(float value) {
  uint32_t word;
  std::memcpy(&word, &value, 4);
  if ((word & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  return static_cast<uint16_t>((word + 0x7FFFu + ((word >> 16) & 1)) >> 16);
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
// 16 floats to 16 bf16, to nearest even (no NaN's here: sums of finite products).
ZEROLITE_AVX512 inline __m256i narrow_bf16_avx512(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
#endif

}  // namespace zerolite
