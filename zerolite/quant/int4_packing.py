"""Where each 4-bit weight sits in the bytes torch's CPU int4 kernel reads, so that a layout can
store exactly those bytes and nothing is repacked per step.

    packing = cpu_packing()                   # this torch's form on this CPU: Int4Packing(64, "halves")
    packed = pack_int4(q, packing)            # q: uint8 [out, in] of values 0..15 -> uint8 [out, in / 2]
    q = unpack_int4(packed, out, in, packing)

aten._convert_weight_to_int4pack_for_cpu stores the rows in blocks (64 rows where torch runs
AVX-512 code, 32 otherwise) and, within a block, input column by column; each byte holds two rows'
nibbles, rows d and d + block/2 (AVX2, AVX-512) or rows 2d and 2d + 1 (plain code). The last,
shorter block always pairs adjacent rows. That form depends on the CPU torch runs on, so a layout
records it (Int4Packing.to_manifest): zerolite's CPU kernels (zerolite.quant.cpu_kernels) read the
bytes by that record, whichever torch or CPU packed them. Both functions are plain tensor indexing,
so the unpack runs wherever the bytes are (a GPU dequantises on the device).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from zerolite.errors import ZeroliteError

ROW_MULTIPLE = 16  # the kernel's packer takes only output widths that are a multiple of this


@dataclass(frozen=True)
class Int4Packing:
    block_rows: int
    interleave: str   # "halves": rows d and d + block/2 share a byte; "pairs": rows 2d and 2d + 1

    def to_manifest(self) -> dict:
        return {"torch": torch.__version__, "block_rows": self.block_rows, "interleave": self.interleave}

    @classmethod
    def from_manifest(cls, record: dict) -> Int4Packing:
        return cls(int(record["block_rows"]), str(record["interleave"]))


CANDIDATES = tuple(Int4Packing(rows, interleave) for rows in (64, 32) for interleave in ("halves", "pairs"))


def pack_int4(q: torch.Tensor, packing: Int4Packing) -> torch.Tensor:
    """uint8 [out, in / 2] holding q's values (0..15) in packing's order."""
    rows, cols = q.shape
    full = rows // packing.block_rows * packing.block_rows
    parts = []
    if full:
        blocks = q[:full].reshape(full // packing.block_rows, packing.block_rows, cols).transpose(1, 2)
        parts.append(join_nibbles(blocks, packing.interleave).reshape(-1))
    if rows > full:
        parts.append(join_nibbles(q[full:].t(), "pairs").reshape(-1))
    return torch.cat(parts).reshape(rows, cols // 2)


def unpack_int4(packed: torch.Tensor, rows: int, cols: int, packing: Int4Packing) -> torch.Tensor:
    """uint8 [rows, cols] of values 0..15 from packed bytes in packing's order."""
    flat = packed.reshape(-1)
    full = rows // packing.block_rows * packing.block_rows
    parts = []
    if full:
        blocks = flat[: full * cols // 2].reshape(full // packing.block_rows, cols, packing.block_rows // 2)
        parts.append(split_nibbles(blocks, packing.interleave).transpose(1, 2).reshape(full, cols))
    if rows > full:
        tail = flat[full * cols // 2:].reshape(cols, (rows - full) // 2)
        parts.append(split_nibbles(tail, "pairs").t())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def join_nibbles(nibbles: torch.Tensor, interleave: str) -> torch.Tensor:
    """[..., n] values -> [..., n / 2] bytes."""
    if interleave == "halves":
        low, high = nibbles.chunk(2, dim=-1)
    else:
        low, high = nibbles[..., 0::2], nibbles[..., 1::2]
    return low | (high << 4)


def split_nibbles(packed: torch.Tensor, interleave: str) -> torch.Tensor:
    """[..., n / 2] bytes -> [..., n] values, the inverse of join_nibbles."""
    low, high = packed & 15, packed >> 4
    if interleave == "halves":
        return torch.cat([low, high], dim=-1)
    return torch.stack([low, high], dim=-1).flatten(-2)


@functools.cache
def cpu_packing() -> Int4Packing:
    """The form this torch's int4 packer writes on this CPU, found by packing a probe with it."""
    probe = torch.randint(0, 16, (112, 8), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    for packing in CANDIDATES:
        if torch.equal(pack_int4(probe.to(torch.uint8), packing), packed):
            return packing
    raise ZeroliteError(f"torch {torch.__version__} packs 4-bit weights in a form zerolite does not know: "
                        "use `weights` int8, or torch 2.13")
