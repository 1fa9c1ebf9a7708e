// K/V rows decoded in one pass (kv_decode.h). Built with -ffp-contract=off (CMakeLists.txt): torch
// rounds fp32's product before it adds the zero, and a fused multiply-add would round once.
#include "kv_decode.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16_bits.h"
#include "work_pool.h"

namespace zerolite {

namespace {

// Everything a task runs is inlined into one function compiled for its path's instruction set
// (flatten; the vector helpers always_inline), whatever GCC's heuristics say: called per row, the
// pieces kept their vectors on the stack across calls and went back and forth between AVX and SSE
// code, 3x slower.
#define ZEROLITE_KV_INLINE __attribute__((always_inline)) inline
#define ZEROLITE_KV_TASK __attribute__((flatten))

// A task's rows: enough that handing tasks to the pool's threads costs little beside them.
constexpr int64_t ROWS_PER_TASK = 256;
// Room past a row's codes in the buffer 4-bit codes are spread into: the paths write whole vectors.
constexpr int64_t CODES_SLACK = 128;

// fp16 <-> fp32 as IEEE rounds them (to nearest even, subnormals kept, overflow to infinity), as
// torch's Half does and F16C's conversions do: FP16's fp16_ieee_to_fp32_value and _from_fp32_value.
inline float widen_fp16(uint16_t half) {
  const uint32_t w = static_cast<uint32_t>(half) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
  return float_of(sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized)));
}

inline uint16_t narrow_fp16(float value) {
  float base = (std::fabs(value) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = bits_of(value), shl1_w = w + w, sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  base = float_of((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = bits_of(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// The states' element type in memory and its conversions from and to fp32.
template <KvFloat F>
struct Element;

template <>
struct Element<KvFloat::bf16> {
  using type = uint16_t;
  static float widen(uint16_t v) { return widen_bf16(v); }
  static uint16_t narrow(float v) { return narrow_bf16(v); }
};

template <>
struct Element<KvFloat::fp16> {
  using type = uint16_t;
  static float widen(uint16_t v) { return widen_fp16(v); }
  static uint16_t narrow(float v) { return narrow_fp16(v); }
};

template <>
struct Element<KvFloat::fp32> {
  using type = float;
  static float widen(float v) { return v; }
  static float narrow(float v) { return v; }
};

template <KvFloat F>
using Stored = typename Element<F>::type;

// Element i of dtype F at an address that need not be aligned.
template <KvFloat F>
inline float load_element(const uint8_t* at, int64_t i) {
  Stored<F> v;
  std::memcpy(&v, at + i * sizeof(v), sizeof(v));
  return Element<F>::widen(v);
}

// The scaling every path shares, for n channels: x = code * scale, rounded to F; with Zero,
// then x + zero, rounded again. Signed: int8 codes, else 4-bit ones spread a byte each.
// PerChannel: a scale (and zero) a channel, else one for all n.
template <KvFloat F, bool Signed, bool Zero, bool PerChannel>
inline void scale_scalar(const uint8_t* codes, int64_t n, const float* scale, const float* zero, Stored<F>* out) {
  for (int64_t c = 0; c < n; ++c) {
    const float q = Signed ? static_cast<float>(static_cast<int8_t>(codes[c])) : static_cast<float>(codes[c]);
    float v = q * scale[PerChannel ? c : 0];
    if constexpr (Zero) v = Element<F>::widen(Element<F>::narrow(v)) + zero[PerChannel ? c : 0];
    out[c] = Element<F>::narrow(v);
  }
}

inline void expand_scalar(const uint8_t* packed, int64_t from_byte, int64_t bytes, uint8_t* codes) {
  for (int64_t b = from_byte; b < bytes; ++b) {
    codes[2 * b] = packed[b] & 15;
    codes[2 * b + 1] = packed[b] >> 4;
  }
}

struct Scalar {
  // A row's 4-bit codes (width of them) spread a byte each into codes.
  static void expand(const uint8_t* packed, int64_t width, uint8_t* codes) {
    expand_scalar(packed, 0, (width + 1) / 2, codes);
  }

  template <KvFloat F, bool Signed, bool Zero, bool PerChannel>
  static void scale(const uint8_t* codes, int64_t n, const float* scale, const float* zero, Stored<F>* out) {
    scale_scalar<F, Signed, Zero, PerChannel>(codes, n, scale, zero, out);
  }
};

#ifdef ZEROLITE_X86

#define ZEROLITE_KV_AVX2 __attribute__((target("avx2,fma,f16c")))
constexpr int HALF_ROUNDING = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

struct Avx2 {
  ZEROLITE_KV_AVX2 static void expand(const uint8_t* packed, int64_t width, uint8_t* codes) {
    const int64_t bytes = (width + 1) / 2;
    const __m256i low = _mm256_set1_epi16(0x000F), high = _mm256_set1_epi16(0x0F00);
    int64_t b = 0;
    for (; b + 16 <= bytes; b += 16) {
      // each byte widened to 16 bits, its low nibble kept below, its high one moved to the upper byte
      __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + b)));
      __m256i pairs = _mm256_or_si256(_mm256_and_si256(x, low), _mm256_and_si256(_mm256_slli_epi16(x, 4), high));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + 2 * b), pairs);
    }
    expand_scalar(packed, b, bytes, codes);
  }

  template <KvFloat F>
  ZEROLITE_KV_AVX2 ZEROLITE_KV_INLINE static __m256 rounded(__m256 v) {
    if constexpr (F == KvFloat::bf16) {
      Words8 words = reinterpret_cast<Words8>(v);
      round_to_bf16(words);
      return reinterpret_cast<__m256>(words & 0xFFFF0000u);
    } else if constexpr (F == KvFloat::fp16) {
      return _mm256_cvtph_ps(_mm256_cvtps_ph(v, HALF_ROUNDING));
    } else {
      return v;
    }
  }

  template <KvFloat F>
  ZEROLITE_KV_AVX2 ZEROLITE_KV_INLINE static void store(Stored<F>* out, __m256 v) {
    if constexpr (F == KvFloat::bf16) {
      Words8 words = reinterpret_cast<Words8>(v);
      round_to_bf16(words);
      __m256i top = reinterpret_cast<__m256i>(words >> 16);
      __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
    } else if constexpr (F == KvFloat::fp16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_cvtps_ph(v, HALF_ROUNDING));
    } else {
      _mm256_storeu_ps(out, v);
    }
  }

  template <KvFloat F, bool Signed, bool Zero, bool PerChannel>
  ZEROLITE_KV_AVX2 static void scale(const uint8_t* codes, int64_t n, const float* scale, const float* zero,
                                     Stored<F>* out) {
    __m256 s = _mm256_set1_ps(scale[0]), z = _mm256_setzero_ps();
    if constexpr (Zero && !PerChannel) z = _mm256_set1_ps(zero[0]);
    int64_t c = 0;
    for (; c + 8 <= n; c += 8) {
      __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c));
      __m256 v = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
      if constexpr (PerChannel) {
        s = _mm256_loadu_ps(scale + c);
        if constexpr (Zero) z = _mm256_loadu_ps(zero + c);
      }
      v = _mm256_mul_ps(v, s);
      if constexpr (Zero) v = _mm256_add_ps(rounded<F>(v), z);
      store<F>(out + c, v);
    }
    scale_scalar<F, Signed, Zero, PerChannel>(codes + c, n - c, PerChannel ? scale + c : scale,
                                              PerChannel && Zero ? zero + c : zero, out + c);
  }
};

struct Avx512 {
  ZEROLITE_AVX512 static void expand(const uint8_t* packed, int64_t width, uint8_t* codes) {
    const int64_t bytes = (width + 1) / 2;
    const __m512i low = _mm512_set1_epi16(0x000F), high = _mm512_set1_epi16(0x0F00);
    for (int64_t b = 0; b < bytes; b += 32) {
      const int64_t left = bytes - b;
      const __mmask32 mask = left >= 32 ? ~0u : (1u << left) - 1;
      __m256i in = _mm256_maskz_loadu_epi8(mask, packed + b);
      __m512i x = _mm512_cvtepu8_epi16(in);
      __m512i pairs = _mm512_or_si512(_mm512_and_si512(x, low), _mm512_and_si512(_mm512_slli_epi16(x, 4), high));
      _mm512_storeu_si512(codes + 2 * b, pairs);  // whole vectors: the buffer has CODES_SLACK past the row
    }
  }

  // The lanes of the last `left` channels, all 16 before them (a masked load reads nothing past them).
  ZEROLITE_AVX512 ZEROLITE_KV_INLINE static __mmask16 lanes(int64_t left) {
    return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  }

  template <KvFloat F>
  ZEROLITE_AVX512 ZEROLITE_KV_INLINE static __m512 rounded(__m512 v) {
    if constexpr (F == KvFloat::bf16) {
      Words16 words = reinterpret_cast<Words16>(v);
      round_to_bf16(words);
      return reinterpret_cast<__m512>(words & 0xFFFF0000u);
    } else if constexpr (F == KvFloat::fp16) {
      return _mm512_cvtph_ps(_mm512_cvtps_ph(v, HALF_ROUNDING));
    } else {
      return v;
    }
  }

  template <KvFloat F>
  ZEROLITE_AVX512 ZEROLITE_KV_INLINE static void store(Stored<F>* out, __m512 v, __mmask16 mask) {
    if constexpr (F == KvFloat::bf16) {
      _mm256_mask_storeu_epi16(out, mask, narrow_bf16_avx512(v));
    } else if constexpr (F == KvFloat::fp16) {
      _mm256_mask_storeu_epi16(out, mask, _mm512_cvtps_ph(v, HALF_ROUNDING));
    } else {
      _mm512_mask_storeu_ps(out, mask, v);
    }
  }

  template <KvFloat F, bool Signed, bool Zero, bool PerChannel>
  ZEROLITE_AVX512 static void scale(const uint8_t* codes, int64_t n, const float* scale, const float* zero,
                                    Stored<F>* out) {
    __m512 s = _mm512_set1_ps(scale[0]), z = _mm512_setzero_ps();
    if constexpr (Zero && !PerChannel) z = _mm512_set1_ps(zero[0]);
    for (int64_t c = 0; c < n; c += 16) {
      const __mmask16 mask = lanes(n - c);  // a group's or a row's last channels
      __m128i bytes = _mm_maskz_loadu_epi8(mask, codes + c);
      __m512 v = _mm512_cvtepi32_ps(Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes));
      if constexpr (PerChannel) {
        s = _mm512_maskz_loadu_ps(mask, scale + c);
        if constexpr (Zero) z = _mm512_maskz_loadu_ps(mask, zero + c);
      }
      v = _mm512_mul_ps(v, s);
      if constexpr (Zero) v = _mm512_add_ps(rounded<F>(v), z);
      store<F>(out + c, v, mask);
    }
  }
};

#endif  // ZEROLITE_X86

// Rows [first, last) of one outer index, each token quantized on its own (int8, int4).
template <class Isa, KvFloat F, KvCodes C>
void token_rows(const KvFormat& f, const KvRows& r, int64_t outer, int64_t first, int64_t last, uint8_t* spread) {
  constexpr bool int4 = C == KvCodes::int4;
  const int64_t groups = f.width / f.group, scale_bytes = groups * static_cast<int64_t>(sizeof(Stored<F>));
  for (int64_t t = first; t < last; ++t) {
    const uint8_t* row = r.packed + outer * r.packed_outer_stride + t * r.packed_token_stride;
    Stored<F>* out = static_cast<Stored<F>*>(r.out) + outer * r.out_outer_stride + t * r.out_token_stride;
    const uint8_t* codes = row + scale_bytes * (int4 ? 2 : 1);
    if constexpr (int4) {
      Isa::expand(codes, f.width, spread);
      codes = spread;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float scale = load_element<F>(row, g), zero = int4 ? load_element<F>(row + scale_bytes, g) : 0.0f;
      Isa::template scale<F, !int4, int4, false>(codes + g * f.group, f.group, &scale, &zero, out + g * f.group);
    }
  }
}

// One group of f.tokens rows (int4_key_groups) from token `first`: its scales and zeros gathered
// from the rows' shares first, then each row.
template <class Isa, KvFloat F>
void key_group(const KvFormat& f, const KvRows& r, int64_t outer, int64_t first, uint8_t* spread, float* scale) {
  const uint8_t* rows = r.packed + outer * r.packed_outer_stride + first * r.packed_token_stride;
  const int64_t share = f.share_bytes / static_cast<int64_t>(sizeof(Stored<F>));
  for (int64_t i = 0; i < 2 * f.width; ++i)
    scale[i] = load_element<F>(rows + (i / share) * r.packed_token_stride, i % share);
  for (int64_t t = 0; t < f.tokens; ++t) {
    Isa::expand(rows + t * r.packed_token_stride + f.share_bytes, f.width, spread);
    Stored<F>* out = static_cast<Stored<F>*>(r.out) + outer * r.out_outer_stride + (first + t) * r.out_token_stride;
    Isa::template scale<F, false, true, true>(spread, f.width, scale, scale + f.width, out);
  }
}

// Units [first, last) of the rows in order, a unit being a row, or a group of rows for key
// groups; spread holds a row's codes (f.width + CODES_SLACK), scale a group's scales and zeros (2 x f.width).
template <class Isa, KvFloat F, KvCodes C>
void decode_units(const KvFormat& f, const KvRows& r, int64_t first, int64_t last, uint8_t* spread, float* scale) {
  if constexpr (C == KvCodes::int4_key_groups) {
    const int64_t per_outer = r.tokens / f.tokens;
    for (int64_t u = first; u < last; ++u)
      key_group<Isa, F>(f, r, u / per_outer, (u % per_outer) * f.tokens, spread, scale);
  } else {
    for (int64_t u = first; u < last;) {  // the run of rows of one outer index at a time
      const int64_t outer = u / r.tokens, token = u % r.tokens, end = std::min(last - u, r.tokens - token);
      token_rows<Isa, F, C>(f, r, outer, token, token + end, spread);
      u += end;
    }
  }
}

using Task = void (*)(const KvFormat&, const KvRows&, int64_t, int64_t, uint8_t*, float*);

template <KvFloat F, KvCodes C>
ZEROLITE_KV_TASK void scalar_units(const KvFormat& f, const KvRows& r, int64_t first, int64_t last, uint8_t* spread,
                                   float* scale) {
  decode_units<Scalar, F, C>(f, r, first, last, spread, scale);
}

#ifdef ZEROLITE_X86
// GCC leaves out the vzeroupper that the SSE code after them needs (none in the library): given here.
template <KvFloat F, KvCodes C>
ZEROLITE_KV_AVX2 ZEROLITE_KV_TASK void avx2_units(const KvFormat& f, const KvRows& r, int64_t first, int64_t last,
                                                  uint8_t* spread, float* scale) {
  decode_units<Avx2, F, C>(f, r, first, last, spread, scale);
  _mm256_zeroupper();
}

template <KvFloat F, KvCodes C>
ZEROLITE_AVX512 ZEROLITE_KV_TASK void avx512_units(const KvFormat& f, const KvRows& r, int64_t first, int64_t last,
                                                   uint8_t* spread, float* scale) {
  decode_units<Avx512, F, C>(f, r, first, last, spread, scale);
  _mm256_zeroupper();
}
#endif

// The instruction sets the kernel has a path for; the CpuPath levels above avx512 take its path.
enum class Level { scalar, avx2, avx512 };

template <Level L, KvFloat F, KvCodes C>
Task task_of() {
#ifdef ZEROLITE_X86
  if constexpr (L == Level::avx512) return avx512_units<F, C>;
  if constexpr (L == Level::avx2) return avx2_units<F, C>;
#endif
  return scalar_units<F, C>;
}

template <Level L, KvFloat F>
Task task_of(KvCodes codes) {
  if (codes == KvCodes::int8) return task_of<L, F, KvCodes::int8>();
  if (codes == KvCodes::int4) return task_of<L, F, KvCodes::int4>();
  return task_of<L, F, KvCodes::int4_key_groups>();
}

template <Level L>
Task task_of(const KvFormat& f) {
  if (f.dtype == KvFloat::bf16) return task_of<L, KvFloat::bf16>(f.codes);
  if (f.dtype == KvFloat::fp16) return task_of<L, KvFloat::fp16>(f.codes);
  return task_of<L, KvFloat::fp32>(f.codes);
}

Task task_of(const KvFormat& f, CpuPath path) {
  if (path >= CpuPath::avx512) return task_of<Level::avx512>(f);
  if (path >= CpuPath::avx2) return task_of<Level::avx2>(f);
  return task_of<Level::scalar>(f);
}

}  // namespace

void kv_decode(const KvFormat& f, const KvRows& r, CpuPath path, int threads) {
  const Task task = task_of(f, path);
  const int64_t unit_rows = f.codes == KvCodes::int4_key_groups ? f.tokens : 1;
  const int64_t units = r.outer * (r.tokens / unit_rows);
  const int64_t per_task = std::max<int64_t>(1, ROWS_PER_TASK / unit_rows);
  kernel_pool().run(threads, (units + per_task - 1) / per_task, [&](int64_t index) {
    std::vector<uint8_t> spread(f.width + CODES_SLACK);
    std::vector<float> scale(f.codes == KvCodes::int4_key_groups ? 2 * f.width : 0);
    task(f, r, index * per_task, std::min(units, (index + 1) * per_task), spread.data(), scale.data());
  });
}

}  // namespace zerolite
