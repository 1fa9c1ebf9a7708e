"""Resident blocks, brought to the device once at load: the embeddings, the head, and the layers
the device budget holds.

    for name, data in load_resident(disk, ["embed", "head"], device):
        binding[name].bind(data)

Where the device has memory of its own, each block passes through two pinned staging buffers of
STAGING_BYTES, read in pieces by the engine and copied on a stream of their own: the host never
holds more than the staging (an 80 GB GPU loads on a 64 GB host), and the copies run at pinned
speed while the next piece is read. The host waits for the last copies before compute's first use.
Each tensor lands at its place on the device (zerolite.layout.placement), as in a slot.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from zerolite.io.device import Device
from zerolite.layout.placement import device_placement
from zerolite.layout.store import DiskStore, MemoryStore

STAGING_BYTES = 64 << 20


def load_resident(disk: DiskStore, names, device: Device, progress=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, the block's bytes on the device) for each block, each checked against its checksum."""
    names = list(names)
    if not device.separate_memory:
        memory = MemoryStore.load(disk, names, device.empty, progress)
        yield from ((name, memory.bytes_of(name)) for name in names)
        return
    copies = device.new_stream()
    staging = [device.pinned_empty(STAGING_BYTES) for _ in range(2)] if names else []
    copied = [None, None]  # the event of the last copy out of each staging buffer
    turn = 0
    try:
        for name in names:
            length = disk.entry(name).length
            placed = device_placement(disk.entry(name))
            target = device.empty(placed.entry.length)
            device.wait_stream(copies, device.compute_stream())  # target comes from the compute stream's memory
            crc = 0
            for start in range(0, length, STAGING_BYTES):
                piece = min(STAGING_BYTES, length - start)
                buffer = staging[turn]
                if copied[turn] is not None:
                    copied[turn].synchronize()  # the engine may not overwrite bytes a copy still reads
                disk.wait(disk.submit(name, buffer, start, piece))
                crc = zlib.crc32(buffer[:piece].numpy(), crc)
                for move in placed.within(start, piece):
                    device.copy(target[move.to:move.to + move.length],
                                buffer[move.start - start:move.start - start + move.length], copies)
                copied[turn] = device.record(copies)
                turn = 1 - turn
            disk.verify_crc(name, crc)
            if progress is not None:
                progress.advance(length)
            yield name, target
    finally:
        # The staging buffers are unpinned and freed when this returns, a failed read or checksum
        # included: no copy may still read them. Compute, queued after this, comes after the copies too.
        device.synchronize(copies)
