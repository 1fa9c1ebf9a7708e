"""torch's fused int4 matmul on a GPU (tinygemm: aten._weight_int4pack_mm), for the few rows of a
decode step.

    kernel = int4_kernel(device)                       # None where there is none, or it fails its probe
    packed = kernel.pack(paired_columns(q), inner_k_tiles(in_features))   # once per slot fill
    y = kernel.mm(rows, packed, group_size, scale_zero)                  # rows: bf16 [m, in]

Dequantising a weight, then multiplying, moves about 21 bytes of GPU memory per weight (unpack,
widen, scale, shift, read again) where the link brought half a byte; tinygemm reads the packed
nibbles once. It computes (q - 8) * scale + zero group by group, the form zerolite's int4 layouts
store, from the same [groups, out, 2] scales-and-zeros tensor, but reads its own tiled order of the
nibbles: aten._convert_weight_to_int4pack makes it on the device, from a uint8 [out, in / 2]
whose bytes hold two columns each, the even one in the high nibble. Its time grows with the rows
while dequantise-then-multiply's barely does: it wins while the rows are few (the H100's figures:
docs/design-figures.md).

The kernel is tried once per device on a small weight against the dequantised product: where the
op is missing (an older torch), not built for the GPU (before sm80) or computes something else,
int4_kernel gives None and the layers dequantise.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zerolite.io.device import Device

GROUP_SIZES = (32, 64, 128, 256)   # the group sizes tinygemm is built for
K_TILE = 16                         # input columns per tensor-core tile; 2, 4 or 8 tiles are packed together
N_TILE = 8                          # output rows per tile
PROBE_TOLERANCE = 1e-2              # of the largest output: bf16's rounding, not a misread nibble


@dataclass(frozen=True)
class Int4Kernel:
    pack: Callable[[torch.Tensor, int], torch.Tensor]   # (paired columns uint8 [out, in / 2], inner k-tiles) -> packed
    # (rows, packed, group size, scales and zeros) -> rows
    mm: Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


def paired_columns(q: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in] values 0..15 -> uint8 [out, in / 2], the even column in the high nibble."""
    return (q[:, ::2] << 4 | q[:, 1::2]).contiguous()


def inner_k_tiles(in_features: int) -> int:
    """The most k-tiles (8, 4, 2) packed together that divide the input width."""
    return next(tiles for tiles in (8, 4, 2) if in_features % (tiles * K_TILE) == 0)


def fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether tinygemm takes a weight of this shape and group size."""
    return out_features % N_TILE == 0 and in_features % (2 * K_TILE) == 0 and group_size in GROUP_SIZES


def int4_kernel(device: Device) -> Int4Kernel | None:
    """tinygemm on a CUDA device, where this torch has it and it computes what the weights hold."""
    if device.torch_device.type != "cuda":
        return None
    return tinygemm(device.torch_device)


@functools.cache
def tinygemm(torch_device: torch.device) -> Int4Kernel | None:
    convert = getattr(torch.ops.aten, "_convert_weight_to_int4pack", None)
    mm = getattr(torch.ops.aten, "_weight_int4pack_mm", None)
    if convert is None or mm is None:
        return None
    return checked(Int4Kernel(convert, mm), torch_device)


def checked(kernel: Int4Kernel, torch_device: torch.device) -> Int4Kernel | None:
    """kernel, if on a small weight it computes what the weight dequantises to; else None."""
    out_features, in_features, group_size = 16, 256, 64
    generator = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=generator)
    scale = torch.rand(in_features // group_size, out_features, generator=generator) * 0.1 + 0.01
    zero = torch.randn(in_features // group_size, out_features, generator=generator) * 0.1
    scale_zero = torch.stack([scale, zero], dim=-1).bfloat16()  # [groups, out, 2]
    rows = torch.randn(3, in_features, generator=generator).bfloat16()
    scale, zero = scale_zero.float().transpose(0, 1).unbind(-1)  # [out, groups] each, as the kernel reads them
    weight = (q.float() - 8).view(out_features, -1, group_size) * scale[..., None] + zero[..., None]
    expected = F.linear(rows.float(), weight.reshape(out_features, in_features))
    try:
        packed = kernel.pack(paired_columns(q.to(torch_device)), inner_k_tiles(in_features))
        got = kernel.mm(rows.to(torch_device), packed, group_size, scale_zero.to(torch_device)).float().cpu()
    except (RuntimeError, NotImplementedError):
        return None
    return kernel if (got - expected).abs().max() <= PROBE_TOLERANCE * expected.abs().max() else None
