// The int4 kernel's amx path: the weights dequantised to bf16, 32 columns at a time, straight
// into the layout of AMX's B tiles, and multiplied into bf16 rows of x by tdpbf16ps, whose fp32
// sums stay in the tiles across every group. (AMX's int8 tiles, tried first, had to leave the
// tiles every 32 columns, where x's step and the weights' scales change: that store and its fp32
// multiply-add per row cost more than the products.) The dequantisation costs the same whatever
// the rows, the tiles' products next to nothing. x is rounded to bf16 (a bf16 model's rows
// already are), each weight (q - 8) * scale + zero computed in fp32 and rounded to bf16 once.
#include "int4_amx.h"

#include <algorithm>
#include <cstring>

#include "bf16_bits.h"

#ifdef ZEROLITE_X86
#include <immintrin.h>

namespace zerolite {

namespace {

constexpr int TILE_ROWS = 16;      // rows of x a tile holds
constexpr int STEP = 32;           // columns a B tile holds: 16 rows of pairs of columns
constexpr int BLOCK = 64;          // outputs a task computes: a 64-row "halves" block, four tiles wide
constexpr int CHUNK_STEPS = 8;     // steps of columns dequantised before the tiles run over them
constexpr int64_t ROW_CHUNK = 256;  // rows of x whose sums a task keeps at once
constexpr int STEP_WEIGHTS = BLOCK * STEP;
constexpr int64_t PREFETCH_AHEAD = 4096;  // bytes of a block's columns (a block runs on through pages)
constexpr int64_t SCALES_AHEAD = 4;       // groups

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0 to 3: the sums of `rows` rows of x by 16 outputs each; tile 4: those rows of x, 32
// columns; tiles 5 and 6: 16 outputs' weights for those columns, a row per pair of columns.
ZEROLITE_AMX void configure_tiles(int rows) {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = static_cast<uint8_t>(rows);
  }
  for (int t : {5, 6}) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = STEP / 2;
  }
  _tile_loadconfig(&config);
}

// A group's scales and offsets (zero - 8 * scale) for the block's outputs as a B tile's row
// holds them: lanes 2i and 2i + 1 output i's (its two columns); register r: outputs 8r to 8r + 7.
ZEROLITE_AMX inline void group_scales(const Int4Weight& w, const Block& b, int64_t group, __m512* scale,
                                      __m512* offset) {
  const __m512i twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512 eight = _mm512_set1_ps(8.0f);
#pragma GCC unroll 8
  for (int r = 0; r < 8; ++r) {
    const int64_t first = group * w.out_features + b.row0 + 8 * r;
    __m512 s, z;
    if (w.bf16_scales) {
      // a row's scale and zero are one 32-bit word, the scale's bits in its low half
      const __m256i eight_words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
          static_cast<const int32_t*>(w.scale_zero) + first));
      const __m512i words = _mm512_permutexvar_epi32(twice, _mm512_castsi256_si512(eight_words));
      s = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
      z = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
    } else {
      const __m512 pairs = _mm512_loadu_ps(static_cast<const float*>(w.scale_zero) + 2 * first);
      const __m512i even = _mm512_slli_epi32(twice, 1);
      s = _mm512_permutexvar_ps(even, pairs);
      z = _mm512_permutexvar_ps(_mm512_add_epi32(even, _mm512_set1_epi32(1)), pairs);
    }
    scale[r] = s;
    offset[r] = _mm512_fnmadd_ps(eight, s, z);
  }
}

// The 32 columns from k of block b, dequantised into out: four B tiles, tile j the outputs 16j to
// 16j + 15, its row p columns k + 2p and k + 2p + 1 (lane 2i + c: output 16j + i, column k + 2p + c).
// Those two columns are 64 consecutive bytes, byte d of a column output d's nibble (low) and
// d + 32's (high): a byte permute puts each of eight outputs' bytes, both columns, in a lane of its own.
ZEROLITE_AMX inline void dequantize_step(const Block& b, int64_t k, const __m512* scale, const __m512* offset,
                                         uint16_t* out) {
  constexpr __mmask64 LOW_BYTES = 0x1111111111111111ull;  // each 32-bit lane's first byte
  const __m512i low_nibble = _mm512_set1_epi32(15);
  __m512i spread[4];  // outputs 8q to 8q + 7 (low nibbles; + 32 high): lane 2i + c byte c * 32 + 8q + i
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q)
    spread[q] = _mm512_add_epi32(_mm512_set_epi32(39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0),
                                 _mm512_set1_epi32(8 * q));
  const uint8_t* columns = b.base + k * (BLOCK / 2);
#pragma GCC unroll 2
  for (int p = 0; p < STEP / 2; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(columns + 64 * p + PREFETCH_AHEAD), _MM_HINT_T0);
    const __m512i bytes = _mm512_loadu_si512(columns + 64 * p);
    __m512 weights[8];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m512i lanes = _mm512_maskz_permutexvar_epi8(LOW_BYTES, spread[q], bytes);
      weights[q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(lanes, low_nibble)), scale[q], offset[q]);
      weights[4 + q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(lanes, 4)), scale[4 + q], offset[4 + q]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      _mm512_store_si512(out + j * (STEP_WEIGHTS / 4) + p * 32,
                         (__m512i)_mm512_cvtne2ps_pbh(weights[2 * j + 1], weights[2 * j]));
  }
}

// The tiles' products for one tile of rows over `steps` dequantised steps from column k.
ZEROLITE_AMX inline void multiply_steps(const uint16_t* x, int64_t x_stride, const uint16_t* weights, int steps) {
  for (int s = 0; s < steps; ++s) {
    const uint16_t* step = weights + s * STEP_WEIGHTS;
    _tile_loadd(4, x + s * STEP, x_stride * 2);
    _tile_loadd(5, step, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, step + STEP_WEIGHTS / 4, 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, step + STEP_WEIGHTS / 2, 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, step + 3 * STEP_WEIGHTS / 4, 64);
    _tile_dpbf16ps(3, 4, 6);
  }
}

ZEROLITE_AMX inline void load_sums(const float* sum) {
  _tile_loadd(0, sum, BLOCK * 4);
  _tile_loadd(1, sum + 16, BLOCK * 4);
  _tile_loadd(2, sum + 32, BLOCK * 4);
  _tile_loadd(3, sum + 48, BLOCK * 4);
}

ZEROLITE_AMX inline void store_sums(float* sum) {
  _tile_stored(0, sum, BLOCK * 4);
  _tile_stored(1, sum + 16, BLOCK * 4);
  _tile_stored(2, sum + 32, BLOCK * 4);
  _tile_stored(3, sum + 48, BLOCK * 4);
}

ZEROLITE_AMX inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// The group's scales where column step `step` starts one, fetching a later group's ahead: a
// group's scales lie a whole row of scales from the last's (another page each time), where the
// prefetchers do not follow.
ZEROLITE_AMX inline void scales_at(const Int4Weight& w, const Block& b, int64_t step, __m512* scale, __m512* offset) {
  const int64_t steps_per_group = w.group_size / STEP;
  if (step % steps_per_group != 0) return;
  const int64_t group = step / steps_per_group;
  if ((group + SCALES_AHEAD) * w.group_size < w.stored_in) {
    const char* ahead = reinterpret_cast<const char*>(w.scale_zero) +
                        ((group + SCALES_AHEAD) * w.out_features + b.row0) * 2 * (w.bf16_scales ? 2 : 4);
    for (int line = 0; line < (w.bf16_scales ? 4 : 8); ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
  }
  group_scales(w, b, group, scale, offset);
}

// Sums of count rows of x from m0 into sum. One tile of rows: each step of columns dequantised
// and multiplied at once, into one of two buffers, so that the next step's dequantisation runs
// while the tiles multiply this one's; the sums stay in the tiles throughout. More: CHUNK_STEPS
// steps dequantised, then each tile of rows multiplied over them, its sums loaded and stored
// around them.
ZEROLITE_AMX void rows_amx(const Int4Weight& w, const Block& b, const AmxRows& x, int64_t m0, int64_t count,
                           float (*sum)[BLOCK]) {
  const int64_t steps = (w.in_features + STEP - 1) / STEP;
  const int64_t tiles = (count + TILE_ROWS - 1) / TILE_ROWS;
  alignas(64) uint16_t weights[CHUNK_STEPS * STEP_WEIGHTS];
  __m512 scale[8], offset[8];
  const uint16_t* rows = x.x + m0 * x.stride;
  if (tiles == 1) {
    zero_sums();
    for (int64_t step = 0; step < steps; ++step) {
      uint16_t* buffer = weights + (step & 1) * STEP_WEIGHTS;
      scales_at(w, b, step, scale, offset);
      dequantize_step(b, step * STEP, scale, offset, buffer);
      multiply_steps(rows + step * STEP, x.stride, buffer, 1);
    }
    store_sums(sum[0]);
    return;
  }
  for (int64_t s0 = 0; s0 < steps; s0 += CHUNK_STEPS) {
    const int chunk = static_cast<int>(std::min<int64_t>(CHUNK_STEPS, steps - s0));
    for (int s = 0; s < chunk; ++s) {
      scales_at(w, b, s0 + s, scale, offset);
      dequantize_step(b, (s0 + s) * STEP, scale, offset, weights + s * STEP_WEIGHTS);
    }
    for (int64_t t = 0; t < tiles; ++t) {
      if (s0 == 0) zero_sums();
      else load_sums(sum[t * TILE_ROWS]);
      multiply_steps(rows + t * TILE_ROWS * x.stride + s0 * STEP, x.stride, weights, chunk);
      store_sums(sum[t * TILE_ROWS]);
    }
  }
}

// y's rows m0 to m0 + count - 1 of the block, from their sums.
ZEROLITE_AVX512 void write_rows(const Block& b, const float (*sum)[BLOCK], int64_t m0, int64_t count, const Rows& r) {
  for (int64_t m = 0; m < count; ++m)
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const int64_t at = (m0 + m) * r.y_stride + b.row0 + 16 * i;
      if (r.y_bf16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.y_bf16 + at),
                            narrow_bf16_avx512(_mm512_load_ps(sum[m] + 16 * i)));
      else
        _mm512_storeu_ps(r.y + at, _mm512_load_ps(sum[m] + 16 * i));
    }
}

ZEROLITE_AVX512BF16 void narrow_row(const float* x, int64_t in_features, uint16_t* out) {
  for (int64_t k = 0; k < in_features; k += 16) {
    const __mmask16 mask = tail_mask<__mmask16>(in_features - k);
    _mm256_mask_storeu_epi16(out + k, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + k)));
  }
}

}  // namespace

AmxRows amx_rows(const Rows& r, int64_t in_features) {
  const int64_t stride = (in_features + STEP - 1) / STEP * STEP;
  const bool whole_tiles = r.count < TILE_ROWS || r.count % TILE_ROWS == 0;
  if (r.x_bf16 && stride == in_features && whole_tiles) return AmxRows{r.x_bf16, r.count, r.x_stride, {}};
  AmxRows rows{nullptr, r.count, stride, {}};
  const int64_t count = whole_tiles ? r.count : (r.count + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
  rows.copy.assign(count * stride, 0);
  for (int64_t m = 0; m < r.count; ++m) {
    if (r.x_bf16) std::memcpy(rows.copy.data() + m * stride, r.x_bf16 + m * r.x_stride, in_features * 2);
    else narrow_row(r.x + m * r.x_stride, in_features, rows.copy.data() + m * stride);
  }
  rows.x = rows.copy.data();
  return rows;
}

// The tile configuration is each thread's own: set for each block, and released after it (a
// thread holding tiles has their 8 KB saved at every switch of context).
ZEROLITE_AMX void block_amx(const Int4Weight& w, const Block& b, const AmxRows& x, const Rows& r) {
  alignas(64) float sum[ROW_CHUNK][BLOCK];
  configure_tiles(static_cast<int>(std::min<int64_t>(TILE_ROWS, x.count)));
  for (int64_t m0 = 0; m0 < x.count; m0 += ROW_CHUNK) {
    const int64_t count = std::min(ROW_CHUNK, x.count - m0);
    rows_amx(w, b, x, m0, count, sum);
    write_rows(b, sum, m0, count, r);
  }
  _tile_release();
}

}  // namespace zerolite
#endif
