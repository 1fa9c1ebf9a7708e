// int4 weight-only matmul. Work is split by blocks of output rows (the packing's own unit); within
// a block, every column's nibbles are widened to fp32, dequantised with the group's scale and
// zero (w = q * scale + (zero - 8 * scale)) and multiplied into up to four rows of x at once, so
// a column is decoded once for the rows of a tile. Registers hold the block's outputs in the
// order the nibbles lie (low nibbles of a run of bytes, then their high nibbles); each lane's
// output row is mapped when the block is written back.
#include <algorithm>
#include <cstring>
#include <vector>

#include "bf16_bits.h"
#include "cpu_matmul.h"
#include "int4_amx.h"
#include "int4_blocks.h"
#include "work_pool.h"
#include "x_blocks.h"

#ifdef ZEROLITE_X86
#include <immintrin.h>
#endif

namespace zerolite {

namespace {

void block_scalar(const Int4Weight& w, const Block& b, const Rows& r) {
  int bytes = b.rows / 2;
  std::vector<float> acc(b.rows), scale(b.rows), offset(b.rows);
  for (int64_t m = 0; m < r.count; ++m) {
    const float* x = r.x + m * r.x_stride;
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t k0 = 0, g = 0; k0 < w.in_features; k0 += w.group_size, ++g) {
      for (int row = 0; row < b.rows; ++row) {
        float zero;
        scale_zero_at(w, g, b.row0 + row, scale[row], zero);
        offset[row] = zero - 8 * scale[row];
      }
      int64_t end = std::min<int64_t>(k0 + w.group_size, w.in_features);
      for (int64_t k = k0; k < end; ++k) {
        const uint8_t* column = b.base + k * bytes;
        for (int byte = 0; byte < bytes; ++byte) {
          #pragma GCC unroll 16
          for (int high = 0; high < 2; ++high) {
            int row = row_of(b, byte, high);
            float q = static_cast<float>(high ? column[byte] >> 4 : column[byte] & 15);
            acc[row] += (q * scale[row] + offset[row]) * x[k];
          }
        }
      }
    }
    std::copy(acc.begin(), acc.end(), r.y + m * r.y_stride + b.row0);
  }
}

#ifdef ZEROLITE_X86

// AVX-512: a block's column is 16-byte chunks (the last may be 8 bytes: a block of 16 or 48
// rows), each widened to 16 lanes of low nibbles and 16 of high ones.
template <int CHUNKS>
struct LanesAvx512 {
  static constexpr int REGS = 2 * CHUNKS;
  __m512i row[REGS];    // each lane's row in the block
  __mmask16 valid[REGS];
  __mmask16 last_bytes; // the last chunk's bytes
  bool contiguous;      // every register's rows are consecutive (halves: a plain load of scales)
};

template <int CHUNKS>
ZEROLITE_AVX512 LanesAvx512<CHUNKS> lanes_avx512(const Block& b) {
  LanesAvx512<CHUNKS> lanes;
  int bytes = b.rows / 2;
  int last = bytes - 16 * (CHUNKS - 1);
  lanes.last_bytes = static_cast<__mmask16>((1u << last) - 1);
  lanes.contiguous = b.halves;
  #pragma GCC unroll 16
  for (int c = 0; c < CHUNKS; ++c) {
    #pragma GCC unroll 16
    for (int high = 0; high < 2; ++high) {
      alignas(64) int32_t rows[16];
      for (int j = 0; j < 16; ++j) rows[j] = 16 * c + j < bytes ? row_of(b, 16 * c + j, high) : 0;
      lanes.row[2 * c + high] = _mm512_load_si512(rows);
      lanes.valid[2 * c + high] = c == CHUNKS - 1 ? lanes.last_bytes : static_cast<__mmask16>(0xFFFF);
    }
  }
  return lanes;
}

template <int CHUNKS>
ZEROLITE_AVX512 __attribute__((always_inline)) inline void group_scales_avx512(const Int4Weight& w, const Block& b, const LanesAvx512<CHUNKS>& lanes,
                                                int64_t group, __m512* scale, __m512* offset) {
  const __m512 eight = _mm512_set1_ps(8.0f);
  #pragma GCC unroll 16
  for (int i = 0; i < 2 * CHUNKS; ++i) {
    __m512 s, z;
    if (w.bf16_scales) {
      // A row's scale and zero are one 32-bit word: the scale's bf16 bits in its low half.
      const int32_t* words = static_cast<const int32_t*>(w.scale_zero) + group * w.out_features + b.row0;
      __m512i pair = lanes.contiguous
          ? _mm512_maskz_loadu_epi32(lanes.valid[i], words + (i & 1) * (b.rows / 2) + 16 * (i / 2))
          : _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes.valid[i], lanes.row[i], words, 4);
      s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      z = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
    } else {
      const float* floats = static_cast<const float*>(w.scale_zero) + (group * w.out_features + b.row0) * 2;
      __m512i index = _mm512_slli_epi32(lanes.row[i], 1);
      s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes.valid[i], index, floats, 4);
      z = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), lanes.valid[i], index, floats + 1, 4);
    }
    scale[i] = s;
    offset[i] = _mm512_fnmadd_ps(eight, s, z);
  }
}

template <int CHUNKS, int M>
ZEROLITE_AVX512 void tile_avx512(const Int4Weight& w, const Block& b, const LanesAvx512<CHUNKS>& lanes,
                                 const float* x, int64_t x_stride, float* y, int64_t y_stride) {
  constexpr int REGS = 2 * CHUNKS;
  const int bytes = b.rows / 2;
  __m512 acc[M][REGS];
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
    #pragma GCC unroll 16
    for (int i = 0; i < REGS; ++i) acc[m][i] = _mm512_setzero_ps();
  const __m512i low_nibble = _mm512_set1_epi32(15);
  for (int64_t k0 = 0, g = 0; k0 < w.in_features; k0 += w.group_size, ++g) {
    __m512 scale[REGS], offset[REGS];
    group_scales_avx512<CHUNKS>(w, b, lanes, g, scale, offset);
    const int64_t end = std::min<int64_t>(k0 + w.group_size, w.in_features);
    for (int64_t k = k0; k < end; ++k) {
      const uint8_t* column = b.base + k * bytes;
      __m512 weight[REGS];
      #pragma GCC unroll 16
      for (int c = 0; c < CHUNKS; ++c) {
        __m128i raw = c == CHUNKS - 1 ? _mm_maskz_loadu_epi8(lanes.last_bytes, column + 16 * c)
                                      : _mm_loadu_si128(reinterpret_cast<const __m128i*>(column + 16 * c));
        __m512i wide = _mm512_cvtepu8_epi32(raw);
        __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(wide, low_nibble));
        __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4));
        weight[2 * c] = _mm512_fmadd_ps(low, scale[2 * c], offset[2 * c]);
        weight[2 * c + 1] = _mm512_fmadd_ps(high, scale[2 * c + 1], offset[2 * c + 1]);
      }
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        __m512 xk = _mm512_set1_ps(x[m * x_stride + k]);
        #pragma GCC unroll 16
        for (int i = 0; i < REGS; ++i) acc[m][i] = _mm512_fmadd_ps(weight[i], xk, acc[m][i]);
      }
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    float* out = y + m * y_stride + b.row0;
    #pragma GCC unroll 16
    for (int i = 0; i < REGS; ++i)
      _mm512_mask_i32scatter_ps(out, lanes.valid[i], lanes.row[i], acc[m][i], 4);
  }
}

template <int CHUNKS>
ZEROLITE_AVX512 void block_avx512_chunks(const Int4Weight& w, const Block& b, const Rows& r) {
  const LanesAvx512<CHUNKS> lanes = lanes_avx512<CHUNKS>(b);
  int64_t m = 0;
  for (; m + 4 <= r.count; m += 4)
    tile_avx512<CHUNKS, 4>(w, b, lanes, r.x + m * r.x_stride, r.x_stride, r.y + m * r.y_stride, r.y_stride);
  const float* x = r.x + m * r.x_stride;
  float* y = r.y + m * r.y_stride;
  switch (r.count - m) {
    case 3: tile_avx512<CHUNKS, 3>(w, b, lanes, x, r.x_stride, y, r.y_stride); break;
    case 2: tile_avx512<CHUNKS, 2>(w, b, lanes, x, r.x_stride, y, r.y_stride); break;
    case 1: tile_avx512<CHUNKS, 1>(w, b, lanes, x, r.x_stride, y, r.y_stride); break;
    default: break;
  }
}

void block_avx512(const Int4Weight& w, const Block& b, const Rows& r) {
  if (b.rows / 2 > 16) block_avx512_chunks<2>(w, b, r);
  else block_avx512_chunks<1>(w, b, r);
}

// AVX2: 8-byte chunks (a block's rows are a multiple of 16, so no chunk is partial), one row of x
// at a time; the group's scales wait in memory, as 16 registers cannot hold them beside the sums.
template <int CHUNKS>
ZEROLITE_AVX2 void block_avx2_chunks(const Int4Weight& w, const Block& b, const Rows& r) {
  constexpr int REGS = 2 * CHUNKS;
  const int bytes = b.rows / 2;
  alignas(32) int32_t rows[REGS][8];
  #pragma GCC unroll 16
  for (int c = 0; c < CHUNKS; ++c)
    #pragma GCC unroll 16
    for (int high = 0; high < 2; ++high)
      for (int j = 0; j < 8; ++j) rows[2 * c + high][j] = row_of(b, 8 * c + j, high);
  const __m256i low_nibble = _mm256_set1_epi32(15);
  const __m256 eight = _mm256_set1_ps(8.0f);
  alignas(32) float scale[REGS][8], offset[REGS][8];
  for (int64_t m = 0; m < r.count; ++m) {
    const float* x = r.x + m * r.x_stride;
    __m256 acc[REGS];
    #pragma GCC unroll 16
    for (int i = 0; i < REGS; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t k0 = 0, g = 0; k0 < w.in_features; k0 += w.group_size, ++g) {
      #pragma GCC unroll 16
      for (int i = 0; i < REGS; ++i) {
        __m256i index = _mm256_load_si256(reinterpret_cast<const __m256i*>(rows[i]));
        __m256 s, z;
        if (w.bf16_scales) {
          const int* words = static_cast<const int*>(w.scale_zero) + g * w.out_features + b.row0;
          __m256i pair = _mm256_i32gather_epi32(words, index, 4);
          s = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
          z = _mm256_castsi256_ps(_mm256_and_si256(pair, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
        } else {
          const float* floats = static_cast<const float*>(w.scale_zero) + (g * w.out_features + b.row0) * 2;
          __m256i twice = _mm256_slli_epi32(index, 1);
          s = _mm256_i32gather_ps(floats, twice, 4);
          z = _mm256_i32gather_ps(floats + 1, twice, 4);
        }
        _mm256_store_ps(scale[i], s);
        _mm256_store_ps(offset[i], _mm256_fnmadd_ps(eight, s, z));
      }
      const int64_t end = std::min<int64_t>(k0 + w.group_size, w.in_features);
      for (int64_t k = k0; k < end; ++k) {
        const uint8_t* column = b.base + k * bytes;
        __m256 xk = _mm256_set1_ps(x[k]);
        #pragma GCC unroll 16
        for (int c = 0; c < CHUNKS; ++c) {
          __m256i wide = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(column + 8 * c)));
          __m256 low = _mm256_cvtepi32_ps(_mm256_and_si256(wide, low_nibble));
          __m256 high = _mm256_cvtepi32_ps(_mm256_srli_epi32(wide, 4));
          __m256 wl = _mm256_fmadd_ps(low, _mm256_load_ps(scale[2 * c]), _mm256_load_ps(offset[2 * c]));
          __m256 wh = _mm256_fmadd_ps(high, _mm256_load_ps(scale[2 * c + 1]), _mm256_load_ps(offset[2 * c + 1]));
          acc[2 * c] = _mm256_fmadd_ps(wl, xk, acc[2 * c]);
          acc[2 * c + 1] = _mm256_fmadd_ps(wh, xk, acc[2 * c + 1]);
        }
      }
    }
    float* out = r.y + m * r.y_stride + b.row0;
    #pragma GCC unroll 16
    for (int i = 0; i < REGS; ++i) {
      alignas(32) float sums[8];
      _mm256_store_ps(sums, acc[i]);
      for (int j = 0; j < 8; ++j) out[rows[i][j]] = sums[j];
    }
  }
}

void block_avx2(const Int4Weight& w, const Block& b, const Rows& r) {
  switch (b.rows / 16) {
    case 1: block_avx2_chunks<1>(w, b, r); break;
    case 2: block_avx2_chunks<2>(w, b, r); break;
    case 3: block_avx2_chunks<3>(w, b, r); break;
    default: block_avx2_chunks<4>(w, b, r); break;
  }
}

// avx512vnni: x quantized per 32 columns (XBlocks), the weights' nibbles multiplied as
// bytes. A 64-row "halves" block keeps four columns in 128 consecutive bytes: two permutes per
// 32 rows gather each row's four nibbles into one 32-bit lane, which vpdpbusd multiplies by the
// four columns of x and adds in one step. Other blocks take the fp32 tile.
constexpr int64_t SCALES_AHEAD = 4;  // groups
constexpr int64_t PREFETCH_AHEAD = 4096;  // bytes of a block's columns

template <int M>
ZEROLITE_AVX512VNNI void tile_vnni(const Int4Weight& w, const Block& b, const XBlocks& xq, int64_t m0,
                                   const Rows& r) {
  const __m512i low_nibble = _mm512_set1_epi8(15);
  alignas(64) int8_t order[64];
  for (int j = 0; j < 16; ++j) {
    order[4 * j] = static_cast<int8_t>(j);
    order[4 * j + 1] = static_cast<int8_t>(32 + j);
    order[4 * j + 2] = static_cast<int8_t>(64 + j);
    order[4 * j + 3] = static_cast<int8_t>(96 + j);
  }
  const __m512i first = _mm512_load_si512(order);                      // rows j of 16: columns k .. k + 3
  const __m512i second = _mm512_add_epi8(first, _mm512_set1_epi8(16)); // rows 16 + j
  const int64_t groups = w.stored_in / w.group_size, blocks_per_group = w.group_size / X_BLOCK;
  alignas(64) float sum[M][64] = {};  // the block's outputs, in memory: the registers hold the dot products
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * w.group_size;
    if (k0 >= w.in_features) break;
    __m512 scale[4], zero[4];
    const int32_t* words = static_cast<const int32_t*>(w.scale_zero) + g * w.out_features + b.row0;
    if (g + SCALES_AHEAD < groups) {
      // A group's scales lie a whole row of scales from the last's (another page each time), where
      // the prefetchers do not follow: fetched SCALES_AHEAD groups before they are needed.
      const char* ahead = reinterpret_cast<const char*>(w.scale_zero) +
                          ((g + SCALES_AHEAD) * w.out_features + b.row0) * 2 * (w.bf16_scales ? 2 : 4);
      for (int line = 0; line < (w.bf16_scales ? 4 : 8); ++line) __builtin_prefetch(ahead + 64 * line);
    }
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i) {
      __m512 s, z;
      if (w.bf16_scales) {
        __m512i pair = _mm512_loadu_si512(words + 16 * i);
        s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        z = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
      } else {
        const float* floats = static_cast<const float*>(w.scale_zero) + (g * w.out_features + b.row0 + 16 * i) * 2;
        __m512i index = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        s = _mm512_i32gather_ps(index, floats, 4);
        z = _mm512_i32gather_ps(index, floats + 1, 4);
      }
      scale[i] = s;
      zero[i] = z;
    }
    const int64_t group_end = std::min<int64_t>(k0 + w.group_size, w.in_features);
    for (int64_t x0 = k0; x0 < group_end; x0 += X_BLOCK) {
      __m512i dot[M][4];
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
        for (int i = 0; i < 4; ++i) dot[m][i] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int k = 0; k < X_BLOCK; k += 4) {
        const uint8_t* columns = b.base + (x0 + k) * 32;
        // a page ahead: the block's columns run on through pages, where the prefetchers stop
        _mm_prefetch(reinterpret_cast<const char*>(columns + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(columns + PREFETCH_AHEAD + 64), _MM_HINT_T0);
        __m512i a = _mm512_loadu_si512(columns), c = _mm512_loadu_si512(columns + 64);
        __m512i a_low = _mm512_and_si512(a, low_nibble), c_low = _mm512_and_si512(c, low_nibble);
        __m512i a_high = _mm512_and_si512(_mm512_srli_epi16(a, 4), low_nibble);
        __m512i c_high = _mm512_and_si512(_mm512_srli_epi16(c, 4), low_nibble);
        __m512i quads[4] = {_mm512_permutex2var_epi8(a_low, first, c_low), _mm512_permutex2var_epi8(a_low, second, c_low),
                            _mm512_permutex2var_epi8(a_high, first, c_high),
                            _mm512_permutex2var_epi8(a_high, second, c_high)};
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          int32_t four;
          std::memcpy(&four, xq.q.data() + (m0 + m) * xq.padded + x0 + k, 4);
          __m512i xs = _mm512_set1_epi32(four);
#pragma GCC unroll 16
          for (int i = 0; i < 4; ++i) dot[m][i] = _mm512_dpbusd_epi32(dot[m][i], quads[i], xs);
        }
      }
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        const int64_t block = (m0 + m) * xq.blocks + x0 / X_BLOCK;
        __m512 step = _mm512_set1_ps(xq.step[block]);
        // (q - 8) . x: centred, so x's rounding is weighed by |q - 8|, not by q
        __m512i eight_sums = _mm512_set1_epi32(8 * xq.q_sum[block]);
#pragma GCC unroll 16
        for (int i = 0; i < 4; ++i)
          _mm512_store_ps(sum[m] + 16 * i, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[m][i], eight_sums)),
                                                          _mm512_mul_ps(scale[i], step), _mm512_load_ps(sum[m] + 16 * i)));
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const float* block_sums = xq.sum.data() + (m0 + m) * xq.blocks + g * blocks_per_group;
      float group_sum = 0.0f;  // x's own, unrounded
      for (int64_t i = 0; i < blocks_per_group; ++i) group_sum += block_sums[i];
      __m512 total = _mm512_set1_ps(group_sum);
#pragma GCC unroll 16
      for (int i = 0; i < 4; ++i)
        _mm512_store_ps(sum[m] + 16 * i, _mm512_fmadd_ps(zero[i], total, _mm512_load_ps(sum[m] + 16 * i)));
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int i = 0; i < 4; ++i) {
      const int64_t at = (m0 + m) * r.y_stride + b.row0 + 16 * i;
      if (r.y_bf16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.y_bf16 + at), narrow_bf16_avx512(_mm512_load_ps(sum[m] + 16 * i)));
      else
        _mm512_storeu_ps(r.y + at, _mm512_load_ps(sum[m] + 16 * i));
    }
}

void block_vnni(const Int4Weight& w, const Block& b, const Rows& r, const XBlocks& xq) {
  if (!(b.halves && b.rows == 64)) {
    block_avx512(w, b, r);
    return;
  }
  int64_t m = 0;
  for (; m + 4 <= r.count; m += 4) tile_vnni<4>(w, b, xq, m, r);
  switch (r.count - m) {
    case 3: tile_vnni<3>(w, b, xq, m, r); break;
    case 2: tile_vnni<2>(w, b, xq, m, r); break;
    case 1: tile_vnni<1>(w, b, xq, m, r); break;
    default: break;
  }
}

// avx2int8: the vnni tile's scheme with AVX2's byte products, for "halves" blocks of 64 rows
// (AVX-512's packing) and of 32 (AVX2's). Four columns' nibbles are interleaved by unpacks, which
// work within 128-bit halves:
// - 64 rows (columns of 32 bytes): into quads, each 32-bit lane one row's four nibbles, which
//   vpmaddubsw multiplies by the four columns of x, summing pairs to int16; a register's eight lanes
//   are rows 4i .. 4i + 3 and 4i + 16 .. 4i + 19 of a half (lane_row);
// - 32 rows (columns of 16 bytes, two to a register: k and k + 1, then k + 2 and k + 3): into pairs
//   of columns k and k + 2 in a register's low half and k + 1 and k + 3 in its high half, each
//   16-bit lane one row's two nibbles, multiplied by x's columns in the same order; no lane crosses
//   halves until a block of x ends, when the halves' sums are added: lanes are rows in order.
// Each product of a pair is at most 2 x 15 x 127 = 3810, and a block of x's 32 columns adds its
// eight of them in int16 (at most 30480: no overflow) before they are widened to int32.
template <int ROWS>
inline int lane_row(int lane) {  // lane: register * 8 + position
  if constexpr (ROWS == 32) return lane;
  const int reg = lane / 8, j = lane % 8;
  return 32 * (reg / 4) + 4 * (reg % 4) + (j & 3) + (j >= 4 ? 16 : 0);
}

// A group's scales and zeros for a block's rows, in lane order.
template <int ROWS>
ZEROLITE_AVX2 void lane_scales_avx2(const Int4Weight& w, const Block& b, int64_t g, float* scale, float* zero) {
  if (!w.bf16_scales) {
    for (int lane = 0; lane < ROWS; ++lane) scale_zero_at(w, g, b.row0 + lane_row<ROWS>(lane), scale[lane], zero[lane]);
    return;
  }
  // A row's scale and zero are one 32-bit word: the scale's bf16 bits in its low half.
  const int32_t* words = static_cast<const int32_t*>(w.scale_zero) + g * w.out_features + b.row0;
  const __m256i high_half = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int reg = 0; reg < ROWS / 8; ++reg) {
    const __m256i pair = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(words + lane_row<ROWS>(8 * reg + 4)),
                                             reinterpret_cast<const __m128i*>(words + lane_row<ROWS>(8 * reg)));
    _mm256_store_ps(scale + 8 * reg, _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16)));
    _mm256_store_ps(zero + 8 * reg, _mm256_castsi256_ps(_mm256_and_si256(pair, high_half)));
  }
}

// Four columns from k of a block's rows, four registers: a 64-row block's low nibbles (rows 0-31,
// pass 0) or high ones (pass 1) as quads; a 32-row block's all as pairs.
template <int ROWS>
ZEROLITE_AVX2 __attribute__((always_inline)) inline void nibbles_avx2(const uint8_t* columns, int pass, __m256i* out) {
  const __m256i low_nibble = _mm256_set1_epi8(15);
  if constexpr (ROWS == 64) {
    __m256i nibbles[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(columns + 32 * c));
      nibbles[c] = _mm256_and_si256(pass ? _mm256_srli_epi16(raw, 4) : raw, low_nibble);
    }
    const __m256i pairs_low = _mm256_unpacklo_epi8(nibbles[0], nibbles[1]);
    const __m256i pairs_high = _mm256_unpackhi_epi8(nibbles[0], nibbles[1]);
    const __m256i next_low = _mm256_unpacklo_epi8(nibbles[2], nibbles[3]);
    const __m256i next_high = _mm256_unpackhi_epi8(nibbles[2], nibbles[3]);
    out[0] = _mm256_unpacklo_epi16(pairs_low, next_low);
    out[1] = _mm256_unpackhi_epi16(pairs_low, next_low);
    out[2] = _mm256_unpacklo_epi16(pairs_high, next_high);
    out[3] = _mm256_unpackhi_epi16(pairs_high, next_high);
  } else {
    const __m256i near = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(columns));      // k, k + 1
    const __m256i far = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(columns + 32));  // k + 2, k + 3
#pragma GCC unroll 2
    for (int high = 0; high < 2; ++high) {
      const __m256i a = _mm256_and_si256(high ? _mm256_srli_epi16(near, 4) : near, low_nibble);
      const __m256i c = _mm256_and_si256(high ? _mm256_srli_epi16(far, 4) : far, low_nibble);
      out[2 * high] = _mm256_unpacklo_epi8(a, c);      // rows 0-7 of the half
      out[2 * high + 1] = _mm256_unpackhi_epi8(a, c);  // rows 8-15
    }
  }
}

// x's four columns from k, as nibbles_avx2's registers take them: the four bytes in every 32-bit
// lane (64 rows), or columns k and k + 2 in every 16-bit lane of the low half and k + 1 and k + 3
// of the high half (32 rows).
template <int ROWS>
ZEROLITE_AVX2 __attribute__((always_inline)) inline __m256i x_columns_avx2(const int8_t* x) {
  int32_t four;
  std::memcpy(&four, x, 4);
  const __m256i broadcast = _mm256_set1_epi32(four);
  if constexpr (ROWS == 64) return broadcast;
  const __m256i order = _mm256_setr_epi8(0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2, 0, 2,
                                         1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3, 1, 3);
  return _mm256_shuffle_epi8(broadcast, order);
}

// int16 sums of a block of x to int32, a lane a row: each quad's two halves (64 rows), or each
// row's two 128-bit halves (32 rows).
template <int ROWS>
ZEROLITE_AVX2 __attribute__((always_inline)) inline __m256i widened_avx2(__m256i sums) {
  if constexpr (ROWS == 64) return _mm256_madd_epi16(sums, _mm256_set1_epi16(1));
  return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(sums)),
                          _mm256_cvtepi16_epi32(_mm256_extracti128_si256(sums, 1)));
}

template <int ROWS, int M>
ZEROLITE_AVX2 void tile_avx2int8(const Int4Weight& w, const Block& b, const XBlocks& xq, int64_t m0, const Rows& r) {
  constexpr int PASSES = ROWS / 32, BYTES = ROWS / 2;  // passes over a column's bytes; bytes a column
  const int64_t groups = w.stored_in / w.group_size, blocks_per_group = w.group_size / X_BLOCK;
  alignas(32) float sum[M][ROWS] = {};  // the block's outputs in lane order
  alignas(32) float scale[ROWS], zero[ROWS];
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * w.group_size;
    if (k0 >= w.in_features) break;
    lane_scales_avx2<ROWS>(w, b, g, scale, zero);
    const int64_t group_end = std::min<int64_t>(k0 + w.group_size, w.in_features);
    for (int64_t x0 = k0; x0 < group_end; x0 += X_BLOCK) {
      for (int pass = 0; pass < PASSES; ++pass) {
        __m256i dot[M][4];
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) dot[m][i] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int k = 0; k < X_BLOCK; k += 4) {
          const uint8_t* columns = b.base + (x0 + k) * BYTES;
          if (pass == 0) {  // a page ahead, as the vnni tile
            _mm_prefetch(reinterpret_cast<const char*>(columns + PREFETCH_AHEAD), _MM_HINT_T0);
            if constexpr (ROWS == 64)
              _mm_prefetch(reinterpret_cast<const char*>(columns + PREFETCH_AHEAD + 64), _MM_HINT_T0);
          }
          __m256i nibbles[4];
          nibbles_avx2<ROWS>(columns, pass, nibbles);
#pragma GCC unroll 16
          for (int m = 0; m < M; ++m) {
            const __m256i xs = x_columns_avx2<ROWS>(xq.q.data() + (m0 + m) * xq.padded + x0 + k);
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) dot[m][i] = _mm256_add_epi16(dot[m][i], _mm256_maddubs_epi16(nibbles[i], xs));
          }
        }
#pragma GCC unroll 16
        for (int m = 0; m < M; ++m) {
          const int64_t block = (m0 + m) * xq.blocks + x0 / X_BLOCK;
          const __m256 step = _mm256_set1_ps(xq.step[block]);
          const __m256i eight_sums = _mm256_set1_epi32(8 * xq.q_sum[block]);  // (q - 8) . x, as the vnni tile
#pragma GCC unroll 4
          for (int i = 0; i < 4; ++i) {
            const int lane = 32 * pass + 8 * i;
            const __m256 products = _mm256_cvtepi32_ps(_mm256_sub_epi32(widened_avx2<ROWS>(dot[m][i]), eight_sums));
            _mm256_store_ps(sum[m] + lane, _mm256_fmadd_ps(products, _mm256_mul_ps(_mm256_load_ps(scale + lane), step),
                                                           _mm256_load_ps(sum[m] + lane)));
          }
        }
      }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const float* block_sums = xq.sum.data() + (m0 + m) * xq.blocks + g * blocks_per_group;
      float group_sum = 0.0f;  // x's own, unrounded
      for (int64_t i = 0; i < blocks_per_group; ++i) group_sum += block_sums[i];
      const __m256 total = _mm256_set1_ps(group_sum);
      for (int lane = 0; lane < ROWS; lane += 8)
        _mm256_store_ps(sum[m] + lane,
                        _mm256_fmadd_ps(_mm256_load_ps(zero + lane), total, _mm256_load_ps(sum[m] + lane)));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int lane = 0; lane < ROWS; ++lane) store_output(r, m0 + m, b.row0 + lane_row<ROWS>(lane), sum[m][lane]);
}

// Four rows of x a tile where there are four: each decoded column serves them all (one thread, 16
// rows of 2048 x 5632: 4.3-5.5 ms of CPU against 5.0-7.0 with tiles of two), though their sums
// outnumber the registers.
template <int ROWS>
void block_avx2int8_rows(const Int4Weight& w, const Block& b, const Rows& r, const XBlocks& xq) {
  int64_t m = 0;
  for (; m + 4 <= r.count; m += 4) tile_avx2int8<ROWS, 4>(w, b, xq, m, r);
  for (; m + 2 <= r.count; m += 2) tile_avx2int8<ROWS, 2>(w, b, xq, m, r);
  if (m < r.count) tile_avx2int8<ROWS, 1>(w, b, xq, m, r);
}

void block_avx2int8(const Int4Weight& w, const Block& b, const Rows& r, const XBlocks& xq) {
  if (b.halves && b.rows == 64) block_avx2int8_rows<64>(w, b, r, xq);
  else if (b.halves && b.rows == 32) block_avx2int8_rows<32>(w, b, r, xq);
  else block_avx2(w, b, r);
}

// amx (csrc/int4_amx.cpp) from AMX_MIN_ROWS rows of x on: below, the dequantisation it costs
// whatever the rows outweighs the vnni tile's products (measured, one thread: 0.7x its speed at
// 1 and 4 rows, 1.0 to 1.1x at 8, 1.6x at 16, 2.8x at 64).
constexpr int64_t AMX_MIN_ROWS = 8;

#endif  // ZEROLITE_X86

}  // namespace

void int4_matmul(const Int4Weight& w, const Rows& r, CpuPath path, int threads) {
  int64_t blocks = (w.out_features + w.block_rows - 1) / w.block_rows;
  void (*block)(const Int4Weight&, const Block&, const Rows&) = block_scalar;
#ifdef ZEROLITE_X86
  // bf16 rows as they are where every block takes the vnni tile (64-row "halves" blocks, whole) or
  // the avx2int8 one (64 or 32)
  const bool vnni = path >= CpuPath::avx512vnni && w.group_size % X_BLOCK == 0;
  const bool avx2int8 = path == CpuPath::avx2int8 && w.group_size % X_BLOCK == 0;
  const bool tiled = vnni ? w.block_rows == 64 : avx2int8 && (w.block_rows == 64 || w.block_rows == 32);
  if (r.x_bf16 && !(tiled && w.halves && w.out_features % w.block_rows == 0)) {
#else
  if (r.x_bf16) {
#endif
    through_fp32(r, w.in_features, w.out_features, [&](const Rows& rows) { int4_matmul(w, rows, path, threads); });
    return;
  }
#ifdef ZEROLITE_X86
  if (vnni && path >= CpuPath::amx && r.count >= AMX_MIN_ROWS) {
    const AmxRows x = amx_rows(r, w);
    kernel_pool().run(threads, blocks, [&](int64_t index) {
      const Block b = block_at(w, index);
      if (b.halves && b.rows == 64) block_amx(w, b, x, r);
      else block_avx512(w, b, r);
    });
    return;
  }
  if (vnni || avx2int8) {
    const XBlocks xq = x_blocks(r, w.in_features, w.stored_in, path);
    auto tile = vnni ? block_vnni : block_avx2int8;
    kernel_pool().run(threads, blocks, [&](int64_t index) { tile(w, block_at(w, index), r, xq); });
    return;
  }
  if (path >= CpuPath::avx512) block = block_avx512;
  if (path == CpuPath::avx2 || path == CpuPath::avx2int8) block = block_avx2;
#endif
  kernel_pool().run(threads, blocks, [&](int64_t index) { block(w, block_at(w, index), r); });
}

}  // namespace zerolite
