#include "x_blocks.h"

#ifdef ZEROLITE_X86
#include <immintrin.h>

namespace zerolite {

namespace {

// 16 columns of a row as fp32, the lanes past the row's end zero.
ZEROLITE_AVX512 inline __m512 columns(const Rows& r, int64_t m, int64_t k, __mmask16 mask) {
  if (r.x_bf16) {
    __m256i raw = _mm256_maskz_loadu_epi16(mask, r.x_bf16 + m * r.x_stride + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  return _mm512_maskz_loadu_ps(mask, r.x + m * r.x_stride + k);
}

// q = x * inverse rounded half away from zero: + or - 0.5 by x's sign, then truncated (the
// same fp32 operations, so the same integers, as a scalar loop's).
ZEROLITE_AVX512 inline __m512i rounded(__m512 x, __m512 inverse) {
  const __m512 scaled = _mm512_mul_ps(x, inverse);
  const __m512 half = _mm512_or_ps(_mm512_and_ps(scaled, _mm512_set1_ps(-0.0f)), _mm512_set1_ps(0.5f));
  return _mm512_cvttps_epi32(_mm512_add_ps(scaled, half));
}

ZEROLITE_AVX512 void row_blocks(const Rows& r, int64_t m, int64_t in, int8_t* q, float* step, int32_t* q_sum,
                                float* sum) {
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  for (int64_t k0 = 0, b = 0; k0 < in; k0 += X_BLOCK, ++b) {
    const __mmask32 mask = tail_mask<__mmask32>(in - k0);
    const __m512 low = columns(r, m, k0, static_cast<__mmask16>(mask));
    const __m512 high = columns(r, m, k0 + 16, static_cast<__mmask16>(mask >> 16));
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(low, magnitude), _mm512_and_ps(high, magnitude)));
    const float block_step = largest / 127.0f;
    const __m512 inverse = _mm512_set1_ps(block_step > 0.0f ? 1.0f / block_step : 0.0f);
    const __m512i q_low = rounded(low, inverse), q_high = rounded(high, inverse);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0), _mm512_cvtepi32_epi8(q_low));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16), _mm512_cvtepi32_epi8(q_high));
    step[b] = block_step;
    q_sum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q_low, q_high));
    sum[b] = _mm512_reduce_add_ps(_mm512_add_ps(low, high));
  }
}

}  // namespace

XBlocks x_blocks(const Rows& r, int64_t in, int64_t padded) {
  XBlocks out;
  out.padded = padded;
  out.blocks = padded / X_BLOCK;
  // zero as made: the whole blocks past the row stay so (the last block's columns past it are zero as loaded)
  out.q.resize(r.count * padded);
  out.step.resize(r.count * out.blocks);
  out.q_sum.resize(r.count * out.blocks);
  out.sum.resize(r.count * out.blocks);
  for (int64_t m = 0; m < r.count; ++m)
    row_blocks(r, m, in, out.q.data() + m * padded, out.step.data() + m * out.blocks,
               out.q_sum.data() + m * out.blocks, out.sum.data() + m * out.blocks);
  return out;
}

}  // namespace zerolite
#endif
