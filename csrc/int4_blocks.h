// The unit of torch's int4 packing that zerolite's int4 kernels work in: a block of output rows,
// stored column by column, and where each nibble's row and each group's scale and zero lie.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_matmul.h"

namespace zerolite {

struct Block {
  int64_t row0;        // first output row
  int rows;            // output rows in the block
  bool halves;
  const uint8_t* base; // the block's first byte; a column is rows / 2 bytes
};

inline Block block_at(const Int4Weight& w, int64_t index) {
  int64_t full = w.out_features / w.block_rows;
  Block b;
  b.row0 = index * w.block_rows;
  b.rows = index < full ? w.block_rows : static_cast<int>(w.out_features - full * w.block_rows);
  b.halves = index < full && w.halves;
  b.base = w.packed + b.row0 * (w.stored_in / 2);
  return b;
}

// The output row (within its block) of byte `byte`'s low (high = 0) or high (high = 1) nibble.
inline int row_of(const Block& b, int byte, int high) {
  return b.halves ? byte + high * (b.rows / 2) : 2 * byte + high;
}

inline void scale_zero_at(const Int4Weight& w, int64_t group, int64_t row, float& scale, float& zero) {
  int64_t index = (group * w.out_features + row) * 2;
  if (w.bf16_scales) {
    const uint16_t* sz = static_cast<const uint16_t*>(w.scale_zero) + index;
    uint32_t s = static_cast<uint32_t>(sz[0]) << 16, z = static_cast<uint32_t>(sz[1]) << 16;
    std::memcpy(&scale, &s, 4);
    std::memcpy(&zero, &z, 4);
  } else {
    const float* sz = static_cast<const float*>(w.scale_zero) + index;
    scale = sz[0];
    zero = sz[1];
  }
}

}  // namespace zerolite
