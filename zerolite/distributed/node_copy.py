"""One copy of the host-memory tier per node, shared by every rank on it.

    memory = NodeCopy.load(disk, names, device, world, progress)   # a MemoryStore: holds, bytes_of

The node's first rank (LOCAL_RANK 0) reads the blocks, many in flight and each checked against its
checksum, into one memfd: anonymous shared memory that needs no file system (/dev/shm is often
small) and goes away with the last process mapping it, so a killed job leaves nothing behind. The
other ranks on the node map the same memory through /proc/PID/fd/FD of that rank (same user, same
machine); on a GPU each process registers the mapping once (cuMemHostRegister), so copies out of
it run at pinned speed in every rank. The weights are only ever read there: the model's modules
bind views of them.

Nodes are told apart by torchrun's node number, not by host name: two torchrun agents on one
machine (a test of two nodes) are two nodes with a copy each.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time

import torch

from zerolite.distributed.world import World
from zerolite.errors import ZeroliteError
from zerolite.io.device import Device
from zerolite.io.engine import ALIGNMENT, align_up
from zerolite.layout.store import DiskStore, MemoryStore


class NodeCopy(MemoryStore):
    """A MemoryStore whose buffers are views of the node's shared copy."""

    def __init__(self, buffers: dict[str, torch.Tensor], read_gbps: float):
        super().__init__(buffers)
        self.read_gbps = read_gbps   # how fast the node's first rank read the copy

    @classmethod
    def load(cls, disk: DiskStore, names: list[str], device: Device, world: World, progress=None) -> NodeCopy:
        """The node's copy of the named blocks: read here on the node's first rank, mapped on the others.

        1. the first rank creates the memory and reads every block into it
        2. every rank learns where each node's copy is (or which rank failed to read it)
        3. the other ranks map their node's copy
        4. once every rank has mapped it, the descriptors close (the mappings stay)
        """
        offsets, total = places(disk, names)
        mine = None

        def read() -> tuple[int, int, int, float]:
            nonlocal mine
            started = time.perf_counter()
            fd = os.memfd_create("zerolite-host-copy", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, max(total, 1))
            except OSError as e:
                os.close(fd)
                raise ZeroliteError(f"cannot make {total / 1e9:.1f} GB of shared memory for the node's host copy "
                                    f"({e.strerror}): lower `cpu_memory`") from e
            mine = map_shared(fd, total, device, offsets)
            MemoryStore.load(disk, names, allocator(mine, offsets), progress)
            return world.node, os.getpid(), fd, total / max(time.perf_counter() - started, 1e-9) / 1e9

        copies = world.all_gather(read if world.local_rank == 0 else lambda: None, "reading the node's host copy")
        node, pid, fd, gbps = next(copy for copy in copies if copy is not None and copy[0] == world.node)

        def attach() -> None:
            nonlocal mine
            if mine is None:
                try:
                    theirs = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
                except OSError as e:
                    raise ZeroliteError(f"cannot open the host copy of rank {world.rank - world.local_rank} "
                                        f"({e.strerror}): "
                                        "the ranks of one node must run as one user on one machine") from e
                try:
                    mine = map_shared(theirs, total, device, offsets)
                finally:
                    os.close(theirs)

        world.run_on_all(attach, "mapping the node's host copy")
        if world.local_rank == 0:
            os.close(fd)
        return cls({name: mine[offset:offset + disk.entry(name).length] for name, offset in offsets.items()}, gbps)


def places(disk: DiskStore, names: list[str]) -> tuple[dict[str, int], int]:
    """Each block's offset in the copy (4 KiB aligned, for O_DIRECT), and the copy's size."""
    offsets, total = {}, 0
    for name in names:
        offsets[name] = total
        total += align_up(disk.entry(name).length, ALIGNMENT)
    return offsets, total


def map_shared(fd: int, nbytes: int, device: Device, offsets: dict[str, int]) -> torch.Tensor:
    """The memory behind fd, mapped shared, as a uint8 tensor (page-locked on a GPU, no
    registration ending inside a block: each block is copied to the GPU whole)."""
    mapping = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    array = (ctypes.c_uint8 * max(nbytes, 1)).from_buffer(mapping)
    return device.adopt_host(array, mapping, sorted({0, *offsets.values()}))[:nbytes]


def allocator(memory: torch.Tensor, offsets: dict[str, int]):
    """allocate(nbytes) for MemoryStore.load: the next block's place in the copy (blocks come in order)."""
    starts = iter(offsets.values())

    def allocate(nbytes: int) -> torch.Tensor:
        start = next(starts)
        return memory[start:start + nbytes]

    return allocate
