"""How one expert of a mixture's layer in place is read: the whole pages of its parts that lie in
the extent as they lie in their pages of the shards, straight into the extent; the rest (the ends
of such parts, within a page, and whole parts that lie otherwise) in runs of pages into scratch,
one after another, and copied from there to their places.

    plan = expert_read(area.sources, expert, area.stride, direct=True)
    plan.direct     # (shard, offset, bytes, to in the extent), 4 KiB aligned at both ends
    plan.reads      # (shard, offset, bytes), 4 KiB aligned: read into scratch one after another
    plan.copies     # (from in scratch, to in the extent, bytes)
    plan.padding    # (start, end) in the extent that no part fills: zeros, so that a checksum is stable

direct=False reads every byte through scratch (for a read of part of an extent, whose buffer may
not hold it all). A checkpoint keeps an expert's tensors side by side (safetensors writes them in
order of name: experts.3.w1, w2, w3), so its scratch reads are usually one run; parts farther
apart than a page are read apart rather than through the bytes between them.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerolite.io.engine import ALIGNMENT, align_up
from zerolite.layout.manifest import ExpertSources

GAP_READ_THROUGH = ALIGNMENT  # parts closer than a page share a read (its pages are read whole anyway)


@dataclass(frozen=True)
class ExpertRead:
    direct: tuple[tuple[int, int, int, int], ...]
    reads: tuple[tuple[int, int, int], ...]
    copies: tuple[tuple[int, int, int], ...]
    padding: tuple[tuple[int, int], ...]

    @property
    def scratch_bytes(self) -> int:
        return sum(length for _, _, length in self.reads)


def expert_read(sources: ExpertSources, expert: int, stride: int, direct: bool) -> ExpertRead:
    parts, whole_pages = [], []
    for shard, offset, length, place in zip(sources.shards[expert], sources.offsets[expert], sources.lengths,
                                            sources.places):
        low, high = align_up(offset), (offset + length) // ALIGNMENT * ALIGNMENT
        if direct and (offset - place) % ALIGNMENT == 0 and low < high:
            whole_pages.append((shard, low, high - low, place + low - offset))
            parts += [(shard, offset, low - offset, place),  # the ends, within a page
                      (shard, high, offset + length - high, place + high - offset)]
        else:
            parts.append((shard, offset, length, place))
    parts = sorted(part for part in parts if part[2])
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
    filled = sorted([(to, length) for *_, length, to in whole_pages] + [(to, length) for _, to, length in copies])
    padding, end = [], 0
    for place, length in filled:
        if place > end:
            padding.append((end, place))
        end = max(end, place + length)
    if end < stride:
        padding.append((end, stride))
    return ExpertRead(tuple(whole_pages), tuple(reads), tuple(copies), tuple(padding))
