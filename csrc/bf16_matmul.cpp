// bf16 matmul for a few rows (a decode step): y[m, n] = x[m, :] . W[n, :], W bf16 [out, in]
// row-major as a layer holds it, x and y bf16. Memory-bound: each weight row is read once for the
// rows of x of a tile, in runs of four weight rows (four streams the prefetchers follow); fp32
// sums, rounded to bf16 at the end (to nearest even, as torch rounds). The work is split by runs
// of output rows.
#include <algorithm>

#include "bf16_bits.h"
#include "cpu_matmul.h"
#include "work_pool.h"

#ifdef ZEROLITE_X86
#include <immintrin.h>
#endif

namespace zerolite {

namespace {

constexpr int64_t TASK_ROWS = 64;  // output rows a task takes: enough tasks to balance the threads

void rows_scalar(const Bf16Weight& w, const Bf16Rows& r, int64_t first, int64_t last) {
  for (int64_t m = 0; m < r.count; ++m) {
    const uint16_t* x = r.x + m * r.x_stride;
    for (int64_t n = first; n < last; ++n) {
      const uint16_t* row = w.w + n * w.in_features;
      float sum = 0.0f;
      for (int64_t k = 0; k < w.in_features; ++k) sum += widen_bf16(row[k]) * widen_bf16(x[k]);
      r.y[m * r.y_stride + n] = narrow_bf16(sum);
    }
  }
}

#ifdef ZEROLITE_X86

// A tile of N weight rows by M rows of x; STEP columns a step, the last one masked. dpbf16 takes
// 32 columns (pairs of bf16 into each fp32 lane), the fp32 paths 16 (AVX-512) or 8 (AVX2).
template <int N, int M>
ZEROLITE_AVX512BF16 void tile_bf16(const Bf16Weight& w, const Bf16Rows& r, int64_t m0, int64_t n0, bool ahead) {
  __m512 acc[M][N];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) acc[m][n] = _mm512_setzero_ps();
  const int64_t in = w.in_features;
  for (int64_t k = 0; k < in; k += 32) {
    __mmask32 mask = tail_mask<__mmask32>(in - k);
    __m512bh xs[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) xs[m] = (__m512bh)_mm512_maskz_loadu_epi16(mask, r.x + (m0 + m) * r.x_stride + k);
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      __m512bh row = (__m512bh)_mm512_maskz_loadu_epi16(mask, w.w + (n0 + n) * in + k);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], row, xs[m]);
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w.w + (n0 + N + n) * in + k), _MM_HINT_T0);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) r.y[(m0 + m) * r.y_stride + n0 + n] = narrow_bf16(_mm512_reduce_add_ps(acc[m][n]));
}

ZEROLITE_AVX512 inline __m512 widen_avx512(__mmask16 mask, const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

template <int N, int M>
ZEROLITE_AVX512 void tile_avx512(const Bf16Weight& w, const Bf16Rows& r, int64_t m0, int64_t n0) {
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
    for (int m = 0; m < M; ++m) xs[m] = widen_avx512(mask, r.x + (m0 + m) * r.x_stride + k);
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      __m512 row = widen_avx512(mask, w.w + (n0 + n) * in + k);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[m][n] = _mm512_fmadd_ps(row, xs[m], acc[m][n]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) r.y[(m0 + m) * r.y_stride + n0 + n] = narrow_bf16(_mm512_reduce_add_ps(acc[m][n]));
}

ZEROLITE_AVX2 inline __m256 widen_avx2(const uint16_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

ZEROLITE_AVX2 inline float sum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// AVX2 has no masked 16-bit loads: whole runs of 8 columns in vectors, the rest one by one.
template <int N, int M>
ZEROLITE_AVX2 void tile_avx2(const Bf16Weight& w, const Bf16Rows& r, int64_t m0, int64_t n0) {
  __m256 acc[M][N];
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) acc[m][n] = _mm256_setzero_ps();
  const int64_t in = w.in_features, whole = in / 8 * 8;
  for (int64_t k = 0; k < whole; k += 8) {
    __m256 xs[M];
#pragma GCC unroll 16
    for (int m = 0; m < M; ++m) xs[m] = widen_avx2(r.x + (m0 + m) * r.x_stride + k);
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      __m256 row = widen_avx2(w.w + (n0 + n) * in + k);
#pragma GCC unroll 16
      for (int m = 0; m < M; ++m) acc[m][n] = _mm256_fmadd_ps(row, xs[m], acc[m][n]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < M; ++m) {
    const uint16_t* x = r.x + (m0 + m) * r.x_stride;
#pragma GCC unroll 16
    for (int n = 0; n < N; ++n) {
      const uint16_t* row = w.w + (n0 + n) * in;
      float sum = sum_avx2(acc[m][n]);
      for (int64_t k = whole; k < in; ++k) sum += widen_bf16(row[k]) * widen_bf16(x[k]);
      r.y[(m0 + m) * r.y_stride + n0 + n] = narrow_bf16(sum);
    }
  }
}

// The rows of x in tiles of up to 4, for N weight rows at n0; ahead: the N rows after them are
// the task's too (the first tile fetches them into the cache as it goes).
template <int N, template <int, int> class Tile>
void rows_of_x(const Bf16Weight& w, const Bf16Rows& r, int64_t n0, bool ahead) {
  int64_t m = 0;
  for (; m + 4 <= r.count; m += 4, ahead = false) Tile<N, 4>::run(w, r, m, n0, ahead);
  switch (r.count - m) {
    case 3: Tile<N, 3>::run(w, r, m, n0, ahead); break;
    case 2: Tile<N, 2>::run(w, r, m, n0, ahead); break;
    case 1: Tile<N, 1>::run(w, r, m, n0, ahead); break;
    default: break;
  }
}

template <int N, int M> struct Bf16Tile { static void run(const Bf16Weight& w, const Bf16Rows& r, int64_t m, int64_t n, bool ahead) { tile_bf16<N, M>(w, r, m, n, ahead); } };
template <int N, int M> struct Avx512Tile { static void run(const Bf16Weight& w, const Bf16Rows& r, int64_t m, int64_t n, bool) { tile_avx512<N, M>(w, r, m, n); } };
template <int N, int M> struct Avx2Tile { static void run(const Bf16Weight& w, const Bf16Rows& r, int64_t m, int64_t n, bool) { tile_avx2<N, M>(w, r, m, n); } };

template <template <int, int> class Tile>
void rows_tiled(const Bf16Weight& w, const Bf16Rows& r, int64_t first, int64_t last) {
  int64_t n = first;
  for (; n + 4 <= last; n += 4) rows_of_x<4, Tile>(w, r, n, n + 8 <= last);
  for (; n < last; ++n) rows_of_x<1, Tile>(w, r, n, false);
}

#endif  // ZEROLITE_X86

}  // namespace

void bf16_matmul(const Bf16Weight& w, const Bf16Rows& r, CpuPath path, int threads) {
  void (*rows)(const Bf16Weight&, const Bf16Rows&, int64_t, int64_t) = rows_scalar;
#ifdef ZEROLITE_X86
  if (path >= CpuPath::avx512bf16) rows = rows_tiled<Bf16Tile>;
  else if (path >= CpuPath::avx512) rows = rows_tiled<Avx512Tile>;
  else if (path >= CpuPath::avx2) rows = rows_tiled<Avx2Tile>;
#endif
  int64_t tasks = (w.out_features + TASK_ROWS - 1) / TASK_ROWS;
  kernel_pool().run(threads, tasks, [&](int64_t task) {
    rows(w, r, task * TASK_ROWS, std::min(w.out_features, (task + 1) * TASK_ROWS));
  });
}

}  // namespace zerolite
