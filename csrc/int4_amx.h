// The int4 kernel's amx path (csrc/int4_amx.cpp): 64-row "halves" blocks of int4 weights put in
// AMX's tile layout (as integers, or dequantised to bf16) and multiplied into bf16 rows of x by AMX's tiles.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu_matmul.h"
#include "int4_blocks.h"

#ifdef ZEROLITE_X86
namespace zerolite {

// The rows of x as the tiles read them: bf16, `stride` columns a row, zero past in_features (a
// tile reads 32 columns at a time) and in the rows that fill the last tile of 16. Where r's
// rows are that already (bf16, in_features a multiple of 32, whole tiles or fewer than 16 rows),
// they are read where they lie; else copied once, on the calling thread. For the few rows whose
// weights go into the tiles as integers, each row's sums over each group of columns too (what the
// group's zero weighs), made here once for every block.
struct AmxRows {
  const uint16_t* x;
  int64_t count, stride;
  std::vector<uint16_t> copy;
  std::vector<float> group_sums;  // [count, groups]
  int64_t groups;
};

AmxRows amx_rows(const Rows& r, const Int4Weight& w);

// y's rows for block b (whole: 64 rows, "halves"); w.group_size a multiple of 32.
void block_amx(const Int4Weight& w, const Block& b, const AmxRows& x, const Rows& r);

}  // namespace zerolite
#endif
