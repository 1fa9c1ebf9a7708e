// K/V rows packed at 8 or 4 bits (zerolite.quant.kv_codec) decoded into bf16, fp16 or fp32 states
// in one pass, bit for bit as the codec's torch operations decode them: each product (and, at 4
// bits, each sum) computed in fp32 and rounded to the states' dtype, as torch rounds each of its
// elementwise passes. Paths for AVX-512, AVX2 and plain C++, picked by CpuPath as the matmuls' are.
#pragma once

#include <cstdint>

#include "cpu_matmul.h"

namespace zerolite {

// The states' dtype, which the scales and zeros stored in each row have too.
enum class KvFloat { bf16 = 0, fp16 = 1, fp32 = 2 };

// How a row is packed:
//   int8: [a scale a group of channels | an int8 code a channel],            x = code * scale
//   int4: [a scale a group | a zero a group | two 4-bit codes a byte],       x = (code * scale) + zero
//   int4_key_groups: [its share of its group's scales and zeros | codes],    x = (code * scale) + zero
// A byte's low nibble is the even channel. int4_key_groups (keys, per channel over `tokens` tokens):
// the shares of a group's rows, laid end to end, are a scale a channel, then a zero a channel.
enum class KvCodes { int8 = 0, int4 = 1, int4_key_groups = 2 };

struct KvFormat {
  KvCodes codes;
  KvFloat dtype;
  int64_t width;        // channels a row decodes to
  int64_t group;        // channels sharing a scale (int8, int4)
  int64_t tokens;       // rows sharing each channel's scale and zero (int4_key_groups)
  int64_t share_bytes;  // bytes of those each row carries before its codes (int4_key_groups)
};

// Rows [outer, token]: the packed ones at strides in bytes, the states at strides in elements
// (each row's channels contiguous). For int4_key_groups, tokens is a whole number of groups.
struct KvRows {
  const uint8_t* packed;
  int64_t packed_outer_stride, packed_token_stride;
  void* out;
  int64_t out_outer_stride, out_token_stride;
  int64_t outer, tokens;
};

void kv_decode(const KvFormat& format, const KvRows& rows, CpuPath path, int threads);

}  // namespace zerolite
