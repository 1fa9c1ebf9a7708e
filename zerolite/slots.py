"""The ring of buffers streamed blocks pass through on their way to compute.

    slots = Slots(disk, memory, depth=2, device=torch.device("cuda"))
    slots.want(["layers.3", "layers.4"]) # reads (and copies) begin; returns at once
    data = slots.wait("layers.3")        # the block's bytes where compute can use them
    ...                                  # run the block
    slots.release("layers.3")            # its slot may be refilled once compute is done with it

A slot holds one block. Its bytes come from its home: a block on disk is read by the engine into
the slot's host buffer (pinned on CUDA); a block in host memory already has them there. On CUDA
they are then copied into the slot's device buffer on a separate stream, ordered by events:
compute waits for the copy, the next copy into the slot waits for compute. On a CPU device the
host bytes are what compute uses: no copy at all.

Slots never decide which block comes next; the executor does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from zerolite.errors import ZeroliteError
from zerolite.io import aligned_empty
from zerolite.store import LayoutStore, MemoryStore
from zerolite.timeline import NO_TIMELINE


@dataclass(eq=False)
class Slot:
    host: torch.Tensor | None            # the read target, for a disk home
    device: torch.Tensor | None          # the copy target, on CUDA
    block: str | None = None
    source: torch.Tensor | None = None   # where the block's bytes are in host memory
    ticket: int | None = None            # engine read into host, not yet waited for
    submitted: float = 0.0               # when that read was submitted (perf_counter)
    copied: torch.cuda.Event | None = None    # set once the host-to-device copy is issued
    computed: torch.cuda.Event | None = None  # compute's last use of the device buffer
    in_use: bool = False
    started: int = 0                     # for picking the longest-idle slot to refill


class Slots:
    def __init__(self, disk: LayoutStore | None, memory: MemoryStore, depth: int, device: torch.device,
                 slot_bytes: int, timeline=NO_TIMELINE):
        """disk is None when no streamed block lives there: the slots then need no host buffers."""
        self.disk = disk
        self.memory = memory
        self.timeline = timeline
        self.device = device
        self.on_cuda = device.type == "cuda"
        reads = disk is not None
        self.copy_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self._slots = [
            Slot(
                host=aligned_empty(slot_bytes, pin=self.on_cuda) if reads else None,
                device=torch.empty(slot_bytes, dtype=torch.uint8, device=device) if self.on_cuda else None,
            )
            for _ in range(depth)
        ]
        self._by_block: dict[str, Slot] = {}
        self._verified: set[str] = set()
        self._starts = 0

    def want(self, names: list[str]) -> None:
        """Makes sure these blocks are here or on their way, refilling slots that hold none of them
        (empty ones first, then the longest idle).

        1. pick a slot no block is running from; let its previous read, copy and compute finish
        2. a disk home: submit the read into the slot's host buffer
        3. on CUDA: queue the copy to the device buffer now if the bytes are there, else later
        """
        for name in names:
            if name in self._by_block:
                continue
            free = [slot for slot in self._slots if not slot.in_use and slot.block not in names]
            if not free:
                raise RuntimeError(f"no free slot to bring in {name}: more blocks wanted than the ring holds")
            slot = min(free, key=lambda s: (s.block is not None, s.started))
            self._empty(slot)
            self._starts += 1
            slot.block, slot.started = name, self._starts
            self._by_block[name] = slot
            if self.memory.holds(name):
                slot.source = self.memory.bytes_of(name)
            else:
                slot.submitted = time.perf_counter()
                slot.ticket = self.disk.submit(name, slot.host)
                slot.source = slot.host
            if self.on_cuda and slot.ticket is None:
                self._copy(slot)

    def advance(self) -> None:
        """Queues the copies of reads that have finished, so they overlap compute; never blocks."""
        if not self.on_cuda:
            return
        for slot in self._slots:
            if slot.ticket is not None:
                try:
                    finished = self.disk.finished(slot.ticket)
                except ZeroliteError:
                    slot.ticket = None  # spent: a failed read is waited for too
                    self._forget(slot)
                    raise
                if finished is not None:
                    slot.ticket = None
                    self._read_done(slot, finished)
                    self._copy(slot)

    def wait(self, name: str) -> torch.Tensor:
        """The block's bytes, ready for compute on the current stream (want(name) came first).

        1. wait for its read, if any is still in flight
        2. on CUDA: queue the copy if it is not queued yet; make compute wait for it
        """
        slot = self._by_block[name]
        if slot.ticket is not None:
            self._await(slot)
        slot.in_use = True
        if not self.on_cuda:
            return slot.source[: self.memory.entry(name).length]
        if slot.copied is None:
            self._copy(slot)
        torch.cuda.current_stream(self.device).wait_event(slot.copied)
        return slot.device[: self.memory.entry(name).length]

    def release(self, name: str) -> None:
        """Compute is done with the block (on CUDA: once the work queued so far has run)."""
        slot = self._by_block[name]
        slot.in_use = False
        if self.on_cuda:
            slot.computed = torch.cuda.Event()
            slot.computed.record(torch.cuda.current_stream(self.device))

    def drain(self) -> None:
        """Waits for every read in flight: no read may outlive the buffers it fills. A read that
        failed meanwhile is only dropped: nothing will use its bytes, and the error that matters
        (if any) is the one already on its way up."""
        for slot in self._slots:
            if slot.ticket is not None:
                try:
                    self._await(slot)
                except ZeroliteError:
                    pass
                self._forget(slot)

    def _await(self, slot: Slot) -> None:
        ticket, slot.ticket = slot.ticket, None  # spent once waited for, whether the read failed or not
        try:
            finished = self.disk.wait(ticket)
        except ZeroliteError:
            self._forget(slot)
            raise
        self._read_done(slot, finished)

    def _forget(self, slot: Slot) -> None:
        """The slot holds no block any more: a failed read's bytes must never be taken for it."""
        self._by_block.pop(slot.block, None)
        slot.block, slot.source, slot.copied = None, None, None

    def _read_done(self, slot: Slot, finished: float) -> None:
        entry = self.disk.entry(slot.block)
        self.timeline.add("read", slot.block, slot.submitted, finished, bytes=entry.length)
        if slot.block not in self._verified:
            # Once per block and run: CRC-32 runs at ~3.6 GB/s here, faster than the disk, and
            # catches a layout altered after convert before its bytes are used.
            self.disk.layout.check(entry, slot.host)
            self._verified.add(slot.block)

    def _empty(self, slot: Slot) -> None:
        if slot.ticket is not None:  # the engine is still writing into the host buffer
            self._await(slot)
        if slot.copied is not None and slot.source is slot.host:
            slot.copied.synchronize()  # the copy engine is still reading the host buffer
        self._forget(slot)

    def _copy(self, slot: Slot) -> None:
        nbytes = self.memory.entry(slot.block).length
        with torch.cuda.stream(self.copy_stream):
            if slot.computed is not None:
                self.copy_stream.wait_event(slot.computed)  # compute may still read the old block
            with self.timeline.span("copy", slot.block, stream=self.copy_stream, bytes=nbytes):
                slot.device[:nbytes].copy_(slot.source[:nbytes], non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(self.copy_stream)
