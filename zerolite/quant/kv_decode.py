"""zerolite's CPU kernel for reading packed K/V (csrc/kv_decode.cpp): rows zerolite.quant.kv_codec
packed decoded into the states attention reads in one pass, about as fast as a fresh tensor of them
is written (cloned), where torch's elementwise passes (widen, scale, add the zero, each over the
whole layer) ran 2 to 8 times slower. Bit for bit what those passes give: each product, and each
sum, rounded to the states' dtype.

    if not decode(out, packed, INT4, group=128):    # out: [..., tokens, width], a view of a larger tensor may be
        ...                                          # not here: the codec's torch passes

Paths for AVX-512, AVX2 and plain C++, chosen as the matmuls' are (zerolite.quant.cpu_kernels:
ZEROLITE_CPU_KERNEL forces one); the rows split over the extension's threads, torch's thread count
of them, the GIL released. It is a torch operator (zerolite::kv_decode), so that what watches
torch's operations sees it read the packed rows and write the states: the simulated device's
ledger does.
"""

from __future__ import annotations

import math

import torch

from zerolite import _engine
from zerolite.quant.cpu_kernels import kernel_path, kernel_threads

# how rows are packed (csrc/kv_decode.h's KvCodes)
INT8, INT4, INT4_KEY_GROUPS = 0, 1, 2
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


# Defined through torch.library's Library, not custom_op: a call costs a few microseconds, not tens.
_LIBRARY = torch.library.Library("zerolite", "FRAGMENT")  # other zerolite operators may join it
_LIBRARY.define("kv_decode(Tensor(a!) out, Tensor packed, int codes, int group, int tokens, int share_bytes, "
                "int outer, int out_outer_stride, int packed_outer_stride) -> ()")


def _kv_decode(out: torch.Tensor, packed: torch.Tensor, codes: int, group: int, tokens: int, share_bytes: int,
               outer: int, out_outer_stride: int, packed_outer_stride: int) -> None:
    _engine.kv_decode(codes, DTYPES[out.dtype], out.shape[-1], group, tokens, share_bytes, packed.data_ptr(),
                      packed_outer_stride, packed.stride(-2), out.data_ptr(), out_outer_stride, out.stride(-2),
                      outer, out.shape[-2], kernel_path(), kernel_threads())


_LIBRARY.impl("kv_decode", _kv_decode, "CPU")
_OPERATOR = torch.ops.zerolite.kv_decode.default


def decode(out: torch.Tensor, packed: torch.Tensor, codes: int, group: int = 0, tokens: int = 1,
           share_bytes: int = 0) -> bool:
    """Writes the states packed rows ([..., tokens, row bytes] uint8) hold into out ([..., tokens,
    width]): INT8 and INT4 with a scale a group of group channels, INT4_KEY_GROUPS with each
    channel's over tokens rows, each row carrying share_bytes of them. False, and nothing written,
    where the kernel does not run: off the CPU, or other dtypes, or rows it cannot index."""
    if out.device.type != "cpu" or packed.device.type != "cpu" or out.dtype not in DTYPES or out.stride(-1) != 1:
        return False
    if packed.shape[:-1] != out.shape[:-1] or out.shape[-2] % tokens:
        raise ValueError(f"packed rows {tuple(packed.shape)} do not decode into states {tuple(out.shape)}")
    if packed.stride(-1) != 1:
        packed = packed.contiguous()
    outer = _outer_stride(out), _outer_stride(packed)
    if None in outer:
        return False
    _OPERATOR(out, packed, codes, group, tokens, share_bytes, math.prod(out.shape[:-2]), *outer)
    return True


def _outer_stride(rows: torch.Tensor) -> int | None:
    """The stride of the dims before the last two taken as one index, None where they are not one
    stride apart."""
    stride, span = 0, 1
    for size, step in reversed(list(zip(rows.shape[:-2], rows.stride()[:-2]))):
        if size == 1:
            continue
        if span > 1 and step != stride * span:
            return None
        stride = stride if span > 1 else step
        span *= size
    return stride
