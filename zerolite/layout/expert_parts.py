"""How one expert of a mixture's layer in place is read: its parts' runs of pages in the shards,
read one after another into scratch, and where each part goes from there in the expert's extent.

    plan = expert_read(area.sources, expert, area.stride)
    plan.reads      # (shard, offset, bytes), 4 KiB aligned: read into scratch one after another
    plan.copies     # (from in scratch, to in the extent, bytes)
    plan.padding    # (start, end) in the extent that no part fills: zeros, so that a checksum is stable

A checkpoint keeps an expert's tensors side by side (safetensors writes them in order of name:
experts.3.w1, w2, w3), so an expert is usually one read; parts farther apart than a page are read
apart rather than through the bytes between them (other experts' tensors).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerolite.io.engine import ALIGNMENT, align_up
from zerolite.layout.manifest import ExpertSources

GAP_READ_THROUGH = ALIGNMENT  # parts closer than a page share a read (its pages are read whole anyway)


@dataclass(frozen=True)
class ExpertRead:
    reads: tuple[tuple[int, int, int], ...]
    copies: tuple[tuple[int, int, int], ...]
    padding: tuple[tuple[int, int], ...]

    @property
    def scratch_bytes(self) -> int:
        return sum(length for _, _, length in self.reads)


def expert_read(sources: ExpertSources, expert: int, stride: int) -> ExpertRead:
    parts = sorted(zip(sources.shards[expert], sources.offsets[expert], sources.lengths, sources.places))
    reads, copies = [], []
    at = run_end = 0  # where the current run starts in scratch; where its last part ends in its shard
    for shard, offset, length, place in parts:
        if reads and shard == reads[-1][0] and offset - run_end <= GAP_READ_THROUGH:
            run_end = max(run_end, offset + length)
        else:
            at += reads[-1][2] if reads else 0
            run_end = offset + length
            reads.append((shard, offset // ALIGNMENT * ALIGNMENT, 0))
        start = reads[-1][1]
        reads[-1] = (shard, start, align_up(run_end) - start)
        copies.append((at + offset - start, place, length))
    copies.sort(key=lambda copy: copy[1])
    padding, end = [], 0
    for _, place, length in copies:
        if place > end:
            padding.append((end, place))
        end = max(end, place + length)
    if end < stride:
        padding.append((end, stride))
    return ExpertRead(tuple(reads), tuple(copies), tuple(padding))
