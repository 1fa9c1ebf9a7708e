"""Where a block's tensors lie in a device slot, and the copies that bring them there.

    placed = device_placement(entry)      # entry: the block as the manifest lays out its bytes as read
    placed.entry                          # the block as it lies on the device: bind views of it
    for move in placed.within(0, entry.length):
        copy(device[move.to:move.to + move.length], host[move.start:move.start + move.length])

A converted layout places every tensor at TENSOR_ALIGNMENT (256 B) inside its block: on the device
the block is its bytes as read, one copy. A layout in place reads the checkpoint's shards, where
safetensors packs tensors one after another from a header of any length: their offsets are
multiples of their element size at best, and GPU kernels that load 16 bytes at once (an H100's
grouped_mm among them) refuse or fall off their fast path on such a tensor. O_DIRECT reads whole
pages, so a read cannot shift a tensor by less than 4 KiB; the host-to-device copy can, at no cost
(it moves every byte anyway). So on a device with memory of its own, such a block's tensors are laid
out afresh at 256-byte offsets, one copy per run of tensors that keep their distance (a tensor
already aligned in the file where the tensors before it leave room stays where it was read), and
bound there. Where host memory is the device's the bytes are used as read: no copy, element-size
alignment.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from zerolite.io.engine import align_up
from zerolite.layout.manifest import TENSOR_ALIGNMENT, BlockEntry, ExpertArea, round_up


@dataclass(frozen=True)
class Move:
    start: int    # in the block's bytes as read
    to: int       # in the device slot
    length: int


@dataclass(frozen=True)
class Placement:
    entry: BlockEntry          # the block on the device: its tensors' offsets there, its length there
    moves: tuple[Move, ...]    # in order of start; what they do not cover holds no tensor

    def within(self, start: int, length: int) -> list[Move]:
        """The moves' share of the bytes as read [start, start + length): a piece staged on its own."""
        clipped = []
        for move in self.moves:
            low, high = max(start, move.start), min(start + length, move.start + move.length)
            if low < high:
                clipped.append(Move(low, move.to + low - move.start, high - low))
        return clipped

    @property
    def identity(self) -> bool:
        """The block lies on the device as read: one copy of all of it."""
        return self.moves == (Move(0, 0, self.entry.length),)


@functools.cache
def device_placement(entry: BlockEntry) -> Placement:
    """The block's tensors at TENSOR_ALIGNMENT on the device. Where they all are already (every
    converted layout), the bytes as read; else each tensor, in the order they were read, at the
    first aligned offset past the one before, a run of tensors that keeps its relative places
    moved by one copy. A mixture's experts come after the dense part laid out afresh
    (experts_placed)."""
    if all(t.offset % TENSOR_ALIGNMENT == 0 for t in entry.tensors):
        return Placement(entry, (Move(0, 0, entry.length),))
    moves: list[Move] = []
    placed: dict[str, int] = {}
    end = 0
    for tensor in sorted((t for t in entry.tensors if not t.expert_stride), key=lambda t: t.offset):
        stays = tensor.offset % TENSOR_ALIGNMENT == 0 and tensor.offset >= end
        to = tensor.offset if stays else round_up(end, TENSOR_ALIGNMENT)
        last = moves[-1] if moves else None
        if (last is not None and to - tensor.offset == last.to - last.start
                and tensor.offset >= last.start + last.length):
            moves[-1] = Move(last.start, last.to, tensor.offset + tensor.span - last.start)
        else:
            moves.append(Move(tensor.offset, to, tensor.span))
        placed[tensor.name] = to
        end = to + tensor.span
    area = entry.experts
    if area is not None:
        area, expert_moves, end = experts_placed(entry, align_up(end), placed)
        moves += expert_moves
    tensors = tuple(dataclasses.replace(t, offset=placed[t.name], expert_stride=t.expert_stride and area.stride)
                    for t in entry.tensors)
    return Placement(dataclasses.replace(entry, tensors=tensors, length=align_up(end), experts=area), tuple(moves))


def experts_placed(entry: BlockEntry, start: int, placed: dict[str, int]) -> tuple[ExpertArea, list[Move], int]:
    """The experts' area on the device from start (4 KiB aligned) on, or where it was read if later:
    moved whole where its tensors lie at TENSOR_ALIGNMENT in their extents (every converted layout's),
    else each extent laid out afresh, one copy per expert and tensor (in place, a slice lies in its
    extent as in its pages of the shards, so that it is read there directly); fills placed with
    their offsets; returns the area, the moves and the end."""
    area = entry.experts
    fused = sorted((t for t in entry.tensors if t.expert_stride), key=lambda t: t.offset)
    offset = max(start, area.offset)
    if all((t.offset - area.offset) % TENSOR_ALIGNMENT == 0 for t in fused):
        placed.update((t.name, t.offset - area.offset + offset) for t in fused)
        moves = [Move(area.offset, offset, area.count * area.stride)]
        return dataclasses.replace(area, offset=offset), moves, offset + area.count * area.stride
    places, cursor = {}, 0
    for t in fused:
        places[t.name] = cursor = round_up(cursor, TENSOR_ALIGNMENT)
        cursor += t.nbytes // t.shape[0]
    stride = align_up(cursor)
    placed.update((t.name, offset + places[t.name]) for t in fused)
    moves = [Move(t.offset + expert * area.stride, offset + expert * stride + places[t.name], t.nbytes // t.shape[0])
             for expert in range(area.count) for t in fused]
    return dataclasses.replace(area, offset=offset, stride=stride), moves, offset + area.count * stride


def dense_part(entry: BlockEntry) -> BlockEntry:
    """A mixture's block (laid out per expert, as on the device: its bytes as read) less its
    experts: what a device holds of a layer whose experts the host computes (`experts` cpu), its
    tensors before the experts' extents and its length theirs."""
    area = entry.experts
    return dataclasses.replace(entry, tensors=tuple(t for t in entry.tensors if t.offset < area.offset),
                               length=area.offset)
