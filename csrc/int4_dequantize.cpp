// int4 weights dequantised into W^T ([in, out]): a block's column of nibbles is a run of one row
// of W^T, so each column is widened, scaled and stored in one pass with no transpose in memory.
#include <algorithm>
#include <cstring>

#include "cpu_matmul.h"
#include "int4_blocks.h"
#include "work_pool.h"

#ifdef ZEROLITE_X86
#include <immintrin.h>
#endif

namespace zerolite {

namespace {

inline uint16_t to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

void block_scalar(const Int4Weight& w, const Block& b, void* out, bool bf16) {
  const int bytes = b.rows / 2;
  std::vector<float> scale(b.rows), offset(b.rows);
  for (int64_t k0 = 0, g = 0; k0 < w.in_features; k0 += w.group_size, ++g) {
    for (int row = 0; row < b.rows; ++row) {
      float zero;
      scale_zero_at(w, g, b.row0 + row, scale[row], zero);
      offset[row] = zero - 8 * scale[row];
    }
    const int64_t end = std::min<int64_t>(k0 + w.group_size, w.in_features);
    for (int64_t k = k0; k < end; ++k) {
      const uint8_t* column = b.base + k * bytes;
      for (int byte = 0; byte < bytes; ++byte) {
        for (int high = 0; high < 2; ++high) {
          int row = row_of(b, byte, high);
          float value = static_cast<float>(high ? column[byte] >> 4 : column[byte] & 15) * scale[row] + offset[row];
          int64_t at = k * w.out_features + b.row0 + row;
          if (bf16) static_cast<uint16_t*>(out)[at] = to_bf16(value);
          else static_cast<float*>(out)[at] = value;
        }
      }
    }
  }
}

#ifdef ZEROLITE_X86

// A whole block of "halves" (the packing of every full block where torch packs for AVX2 or
// AVX-512): its lanes are its rows in order, 16 at a time, so each is one plain store.
ZEROLITE_AVX512 void block_halves_avx512(const Int4Weight& w, const Block& b, void* out, bool bf16) {
  const int bytes = b.rows / 2, chunks = bytes / 16;
  const __m512i low_nibble = _mm512_set1_epi32(15);
  const __m512 eight = _mm512_set1_ps(8.0f);
  for (int64_t k0 = 0, g = 0; k0 < w.in_features; k0 += w.group_size, ++g) {
    __m512 scale[4], offset[4];  // block_rows is at most 64: four registers of 16 rows
    for (int i = 0; i < 2 * chunks; ++i) {
      int first = (i & 1) * bytes + 16 * (i / 2);
      __m512 s, z;
      if (w.bf16_scales) {
        const int32_t* words = static_cast<const int32_t*>(w.scale_zero) + g * w.out_features + b.row0 + first;
        __m512i pair = _mm512_loadu_si512(words);
        s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
        z = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
      } else {
        const float* floats = static_cast<const float*>(w.scale_zero) + (g * w.out_features + b.row0 + first) * 2;
        __m512i index = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        s = _mm512_i32gather_ps(index, floats, 4);
        z = _mm512_i32gather_ps(index, floats + 1, 4);
      }
      scale[i] = s;
      offset[i] = _mm512_fnmadd_ps(eight, s, z);
    }
    const int64_t end = std::min<int64_t>(k0 + w.group_size, w.in_features);
    for (int64_t k = k0; k < end; ++k) {
      const uint8_t* column = b.base + k * bytes;
      for (int c = 0; c < chunks; ++c) {
        __m512i wide = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(column + 16 * c)));
        __m512 value[2] = {
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(wide, low_nibble)), scale[2 * c], offset[2 * c]),
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(wide, 4)), scale[2 * c + 1], offset[2 * c + 1])};
        for (int high = 0; high < 2; ++high) {
          int64_t at = k * w.out_features + b.row0 + 16 * c + high * bytes;
          if (bf16) {
            __m512i bits = _mm512_castps_si512(value[high]);
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd), 16);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + at), _mm512_cvtepi32_epi16(rounded));
          } else {
            _mm512_storeu_ps(static_cast<float*>(out) + at, value[high]);
          }
        }
      }
    }
  }
}

#endif  // ZEROLITE_X86

}  // namespace

void int4_dequantize_transposed(const Int4Weight& w, void* out, bool bf16, CpuPath path, int threads) {
  int64_t blocks = (w.out_features + w.block_rows - 1) / w.block_rows;
  kernel_pool().run(threads, blocks, [&](int64_t index) {
    Block b = block_at(w, index);
#ifdef ZEROLITE_X86
    if (path >= CpuPath::avx512 && b.halves && b.rows % 32 == 0) {
      block_halves_avx512(w, b, out, bf16);
      return;
    }
#endif
    block_scalar(w, b, out, bf16);
  });
}

}  // namespace zerolite
