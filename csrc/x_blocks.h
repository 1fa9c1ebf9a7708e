// Rows of x rounded to int8 in blocks of 32 columns, as llama.cpp's Q8_0 rounds them, for the
// avx512vnni and avx2int8 paths of the int4 and int8 kernels: each block's step is its largest |x| / 127, each
// q = x / step rounded half away from zero. A decode step rounds a hundred rows of a few thousand
// columns, each on the calling thread before the matmul's threads start: in vectors of 32 columns
// (a scalar loop took about as long as a 2048 x 64 block of the int4 matmul).
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_matmul.h"

#ifdef ZEROLITE_X86
namespace zerolite {

constexpr int X_BLOCK = 32;

struct XBlocks {
  std::vector<int8_t> q;       // [rows, padded]; zero past in_features
  std::vector<float> step;     // [rows, blocks]; zero past in_features
  std::vector<int32_t> q_sum;  // [rows, blocks]: each block's sum of q
  std::vector<float> sum;      // [rows, blocks]: each block's sum of x itself
  int64_t padded = 0, blocks = 0;  // columns (in_features rounded up, a multiple of X_BLOCK) and blocks a row
};

// r's rows (fp32, or bf16 where r.x_bf16 is set), in_features wide; padded: a multiple of
// X_BLOCK, at least in_features. In AVX-512's vectors at avx512 and above, else AVX2's: the same
// integers and steps either way (the same fp32 operations), sums of x in another order.
XBlocks x_blocks(const Rows& r, int64_t in_features, int64_t padded, CpuPath path);

}  // namespace zerolite
#endif
