#include "x_blocks.h"

#include "bf16_bits.h"

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

// AVX2: eight columns of a row as fp32 (the block is whole: a row's last, partial one is copied
// into a zeroed block first).
ZEROLITE_AVX2 inline __m256 columns_avx2(const float* x, const uint16_t* x_bf16, int64_t k) {
  if (x_bf16) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x_bf16 + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  return _mm256_loadu_ps(x + k);
}

ZEROLITE_AVX2 inline __m256i rounded_avx2(__m256 x, __m256 inverse) {
  const __m256 scaled = _mm256_mul_ps(x, inverse);
  const __m256 half = _mm256_or_ps(_mm256_and_ps(scaled, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(0.5f));
  return _mm256_cvttps_epi32(_mm256_add_ps(scaled, half));
}

ZEROLITE_AVX2 inline float max_avx2(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

ZEROLITE_AVX2 inline float add_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

ZEROLITE_AVX2 void row_blocks_avx2(const Rows& r, int64_t m, int64_t in, int8_t* q, float* step, int32_t* q_sum,
                                   float* sum) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // dwords of the two packs below: a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7, put back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  const float* x = r.x_bf16 ? nullptr : r.x + m * r.x_stride;
  const uint16_t* x_bf16 = r.x_bf16 ? r.x_bf16 + m * r.x_stride : nullptr;
  alignas(32) float last[X_BLOCK];
  for (int64_t k0 = 0, b = 0; k0 < in; k0 += X_BLOCK, ++b) {
    const float* block_x = x;
    const uint16_t* block_bf16 = x_bf16;
    int64_t at = k0;
    if (in - k0 < X_BLOCK) {
      for (int64_t k = 0; k < X_BLOCK; ++k)
        last[k] = k0 + k >= in ? 0.0f : x_bf16 ? widen_bf16(x_bf16[k0 + k]) : x[k0 + k];
      block_x = last;
      block_bf16 = nullptr;
      at = 0;
    }
    __m256 v[4];
    for (int i = 0; i < 4; ++i) v[i] = columns_avx2(block_x, block_bf16, at + 8 * i);
    const __m256 largest = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                         _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
    const float block_step = max_avx2(largest) / 127.0f;
    const __m256 inverse = _mm256_set1_ps(block_step > 0.0f ? 1.0f / block_step : 0.0f);
    __m256i qs[4];
    for (int i = 0; i < 4; ++i) qs[i] = rounded_avx2(v[i], inverse);
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qs[0], qs[1]), _mm256_packs_epi32(qs[2], qs[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k0), _mm256_permutevar8x32_epi32(bytes, order));
    step[b] = block_step;
    const __m256i q_total = _mm256_add_epi32(_mm256_add_epi32(qs[0], qs[1]), _mm256_add_epi32(qs[2], qs[3]));
    q_sum[b] = static_cast<int32_t>(add_avx2(_mm256_cvtepi32_ps(q_total)));  // |sum| <= 32 * 127: exact in fp32
    sum[b] = add_avx2(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  }
}

}  // namespace

XBlocks x_blocks(const Rows& r, int64_t in, int64_t padded, CpuPath path) {
  XBlocks out;
  out.padded = padded;
  out.blocks = padded / X_BLOCK;
  // zero as made: the whole blocks past the row stay so (the last block's columns past it are zero as loaded)
  out.q.resize(r.count * padded);
  out.step.resize(r.count * out.blocks);
  out.q_sum.resize(r.count * out.blocks);
  out.sum.resize(r.count * out.blocks);
  auto row = path >= CpuPath::avx512 ? row_blocks : row_blocks_avx2;
  for (int64_t m = 0; m < r.count; ++m)
    row(r, m, in, out.q.data() + m * padded, out.step.data() + m * out.blocks, out.q_sum.data() + m * out.blocks,
        out.sum.data() + m * out.blocks);
  return out;
}

}  // namespace zerolite
#endif
