// int8 weight-only matmul: each output is a dot product along a stored row, widened to fp32 16
// (AVX-512) or 8 (AVX2) columns at a time; a tile of 4 weight rows by up to 4 rows of x shares
// every load. avx512vnni and avx2int8 instead round x to int8 per 32 columns (as llama.cpp's Q8_0
// does) and multiply bytes (avx512vnni: 8 weight rows a tile for a single row of x). The work is
// split by runs of output rows.
#include <algorithm>
#include <cstring>
#include <vector>

#include "bf16_bits.h"
#include "cpu_matmul.h"
#include "work_pool.h"
#include "x_blocks.h"

#ifdef ZEROLITE_X86
#include <immintrin.h>
#endif

namespace zerolite {

namespace {

constexpr int64_t TASK_ROWS = 32;  // output rows a task takes: enough tasks to balance the threads

void rows_scalar(const Int8Weight& w, const Rows& r, int64_t first, int64_t last) {
  for (int64_t m = 0; m < r.count; ++m) {
    const float* x = r.x + m * r.x_stride;
    for (int64_t n = first; n < last; ++n) {
      const int8_t* q = w.q + n * w.in_features;
      float sum = 0.0f;
      for (int64_t k = 0; k < w.in_features; ++k) sum += static_cast<float>(q[k]) * x[k];
      r.y[m * r.y_stride + n] = sum * w.scale[n];
    }
  }
}

#ifdef ZEROLITE_X86

template <int N, int M>
ZEROLITE_AVX512 void tile_avx512(const Int8Weight& w, const float* x, int64_t x_stride, float* y, int64_t y_stride,
                                 int64_t n0) {
  __m512 acc[M][N];
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
    #pragma GCC unroll 16
    for (int n = 0; n < N; ++n) acc[m][n] = _mm512_setzero_ps();
  const int64_t in = w.in_features;
  for (int64_t k = 0; k < in; k += 16) {
    __mmask16 mask = tail_mask<__mmask16>(in - k);
    __m512 xs[M];
    #pragma GCC unroll 16
    for (int m = 0; m < M; ++m) xs[m] = _mm512_maskz_loadu_ps(mask, x + m * x_stride + k);
    #pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      __m128i raw = _mm_maskz_loadu_epi8(mask, w.q + (n0 + n) * in + k);
      __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
      #pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[m][n] = _mm512_fmadd_ps(q, xs[m], acc[m][n]);
    }
  }
  #pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
    #pragma GCC unroll 16
    for (int n = 0; n < N; ++n) y[m * y_stride + n0 + n] = _mm512_reduce_add_ps(acc[m][n]) * w.scale[n0 + n];
}

template <int N>
ZEROLITE_AVX512 void rows_of_x_avx512(const Int8Weight& w, const Rows& r, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= r.count; m += 4) tile_avx512<N, 4>(w, r.x + m * r.x_stride, r.x_stride, r.y + m * r.y_stride, r.y_stride, n0);
  const float* x = r.x + m * r.x_stride;
  float* y = r.y + m * r.y_stride;
  switch (r.count - m) {
    case 3: tile_avx512<N, 3>(w, x, r.x_stride, y, r.y_stride, n0); break;
    case 2: tile_avx512<N, 2>(w, x, r.x_stride, y, r.y_stride, n0); break;
    case 1: tile_avx512<N, 1>(w, x, r.x_stride, y, r.y_stride, n0); break;
    default: break;
  }
}

void rows_avx512(const Int8Weight& w, const Rows& r, int64_t first, int64_t last) {
  int64_t n = first;
  for (; n + 4 <= last; n += 4) rows_of_x_avx512<4>(w, r, n);
  for (; n < last; ++n) rows_of_x_avx512<1>(w, r, n);
}

ZEROLITE_AVX2 inline float sum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int N>
ZEROLITE_AVX2 void rows_of_x_avx2(const Int8Weight& w, const Rows& r, int64_t n0) {
  const int64_t in = w.in_features, whole = in / 8 * 8;
  for (int64_t m = 0; m < r.count; ++m) {
    const float* x = r.x + m * r.x_stride;
    __m256 acc[N];
    #pragma GCC unroll 16
    for (int n = 0; n < N; ++n) acc[n] = _mm256_setzero_ps();
    for (int64_t k = 0; k < whole; k += 8) {
      __m256 xs = _mm256_loadu_ps(x + k);
      #pragma GCC unroll 16
      for (int n = 0; n < N; ++n) {
        __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.q + (n0 + n) * in + k));
        acc[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), xs, acc[n]);
      }
    }
    #pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      const int8_t* q = w.q + (n0 + n) * in;
      float sum = sum_avx2(acc[n]);
      for (int64_t k = whole; k < in; ++k) sum += static_cast<float>(q[k]) * x[k];
      r.y[m * r.y_stride + n0 + n] = sum * w.scale[n0 + n];
    }
  }
}

void rows_avx2(const Int8Weight& w, const Rows& r, int64_t first, int64_t last) {
  int64_t n = first;
  for (; n + 4 <= last; n += 4) rows_of_x_avx2<4>(w, r, n);
  for (; n < last; ++n) rows_of_x_avx2<1>(w, r, n);
}

// avx512vnni: vpdpbusd multiplies unsigned bytes by signed ones, so the weights go in as w + 128
// (one xor) and x's int8 as the signed side: a lane's sum is q.w + 128 * (the sum of its four q),
// and the 128 * sum(q) of a whole row, times each block's step, is taken off once at the end.
// 64 columns a step (two blocks of x: lanes 0-7 the first's, 8-15 the second's, each lane scaled
// by its block's step), the last one masked; x's padding to 64 columns is zero.
constexpr int STEP = 64;

// x's blocks (XBlocks, padded to whole steps), and for each row 128 * the sum over its blocks of
// step * sum(q): what the weights' + 128 added to its sums.
struct QuantizedRows {
  XBlocks blocks;
  std::vector<float> offset;  // [rows]
};

QuantizedRows quantize_rows(const Rows& r, int64_t in, CpuPath path) {
  QuantizedRows out{x_blocks(r, in, (in + STEP - 1) / STEP * STEP, path), std::vector<float>(r.count)};
  const XBlocks& xb = out.blocks;
  for (int64_t m = 0; m < r.count; ++m) {
    double offset = 0.0;
    for (int64_t b = 0; b < xb.blocks; ++b) offset += 128.0 * xb.step[m * xb.blocks + b] * xb.q_sum[m * xb.blocks + b];
    out.offset[m] = static_cast<float>(offset);
  }
  return out;
}

template <int N, int M>
ZEROLITE_AVX512VNNI void tile_vnni(const Int8Weight& w, const QuantizedRows& xq, const Rows& r, int64_t m0,
                                   int64_t n0) {
  __m512 acc[M][N];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) acc[m][n] = _mm512_setzero_ps();
  const int64_t in = w.in_features;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t k = 0, s = 0; k < in; k += STEP, ++s) {
    const __mmask64 mask = tail_mask<__mmask64>(in - k);  // STEP is 64 columns
    __m512i xs[M];
    __m512 steps[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const XBlocks& xb = xq.blocks;
      xs[m] = _mm512_loadu_si512(xb.q.data() + (m0 + m) * xb.padded + k);
      // lanes 0-7 the step's first block's, 8-15 its second's
      const float* two = xb.step.data() + (m0 + m) * xb.blocks + 2 * s;
      steps[m] = _mm512_insertf32x8(_mm512_set1_ps(two[0]), _mm256_set1_ps(two[1]), 1);
    }
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      __m512i row = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w.q + (n0 + n) * in + k), flip);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) {
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), row, xs[m]);
        acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), steps[m], acc[m][n]);
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      store_output(r, m0 + m, n0 + n, (_mm512_reduce_add_ps(acc[m][n]) - xq.offset[m0 + m]) * w.scale[n0 + n]);
    }
}

template <int N>
void rows_of_x_vnni(const Int8Weight& w, const QuantizedRows& xq, const Rows& r, int64_t n0) {
  int64_t m = 0;
  for (; m + 4 <= r.count; m += 4) tile_vnni<N, 4>(w, xq, r, m, n0);
  switch (r.count - m) {
    case 3: tile_vnni<N, 3>(w, xq, r, m, n0); break;
    case 2: tile_vnni<N, 2>(w, xq, r, m, n0); break;
    case 1: tile_vnni<N, 1>(w, xq, r, m, n0); break;
    default: break;
  }
}

void rows_vnni(const Int8Weight& w, const QuantizedRows& xq, const Rows& r, int64_t first, int64_t last) {
  int64_t n = first;
  // One row of x (a batch-1 decode step): runs of 8 weight rows, each load of x and of its steps
  // shared by twice the dot products (1.1-1.3x the runs of 4 at one thread, weights cold). More
  // rows of x would want more accumulators than the 32 vector registers hold.
  if (r.count == 1)
    for (; n + 8 <= last; n += 8) tile_vnni<8, 1>(w, xq, r, 0, n);
  for (; n + 4 <= last; n += 4) rows_of_x_vnni<4>(w, xq, r, n);
  for (; n < last; ++n) rows_of_x_vnni<1>(w, xq, r, n);
}

// avx2int8: the same rounding of x, 32 columns (one block) a step. vpmaddubsw multiplies unsigned
// bytes by signed ones, as llama.cpp's AVX2 Q8_0 does: |w| by x with w's sign (vpsignb), pairs
// summed to int16 (at most 2 x 128 x 127: no saturation), then to int32 by vpmaddwd. The rows'
// last partial step is copied into zeroed bytes (AVX2 has no masked byte loads); x's padding is zero.
template <int N, int M>
ZEROLITE_AVX2 void tile_avx2int8(const Int8Weight& w, const XBlocks& xb, const Rows& r, int64_t m0, int64_t n0) {
  __m256 acc[M][N];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t in = w.in_features;
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) int8_t last[N][X_BLOCK];
  for (int64_t k = 0, b = 0; k < in; k += X_BLOCK, ++b) {
    __m256i rows[N];
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      const int8_t* q = w.q + (n0 + n) * in + k;
      if (in - k < X_BLOCK) {
        std::memset(last[n], 0, X_BLOCK);
        std::memcpy(last[n], q, in - k);
        q = last[n];
      }
      rows[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) {
      const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.q.data() + (m0 + m) * xb.padded + k));
      const __m256 step = _mm256_set1_ps(xb.step[(m0 + m) * xb.blocks + b]);
#pragma GCC unroll 16
      for (int n = 0; n < N; ++n) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(rows[n], rows[n]), _mm256_sign_epi8(xs, rows[n]));
        acc[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)), step, acc[m][n]);
      }
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      store_output(r, m0 + m, n0 + n, sum_avx2(acc[m][n]) * w.scale[n0 + n]);
    }
}

template <int N>
void rows_of_x_avx2int8(const Int8Weight& w, const XBlocks& xb, const Rows& r, int64_t n0) {
  int64_t m = 0;
  for (; m + 2 <= r.count; m += 2) tile_avx2int8<N, 2>(w, xb, r, m, n0);
  if (m < r.count) tile_avx2int8<N, 1>(w, xb, r, m, n0);
}

void rows_avx2int8(const Int8Weight& w, const XBlocks& xb, const Rows& r, int64_t first, int64_t last) {
  int64_t n = first;
  for (; n + 4 <= last; n += 4) rows_of_x_avx2int8<4>(w, xb, r, n);
  for (; n < last; ++n) rows_of_x_avx2int8<1>(w, xb, r, n);
}

#endif  // ZEROLITE_X86

}  // namespace

void int8_matmul(const Int8Weight& w, const Rows& r, CpuPath path, int threads) {
  int64_t tasks = (w.out_features + TASK_ROWS - 1) / TASK_ROWS;
  void (*rows)(const Int8Weight&, const Rows&, int64_t, int64_t) = rows_scalar;
#ifdef ZEROLITE_X86
  // bf16 rows as they are on the paths that round them to int8 only
  if (r.x_bf16 && path < CpuPath::avx512vnni && path != CpuPath::avx2int8) {
#else
  if (r.x_bf16) {
#endif
    through_fp32(r, w.in_features, w.out_features, [&](const Rows& fp32) { int8_matmul(w, fp32, path, threads); });
    return;
  }
#ifdef ZEROLITE_X86
  if (path == CpuPath::avx2int8) {
    const XBlocks xb = x_blocks(r, w.in_features, (w.in_features + X_BLOCK - 1) / X_BLOCK * X_BLOCK, path);
    kernel_pool().run(threads, tasks, [&](int64_t task) {
      rows_avx2int8(w, xb, r, task * TASK_ROWS, std::min(w.out_features, (task + 1) * TASK_ROWS));
    });
    return;
  }
  if (path >= CpuPath::avx512vnni) {
    const QuantizedRows xq = quantize_rows(r, w.in_features, path);
    kernel_pool().run(threads, tasks, [&](int64_t task) {
      rows_vnni(w, xq, r, task * TASK_ROWS, std::min(w.out_features, (task + 1) * TASK_ROWS));
    });
    return;
  }
  if (path >= CpuPath::avx512) rows = rows_avx512;
  if (path == CpuPath::avx2) rows = rows_avx2;  // (avx2int8 returned above)
#endif
  kernel_pool().run(threads, tasks, [&](int64_t task) {
    rows(w, r, task * TASK_ROWS, std::min(w.out_features, (task + 1) * TASK_ROWS));
  });
}

}  // namespace zerolite
