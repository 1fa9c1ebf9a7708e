// The int4 kernel's amx path: bf16 rows of x multiplied by the weights in AMX's bf16 tiles
// (tdpbf16ps), 32 columns a step, the weights laid out as the B tiles read them. Two ways:
// - Few rows (takes_integers): each nibble q goes into the tiles as q - 8, exact in bf16 (a table
//   lookup makes 32 of them), and each group's fp32 sums leave the tiles to be scaled:
//   y += scale * sums + zero * (the row's sum of x over the group). The integers cost a third of
//   the instructions of dequantised weights; the tiles' stores and the scaling cost per row.
// - More rows: the weights dequantised to bf16 ((q - 8) * scale + zero in fp32, rounded to bf16
//   once), whose fp32 sums stay in the tiles across every group.
// (AMX's int8 tiles, tried first, had to leave the tiles every 32 columns as well, where x's step
// changes besides the weights' scales: their store and fp32 work per row cost more than the
// products.) x is rounded to bf16 either way (a bf16 model's rows already are).
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
// The weights go into the tiles as integers for one tile of rows, up to INTEGER_ROWS_PER_STEP
// rows for each step of columns in a group: the scaling costs per row and per group, the integers
// per weight (one thread, 2048 x 2048: 0.23 ms against 0.29 at 8 rows in groups of 32, 0.29
// against 0.32 at 16 rows in groups of 64, 0.19 against 0.28 at 16 in groups of 128; level or
// slower past that, and at 17 rows and more)
constexpr int64_t INTEGER_ROWS_PER_STEP = 8;

bool takes_integers(int64_t rows, int group_size) {
  return rows <= TILE_ROWS && rows <= INTEGER_ROWS_PER_STEP * (group_size / STEP);
}
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
  // GCC 12's ldtilecfg builtin does not tell the optimiser it reads the configuration: without
  // this, inlined, the stores above were dropped as dead (a SIGILL at the first tile instruction)
  asm volatile("" : : "r"(&config) : "memory");
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

// Fetches the scales of the group SCALES_AHEAD after `group`: a group's scales lie a whole row of
// scales from the last's (another page each time), where the prefetchers do not follow.
ZEROLITE_AMX inline void scales_ahead(const Int4Weight& w, const Block& b, int64_t group) {
  if ((group + SCALES_AHEAD) * w.group_size >= w.stored_in) return;
  const char* ahead = reinterpret_cast<const char*>(w.scale_zero) +
                      ((group + SCALES_AHEAD) * w.out_features + b.row0) * 2 * (w.bf16_scales ? 2 : 4);
  for (int line = 0; line < (w.bf16_scales ? 4 : 8); ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
}

// The group's scales where column step `step` starts one, fetching a later group's ahead.
ZEROLITE_AMX inline void scales_at(const Int4Weight& w, const Block& b, int64_t step, __m512* scale, __m512* offset) {
  const int64_t steps_per_group = w.group_size / STEP;
  if (step % steps_per_group != 0) return;
  const int64_t group = step / steps_per_group;
  scales_ahead(w, b, group);
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

// The bf16 bits of q - 8 for each nibble q, twice over: vpermw reads an index's low 5 bits, and
// the byte a low nibble's index comes from leaves the high nibble's lowest bit in bit 4.
ZEROLITE_AMX inline __m512i integer_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = narrow_bf16(static_cast<float>(i % 16 - 8));
  return _mm512_load_si512(table);
}

// The 32 columns from k of block b as integers q - 8 into out, the B tiles' layout of
// dequantize_step: tile j's row p lane 2i + c is output 16j + i, column k + 2p + c. Outputs 0 to 15
// and 32 to 47 are the low and high nibbles of a column's bytes 0 to 15, 16 to 31 and 48 to 63 of
// its bytes 16 to 31: one byte permute per pair of tiles puts each byte in a 16-bit lane of its own.
ZEROLITE_AMX inline void integer_step(const Block& b, int64_t k, __m512i table, uint16_t* out) {
  constexpr __mmask64 LOW_BYTES = 0x5555555555555555ull;  // each 16-bit lane's first byte
  alignas(64) uint8_t order[64] = {};
  for (int i = 0; i < 16; ++i)
    for (int c = 0; c < 2; ++c) order[2 * (2 * i + c)] = static_cast<uint8_t>(32 * c + i);
  const __m512i first = _mm512_load_si512(order);                       // tiles 0 and 2
  const __m512i second = _mm512_add_epi8(first, _mm512_set1_epi8(16));  // tiles 1 and 3
  const uint8_t* columns = b.base + k * (BLOCK / 2);
#pragma GCC unroll 4
  for (int p = 0; p < STEP / 2; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(columns + 64 * p + PREFETCH_AHEAD), _MM_HINT_T0);
    const __m512i bytes = _mm512_loadu_si512(columns + 64 * p);
    const __m512i low = _mm512_maskz_permutexvar_epi8(LOW_BYTES, first, bytes);
    const __m512i high = _mm512_maskz_permutexvar_epi8(LOW_BYTES, second, bytes);
    uint16_t* row = out + p * 32;
    _mm512_store_si512(row, _mm512_permutexvar_epi16(low, table));
    _mm512_store_si512(row + STEP_WEIGHTS / 4, _mm512_permutexvar_epi16(high, table));
    _mm512_store_si512(row + STEP_WEIGHTS / 2, _mm512_permutexvar_epi16(_mm512_srli_epi16(low, 4), table));
    _mm512_store_si512(row + 3 * STEP_WEIGHTS / 4, _mm512_permutexvar_epi16(_mm512_srli_epi16(high, 4), table));
  }
}

// A group's scales and zeros for the block's outputs in order: register j outputs 16j to 16j + 15.
ZEROLITE_AMX inline void group_scales_in_order(const Int4Weight& w, const Block& b, int64_t group, __m512* scale,
                                               __m512* zero) {
  const int64_t first = group * w.out_features + b.row0;
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    if (w.bf16_scales) {
      // a row's scale and zero are one 32-bit word, the scale's bits in its low half
      const __m512i words = _mm512_loadu_si512(static_cast<const int32_t*>(w.scale_zero) + first + 16 * j);
      scale[j] = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
      zero[j] = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
    } else {
      const float* pairs = static_cast<const float*>(w.scale_zero) + 2 * (first + 16 * j);
      const __m512 a = _mm512_loadu_ps(pairs), c = _mm512_loadu_ps(pairs + 16);
      const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
      scale[j] = _mm512_permutex2var_ps(a, even, c);
      zero[j] = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), c);
    }
  }
}

// The tiles' sums as add_scaled reads them: tile j's rows of 16 outputs one after another.
ZEROLITE_AMX inline void store_products(float (*products)[TILE_ROWS][16]) {
  _tile_stored(0, products[0][0], 64);
  _tile_stored(1, products[1][0], 64);
  _tile_stored(2, products[2][0], 64);
  _tile_stored(3, products[3][0], 64);
}

// sum += each output's scale * the group's sums in the tiles (held in products: [tile][row][16])
// + its zero * the row's sum of x over the group.
ZEROLITE_AMX inline void add_scaled(float (*products)[TILE_ROWS][16], const __m512* scale, const __m512* zero,
                                    const float* x_sums, int64_t groups, int rows, float (*sum)[BLOCK]) {
  for (int m = 0; m < rows; ++m) {
    const __m512 x_sum = _mm512_set1_ps(x_sums[m * groups]);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      __m512 total = _mm512_fmadd_ps(zero[j], x_sum, _mm512_load_ps(sum[m] + 16 * j));
      _mm512_store_ps(sum[m] + 16 * j, _mm512_fmadd_ps(_mm512_load_ps(products[j][m]), scale[j], total));
    }
  }
}

// Sums of count rows of x (one tile of them) from m0 into sum, the weights as integers. Each
// step's integers are made while the tiles multiply the last step's (two buffers), and a group's
// sums, stored from the tiles, are scaled into sum only after the next group's products are under
// way (two buffers again): the tiles' stores have landed by then.
ZEROLITE_AMX void rows_integers(const Int4Weight& w, const Block& b, const AmxRows& x, int64_t m0, int count,
                                float (*sum)[BLOCK]) {
  const int64_t steps = (w.in_features + STEP - 1) / STEP;
  const int64_t steps_per_group = w.group_size / STEP;
  const __m512i table = integer_table();
  alignas(64) uint16_t weights[2][STEP_WEIGHTS];
  alignas(64) float products[2][4][TILE_ROWS][16];  // by the group's parity
  std::memset(sum, 0, sizeof(float) * BLOCK * count);
  const uint16_t* rows = x.x + m0 * x.stride;
  auto scale_group = [&](int64_t group) {
    __m512 scale[4], zero[4];
    scales_ahead(w, b, group);
    group_scales_in_order(w, b, group, scale, zero);
    add_scaled(products[group & 1], scale, zero, x.group_sums.data() + m0 * x.groups + group, x.groups, count, sum);
  };
  integer_step(b, 0, table, weights[0]);
  for (int64_t step = 0; step < steps; ++step) {
    if (step + 1 < steps) integer_step(b, (step + 1) * STEP, table, weights[(step + 1) & 1]);
    const int64_t group = step / steps_per_group;
    if (step % steps_per_group == 0) zero_sums();  // a group's sums stay in the tiles over its steps
    multiply_steps(rows + step * STEP, x.stride, weights[step & 1], 1);
    if ((step + 1) % steps_per_group != 0 && step + 1 != steps) continue;
    store_products(products[group & 1]);
    if (group > 0) scale_group(group - 1);
  }
  scale_group((steps - 1) / steps_per_group);
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

// A row's sums over each group of columns (its steps of 32 bf16 columns, zero past in_features),
// in fp32: vdpbf16ps by ones adds each pair of columns.
ZEROLITE_AVX512BF16 void group_sums(const uint16_t* x, int64_t columns, int64_t group_size, float* sums) {
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
  for (int64_t k0 = 0, g = 0; k0 < columns; k0 += group_size, ++g) {
    __m512 total = _mm512_setzero_ps();
    for (int64_t k = k0; k < std::min(k0 + group_size, columns); k += STEP)
      total = _mm512_dpbf16_ps(total, (__m512bh)_mm512_loadu_si512(x + k), ones);
    sums[g] = _mm512_reduce_add_ps(total);
  }
}

ZEROLITE_AVX512BF16 void narrow_row(const float* x, int64_t in_features, uint16_t* out) {
  for (int64_t k = 0; k < in_features; k += 16) {
    const __mmask16 mask = tail_mask<__mmask16>(in_features - k);
    _mm256_mask_storeu_epi16(out + k, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + k)));
  }
}

}  // namespace

AmxRows amx_rows(const Rows& r, const Int4Weight& w) {
  const int64_t in_features = w.in_features;
  const int64_t stride = (in_features + STEP - 1) / STEP * STEP;
  const bool whole_tiles = r.count < TILE_ROWS || r.count % TILE_ROWS == 0;
  AmxRows rows{r.x_bf16, r.count, r.x_stride, {}, {}, 0};
  if (!(r.x_bf16 && stride == in_features && whole_tiles)) {
    const int64_t count = whole_tiles ? r.count : (r.count + TILE_ROWS - 1) / TILE_ROWS * TILE_ROWS;
    rows.stride = stride;
    rows.copy.assign(count * stride, 0);
    for (int64_t m = 0; m < r.count; ++m) {
      if (r.x_bf16) std::memcpy(rows.copy.data() + m * stride, r.x_bf16 + m * r.x_stride, in_features * 2);
      else narrow_row(r.x + m * r.x_stride, in_features, rows.copy.data() + m * stride);
    }
    rows.x = rows.copy.data();
  }
  if (takes_integers(r.count, w.group_size)) {
    rows.groups = (in_features + w.group_size - 1) / w.group_size;
    rows.group_sums.resize(r.count * rows.groups);
    for (int64_t m = 0; m < r.count; ++m) group_sums(rows.x + m * rows.stride, stride, w.group_size,
                                                     rows.group_sums.data() + m * rows.groups);
  }
  return rows;
}

// The tile configuration is each thread's own: set for each block, and released after it (a
// thread holding tiles has their 8 KB saved at every switch of context).
ZEROLITE_AMX void block_amx(const Int4Weight& w, const Block& b, const AmxRows& x, const Rows& r) {
  alignas(64) float sum[ROW_CHUNK][BLOCK];
  configure_tiles(static_cast<int>(std::min<int64_t>(TILE_ROWS, x.count)));
  for (int64_t m0 = 0; m0 < x.count; m0 += ROW_CHUNK) {
    const int64_t count = std::min(ROW_CHUNK, x.count - m0);
    if (takes_integers(x.count, w.group_size)) rows_integers(w, b, x, m0, static_cast<int>(count), sum);
    else rows_amx(w, b, x, m0, count, sum);
    write_rows(b, sum, m0, count, r);
  }
  _tile_release();
}

}  // namespace zerolite
#endif
