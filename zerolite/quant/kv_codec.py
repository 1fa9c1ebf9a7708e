"""Keys and values at 8 or 4 bits, group-wise, each token's head packed with its scales into one row
of bytes, so that the cache holds one uint8 tensor [batch, heads, tokens, row bytes] where it held
[batch, heads, tokens, width] states:

    codec = KVCodec(bits=4)
    packed = codec.encode(key_states)                # quantized as appended: every token on its own
    keys = codec.decode(packed, torch.bfloat16, 64)  # dequantised where attention reads them

A row is [scales | zeros (4 bits only) | codes]: a scale (and a zero) in the states' dtype for
each group of channels (zerolite.memory_model.kv_group_size), then an int8 code a channel
(symmetric: x = code * scale) or two 4-bit codes a byte, the even channel in the low nibble
(asymmetric: x = code * scale + zero, zero the group's minimum). The row's width is
zerolite.memory_model.kv_row_bytes. Every token is quantized alone, so appending never touches
what is stored, and whatever the cache does along the batch and the tokens (concatenating,
cropping, selecting rows, reordering columns, zero rows that join a batch: they decode to zeros)
it does to the packed rows unchanged, scales and all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerolite.memory_model import kv_group_size, kv_row_bytes

INT8_LIMIT = 127  # symmetric: -127..127, so that code * scale never passes the group's largest magnitude
INT4_LEVELS = 15  # asymmetric: 0..15 between the group's minimum and maximum


@dataclass(frozen=True)
class KVCodec:
    bits: int  # 8 or 4

    def encode(self, states: torch.Tensor) -> torch.Tensor:
        """[..., width] states (any float dtype) as [..., kv_row_bytes(width, dtype, bits)] uint8 rows."""
        dtype, width = states.dtype, states.shape[-1]
        group = kv_group_size(width)
        x = states.float().unflatten(-1, (width // group, group))
        if self.bits == 8:
            # The scale as stored (rounded to dtype) is the one the codes are made with: decode undoes exactly it.
            scale = (x.abs().amax(-1, keepdim=True) / INT8_LIMIT).to(dtype)
            codes = (x / nonzero(scale.float())).round().clamp(-INT8_LIMIT, INT8_LIMIT).to(torch.int8)
            parts = [scale, codes.flatten(-2).view(torch.uint8)]
        else:
            low, high = x.amin(-1, keepdim=True).to(dtype), x.amax(-1, keepdim=True)
            scale = ((high - low.float()) / INT4_LEVELS).to(dtype)
            codes = ((x - low.float()) / nonzero(scale.float())).round().clamp(0, INT4_LEVELS).to(torch.uint8)
            codes = codes.flatten(-2)
            if width % 2:
                codes = torch.nn.functional.pad(codes, (0, 1))
            parts = [scale, low, codes[..., 0::2] | (codes[..., 1::2] << 4)]
        rows = [part.flatten(-2).view(torch.uint8) if part.dtype == dtype else part for part in parts]
        used = sum(row.shape[-1] for row in rows)
        padding = kv_row_bytes(width, dtype, self.bits) - used
        if padding:
            rows.append(rows[-1].new_zeros((*rows[-1].shape[:-1], padding)))
        return torch.cat(rows, dim=-1)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
        """The [..., width] states in dtype that packed rows hold. Decoded in dtype, in place: the
        layer read holds nothing wider than its states (zerolite.memory_model.kv_decode_bytes_per_token)."""
        groups = width // kv_group_size(width)
        scale_bytes = groups * dtype.itemsize
        scale = packed[..., :scale_bytes].view(dtype).unsqueeze(-1)
        codes = packed[..., scale_bytes * (2 if self.bits == 4 else 1):]
        if self.bits == 8:
            states = codes[..., :width].view(torch.int8).to(dtype)
            return states.unflatten(-1, (groups, -1)).mul_(scale).flatten(-2)
        zero = packed[..., scale_bytes:2 * scale_bytes].view(dtype).unsqueeze(-1)
        nibbles = codes[..., :(width + 1) // 2]
        states = torch.empty((*packed.shape[:-1], 2 * nibbles.shape[-1]), dtype=dtype, device=packed.device)
        states[..., 0::2] = nibbles & 0xF
        states[..., 1::2] = nibbles >> 4
        states = states[..., :width].unflatten(-1, (groups, -1))
        return states.mul_(scale).add_(zero).flatten(-2)


def nonzero(scale: torch.Tensor) -> torch.Tensor:
    """A group of zeros has a scale of 0: its codes are 0 whatever it is divided by."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)
