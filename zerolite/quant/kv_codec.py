"""Keys and values at 8 or 4 bits, packed with their scales into rows of bytes, a row per token and
head, so that the cache holds one uint8 tensor [batch, heads, tokens, row bytes] where it held
[batch, heads, tokens, width] states:

    keys_codec, values_codec = kv_codecs(bits=4)
    packed = values_codec.encode(value_states)          # quantized as appended
    values = values_codec.decode(packed, torch.bfloat16, 64)  # dequantised where attention reads them
    packed = keys_codec.encode(key_states)              # at 4 bits: whole groups of keys_codec.tokens tokens
    keys_codec.decode_into(keys[..., :stored, :], packed)  # into a tensor given: a view of a larger one may be

Decoding runs on the CPU through zerolite.quant.kv_decode's kernel, in one pass, and elsewhere (a
GPU) through torch's elementwise passes (torch_decode_into), each in place: the two alike bit for bit.

KVCodec quantizes every token on its own, group-wise along its channels: a row is [scales | zeros
(4 bits only) | codes], a scale (and a zero) in the states' dtype for each group of channels
(zerolite.memory_model.kv_group_size), then an int8 code a channel (symmetric: x = code * scale) or
two 4-bit codes a byte, the even channel in the low nibble (asymmetric: x = code * scale + zero, zero
the group's minimum). The row's width is zerolite.memory_model.kv_row_bytes. Appending never touches
what is stored, and whatever the cache does along the batch and the tokens it does to the packed
rows unchanged, scales and all. Values at 8 and 4 bits, and keys at 8, are quantized so.

KeyGroupCodec quantizes 4-bit keys per channel over groups of tokens (KIVI, Liu et al. 2024): a
key's few large channels are large in every token, and one scale a token spends its 16 levels on
them (SmolLM2-135M over 4096 tokens: +15.5% perplexity token by token, about +1% per channel). A
group's scales and zeros (one each a channel, 2 x width) are spread over its rows, kv_key_share
elements each, before the codes; zerolite.memory_model.kv_key_row_bytes is the row's width. It
encodes whole groups only: the keys of a group not yet full wait at 8 bits (KeyGroupCodec.waiting;
zerolite.runtime.kv_cache.QuantizedStates holds them). Rows of zeros (a row joining a running batch)
decode to zeros in every codec.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zerolite import memory_model
from zerolite.memory_model import kv_group_size, kv_key_row_bytes, kv_key_share, kv_row_bytes
from zerolite.quant import kv_decode

INT8_LIMIT = 127  # symmetric: -127..127, so that code * scale never passes the group's largest magnitude
INT4_LEVELS = 15  # asymmetric: 0..15 between the group's minimum and maximum


@dataclass(frozen=True)
class KVCodec:
    bits: int  # 8 or 4
    tokens = 1  # each token quantized alone: it is stored as it comes

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
        """The [..., width] states in dtype that packed rows hold."""
        return self.decode_into(torch.empty((*packed.shape[:-1], width), dtype=dtype, device=packed.device), packed)

    def decode_into(self, out: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Writes the states packed rows hold into out ([..., width] in the states' dtype; a view of
        a larger tensor may be, so that a layer read holds its K/V once). Returns out."""
        width = out.shape[-1]
        codes = kv_decode.INT8 if self.bits == 8 else kv_decode.INT4
        if not kv_decode.decode(out, packed, codes, group=kv_group_size(width)):
            self.torch_decode_into(out, packed)
        return out

    def torch_decode_into(self, out: torch.Tensor, packed: torch.Tensor) -> None:
        """decode_into with torch's elementwise passes, where the CPU kernel does not run (a GPU):
        each in place in out, so nothing wider than the states is held."""
        dtype, width = out.dtype, out.shape[-1]
        groups = width // kv_group_size(width)
        scale_bytes = groups * dtype.itemsize
        scale = packed[..., :scale_bytes].view(dtype).unsqueeze(-1)
        codes = packed[..., scale_bytes * (2 if self.bits == 4 else 1):]
        states = out.unflatten(-1, (groups, -1))
        if self.bits == 8:
            states.copy_(codes[..., :width].view(torch.int8).unflatten(-1, (groups, -1)))
            states.mul_(scale)
            return
        zero = packed[..., scale_bytes:2 * scale_bytes].view(dtype).unsqueeze(-1)
        nibbles = codes[..., :(width + 1) // 2]
        out[..., 0::2] = nibbles & 0xF
        out[..., 1::2] = (nibbles >> 4)[..., :width // 2]
        states.mul_(scale).add_(zero)


@dataclass(frozen=True)
class KeyGroupCodec:
    """4-bit keys, each channel's scale and zero taken over a group of tokens."""
    # a group's tokens (encode takes a whole number of groups): memory_model's when the codec is made
    tokens: int = field(default_factory=lambda: memory_model.KV_KEY_TOKENS)
    # what the keys of a group not yet full are held in until it fills: 8 bits a channel, the latest
    # tokens read all but exactly (+0.04% perplexity over 16 bits) in half their bytes
    waiting: KVCodec = KVCodec(8)

    def encode(self, states: torch.Tensor) -> torch.Tensor:
        """[..., groups x tokens, width] states as [..., groups x tokens, kv_key_row_bytes(width, dtype, 4)] rows."""
        dtype, width = states.dtype, states.shape[-1]
        x = states.float().unflatten(-2, (-1, self.tokens))  # [..., groups, tokens, width]
        low, high = x.amin(-2, keepdim=True).to(dtype), x.amax(-2, keepdim=True)
        scale = ((high - low.float()) / INT4_LEVELS).to(dtype)
        codes = ((x - low.float()) / nonzero(scale.float())).round().clamp(0, INT4_LEVELS).to(torch.uint8)
        if width % 2:
            codes = torch.nn.functional.pad(codes, (0, 1))
        share = kv_key_share(width, self.tokens)
        block = torch.cat([scale, low], dim=-1)  # [..., groups, 1, 2 x width]: spread over the group's rows
        block = torch.nn.functional.pad(block, (0, share * self.tokens - 2 * width))
        rows = [block.view(*block.shape[:-2], self.tokens, share).view(torch.uint8),
                codes[..., 0::2] | (codes[..., 1::2] << 4)]
        padding = kv_key_row_bytes(width, dtype, 4, self.tokens) - sum(row.shape[-1] for row in rows)
        if padding:
            rows.append(rows[-1].new_zeros((*rows[-1].shape[:-1], padding)))
        return torch.cat(rows, dim=-1).flatten(-3, -2)

    def decode(self, packed: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
        """The [..., width] states in dtype that packed rows (whole groups) hold."""
        return self.decode_into(torch.empty((*packed.shape[:-1], width), dtype=dtype, device=packed.device), packed)

    def decode_into(self, out: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """Writes the states packed rows (whole groups) hold into out ([..., width] in the states'
        dtype; a view of a larger tensor may be: the keys waiting follow them there). Returns out."""
        share_bytes = kv_key_share(out.shape[-1], self.tokens) * out.dtype.itemsize
        if not kv_decode.decode(out, packed, kv_decode.INT4_KEY_GROUPS, tokens=self.tokens, share_bytes=share_bytes):
            self.torch_decode_into(out, packed)
        return out

    def torch_decode_into(self, out: torch.Tensor, packed: torch.Tensor) -> None:
        """decode_into with torch's elementwise passes, in place in out, where the CPU kernel does not run."""
        dtype, width = out.dtype, out.shape[-1]
        rows = packed.unflatten(-2, (-1, self.tokens))  # [..., groups, tokens, row bytes]
        share_bytes = kv_key_share(width, self.tokens) * dtype.itemsize
        block = rows[..., :share_bytes].view(dtype).flatten(-2)[..., :2 * width].unsqueeze(-2)
        scale, zero = block[..., :width], block[..., width:]
        nibbles = rows[..., share_bytes:share_bytes + (width + 1) // 2]
        groups = out.unflatten(-2, (-1, self.tokens))  # a view: decoded in place
        groups[..., 0::2] = nibbles & 0xF
        groups[..., 1::2] = (nibbles >> 4)[..., :width // 2]
        groups.mul_(scale).add_(zero)


def kv_codecs(bits: int, by_token: bool = False) -> tuple[KVCodec | KeyGroupCodec, KVCodec]:
    """The codecs of the keys and of the values at 8 or 4 bits. by_token: 4-bit keys quantized token
    by token too (a sliding window, which drops its oldest tokens one at a time, would split a group)."""
    return (KVCodec(bits) if bits == 8 or by_token else KeyGroupCodec()), KVCodec(bits)


def nonzero(scale: torch.Tensor) -> torch.Tensor:
    """A group of zeros has a scale of 0: its codes are 0 whatever it is divided by."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)
