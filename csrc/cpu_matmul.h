// Weight-only quantized matmuls on the CPU: y[m, :] = x[m, :] @ W^T with W stored as int4 or int8,
// read as a layout stores it (nothing repacked), fp32 activations and outputs. Each kernel has
// one path per instruction set, picked at run time (CpuPath); each path is compiled with its own
// target attribute, so the library runs on any x86-64 and uses what the CPU it runs on offers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace zerolite {

// Each path is a level of instruction set, each level including the ones below it: a kernel takes
// the best of its own paths at or below the level it is given. avx512vnni (int4 and int8)
// quantizes the rows of x to int8 in blocks of 32 columns, as llama.cpp does, and multiplies
// integers: four times the weights a cycle, at the cost of the activations' rounding. avx2int8
// does the same with AVX2's byte products (vpmaddubsw) where the CPU has no AVX-512: it is the
// one level the next (avx512, exact) does not include; elsewhere it runs as avx2.
// avx512bf16 adds the bf16 kernel's dot products of bf16 pairs (int4 and int8 take avx512vnni
// there). amx adds AMX's bf16 tiles to int4 from 8 rows of x on (the weights dequantised to bf16,
// x rounded to bf16, fp32 sums; fewer rows as at avx512vnni; int8 and bf16 take avx512bf16
// there): listed only where the CPU has amx_int8 and amx_bf16 and Linux granted this process the
// tile state. The others compute in fp32 exactly as the weights dequantise.
enum class CpuPath { scalar = 0, avx2 = 1, avx2int8 = 2, avx512 = 3, avx512vnni = 4, avx512bf16 = 5, amx = 6 };

// The paths this CPU can run, best last (scalar always).
std::vector<std::string> supported_cpu_paths();
CpuPath cpu_path_named(const std::string& name);  // throws std::invalid_argument for an unknown or unsupported one

// int4, as zerolite.quant.int4_packing stores torch's CPU packing: output rows in blocks of
// block_rows, each block column by column, block_rows / 2 bytes a column; "halves": byte d holds
// rows d (low nibble) and d + block_rows / 2, else ("pairs") rows 2d and 2d + 1. A last block of
// fewer rows is always "pairs". weight = (q - 8) * scale + zero per group of input columns, with
// scale_zero [groups, out, 2] in bf16 or fp32. stored_in: in_features rounded up to whole groups.
struct Int4Weight {
  const uint8_t* packed;
  int64_t out_features, in_features, stored_in;
  int group_size, block_rows;
  bool halves;
  const void* scale_zero;
  bool bf16_scales;  // else fp32
};

// int8: q [out, in] row-major, weight = q * scale[row] (scales in fp32).
struct Int8Weight {
  const int8_t* q;
  int64_t out_features, in_features;
  const float* scale;
};

// rows of x (fp32, row stride x_stride elements, in_features wide) in, rows of y (y_stride) out.
struct Rows {
  const float* x;
  int64_t count, x_stride;
  float* y;
  int64_t y_stride;
  // Or bf16 rows in and out (x and y then null): the paths that round x to int8 read and write
  // them as they are (no conversion either side of a call); elsewhere they go through fp32 copies.
  const uint16_t* x_bf16 = nullptr;
  uint16_t* y_bf16 = nullptr;
};

void int4_matmul(const Int4Weight& weight, const Rows& rows, CpuPath path, int threads);

// The int4 weight dequantised and transposed: out[k, n] = weight[n, k] for k < in_features, as
// bf16 (round to nearest even) or fp32, each column of a block's nibbles one run of out's row k.
// For a prefill, where a matmul of many rows beats the kernels above. AVX2 takes the plain path.
void int4_dequantize_transposed(const Int4Weight& weight, void* out, bool bf16, CpuPath path, int threads);
void int8_matmul(const Int8Weight& weight, const Rows& rows, CpuPath path, int threads);

// bf16: w [out, in] row-major; rows of x and of y in bf16 (y rounded to nearest even).
struct Bf16Weight {
  const uint16_t* w;
  int64_t out_features, in_features;
};

struct Bf16Rows {
  const uint16_t* x;
  int64_t count, x_stride;
  uint16_t* y;
  int64_t y_stride;
};

void bf16_matmul(const Bf16Weight& weight, const Bf16Rows& rows, CpuPath path, int threads);

}  // namespace zerolite

#if defined(__x86_64__) || defined(__i386__)
#define ZEROLITE_X86 1
#define ZEROLITE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#define ZEROLITE_AVX2 __attribute__((target("avx2,fma")))
#define ZEROLITE_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx2,fma")))
#define ZEROLITE_AVX512BF16 \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx512bf16,avx2,fma")))
#define ZEROLITE_AMX \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512vbmi,avx512bf16,avx2,fma,amx-tile,amx-int8,amx-bf16")))

namespace zerolite {

// The lanes a step of a row reads: all of the mask's bits, or at a row's end the `left` columns
// there are (a masked load there reads nothing past the row).
template <typename Mask>
inline Mask tail_mask(int64_t left) {
  constexpr int64_t bits = 8 * sizeof(Mask);
  return left >= bits ? static_cast<Mask>(~0ull) : static_cast<Mask>((1ull << left) - 1);
}

}  // namespace zerolite
#endif
