// int8 weight-only matmul: each output is a dot product along a stored row, widened to fp32 16
// (AVX-512) or 8 (AVX2) columns at a time; a tile of 4 weight rows by up to 4 rows of x shares
// every load. The work is split by runs of output rows.
#include <algorithm>

#include "cpu_matmul.h"
#include "work_pool.h"

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
    __mmask16 mask = in - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (in - k)) - 1);
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

#endif  // ZEROLITE_X86

}  // namespace

void int8_matmul(const Int8Weight& w, const Rows& r, CpuPath path, int threads) {
  void (*rows)(const Int8Weight&, const Rows&, int64_t, int64_t) = rows_scalar;
#ifdef ZEROLITE_X86
  if (path == CpuPath::avx512 || path == CpuPath::avx512vnni) rows = rows_avx512;
  if (path == CpuPath::avx2) rows = rows_avx2;
#endif
  int64_t tasks = (w.out_features + TASK_ROWS - 1) / TASK_ROWS;
  kernel_pool().run(threads, tasks, [&](int64_t task) {
    rows(w, r, task * TASK_ROWS, std::min(w.out_features, (task + 1) * TASK_ROWS));
  });
}

}  // namespace zerolite
