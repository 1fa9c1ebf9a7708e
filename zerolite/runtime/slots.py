"""The ring of buffers streamed blocks pass through on their way to compute.

    slots = Slots(manifest, disk, memory, depth=2, device=CudaDevice(torch.device("cuda")), slot_bytes=n)
    slots.want(["layers.3", "layers.4"]) # reads (and copies) begin; returns at once
    data = slots.wait("layers.3")        # the block's bytes where compute can use them
    ...                                  # run the block
    slots.done_with("layers.3")          # its slot may be refilled once compute is done with it

A slot holds one block. Its bytes come from its home: a block on disk is read by the engine into
the slot's host buffer (pinned on a GPU); a block in host memory already has them there. Where the
device's memory is separate (a GPU) they are then copied into the slot's device buffer on a stream
of their own, ordered by events: compute waits for the copy, the next copy into the slot waits for
compute, and the engine reads into a host buffer only once the copy from it is done. On a CPU
device the host bytes are what compute uses: no copy at all.

On a GPU the host buffers are staging buffers apart from the ring (as many as it has slots): a slot
borrows one for a block from disk and gives it back once the copy from it is done, and
read_ahead() starts the reads of the disk's next blocks into those free, however far ahead of the
ring they lie. The host queues a step's layers only so far ahead of the GPU (CUDA blocks a launch
past about a thousand queued; a step boundary waits for the step), so a disk read started only
when the ring reaches its block left the disk idle while the layers held in memory before it were
copied and computed (tests/test_timed_device.py).

A mixture's layer streamed per expert (zerolite.moe.experts) comes in two parts: want() brings its
dense part; want_experts() and wait_experts() bring the experts a step's router picked (or a guess
at them) into their places in the same slot, from the expert cache, the block's memory home or the
disk. The experts' tensors are bound over the whole slot: rows not brought are never read. On a
GPU their copies run on a stream of their own: the router's picks are known only once the layer
runs, and on the one copy stream they would queue behind the dense parts read ahead for the next
layers, the layer waiting the while. A block whose experts the host computes (host_experts:
zerolite.moe.host_experts) keeps them in its host bytes (host_bytes()) and copies none.

Slots never decide which block comes next; the executor does.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from zerolite.errors import ZeroliteError
from zerolite.io.device import Device
from zerolite.layout.manifest import Manifest
from zerolite.layout.placement import Move, device_placement
from zerolite.layout.store import DiskStore, MemoryStore
from zerolite.moe.cache import ExpertCache
from zerolite.runtime.timeline import NO_TIMELINE


@dataclass(eq=False)
class ExpertFetch:
    """One expert of a block in a slot: on its way, or there."""
    start: int                           # its extent in the block
    length: int
    ticket: int | None = None            # its read from disk, not yet waited for
    submitted: float = 0.0
    copied: object | None = None         # the device's event for its host-to-device copy, once queued
    dropped: bool = False                # a guess the router did not take: its read given up, its bytes never used


@dataclass(eq=False)
class Ahead:
    """A block's read from disk into a staging buffer, started before a slot wanted it."""
    host: torch.Tensor
    ticket: int
    submitted: float


@dataclass(eq=False)
class Slot:
    host: torch.Tensor | None            # the read target, for a disk home (on a GPU a staging buffer, lent)
    device: torch.Tensor | None          # the copy target, where device memory is separate
    block: str | None = None
    source: torch.Tensor | None = None   # where the block's bytes are in host memory
    ticket: int | None = None            # engine read into host, not yet waited for
    submitted: float = 0.0               # when that read was submitted (perf_counter)
    copied: object | None = None         # the device's event for the host-to-device copy, once queued
    experts_copied: object | None = None  # ... for the last of its experts' copies (on the experts' stream)
    computed: object | None = None       # ... and for compute's last use of the device buffer
    in_use: bool = False
    started: int = 0                     # for picking the longest-idle slot to refill
    experts: dict[int, ExpertFetch] = field(default_factory=dict)  # a block streamed per expert: those brought


class Slots:
    def __init__(self, manifest: Manifest, disk: DiskStore | None, memory: MemoryStore, depth: int, device: Device,
                 slot_bytes: int, timeline=NO_TIMELINE, per_expert: frozenset[str] = frozenset(),
                 cache: ExpertCache | None = None, device_bytes: int | None = None,
                 host_experts: frozenset[str] = frozenset()):
        """disk is None when no streamed block lives there: the slots then need no host buffers.
        per_expert names the blocks whose experts come apart from their dense part; cache keeps
        experts read from disk across steps. device_bytes: each device buffer's size (default
        slot_bytes): a block laid out afresh there (zerolite.layout.placement) may take more, and
        one whose experts the host computes takes its dense part alone.
        host_experts: those of per_expert whose experts the host computes, which never go to the device."""
        self.manifest = manifest
        self.disk = disk
        self.memory = memory
        self.timeline = timeline
        self.device = device
        self.separate = device.separate_memory
        self.per_expert = per_expert
        self.cache = cache
        self.host_experts = host_experts if self.separate else frozenset()
        self.expert_bytes_read = 0  # of disk reads, those of experts (the rest: dense parts and whole blocks)
        self.expert_bytes_copied = 0  # of copies to the device, those of experts
        self.expert_bytes_spared = 0  # of experts' reads, the bytes given up (guesses the router did not take)
        reads = disk is not None
        self.copy_stream = device.new_stream() if self.separate else None
        self.expert_stream = device.new_stream() if self.separate and per_expert - self.host_experts else None
        self._slots = [
            Slot(
                host=device.pinned_empty(slot_bytes) if reads and not self.separate else None,
                device=device.empty(slot_bytes if device_bytes is None else device_bytes) if self.separate else None,
            )
            for _ in range(depth)
        ]
        # On a GPU: the free staging buffers, and those lent to reads ahead of the ring (block -> read)
        self._staging = [device.pinned_empty(slot_bytes) for _ in range(depth)] if reads and self.separate else []
        self._ahead: dict[str, Ahead] = {}
        self._by_block: dict[str, Slot] = {}
        self._starts = 0
        if self.separate:
            # The device buffers were allocated on the compute stream; the copy stream writes them
            # first, so it comes after whatever compute queued before they were handed out.
            for stream in self._streams:
                device.wait_stream(stream, device.compute_stream())

    def read_ahead(self, names: list[str]) -> None:
        """On a GPU, starts reading these blocks from disk (in order, as far as free staging buffers
        go) before the ring wants them; elsewhere, or for a block streamed per expert, nothing."""
        for name in names:
            if (not self.separate or self.disk is None or name in self._by_block or name in self._ahead
                    or self.memory.holds(name) or name in self.per_expert):
                continue
            if not self._staging:
                return
            host = self._staging.pop()
            self._ahead[name] = Ahead(host, self.disk.submit(name, host, 0, self._needed(name)), time.perf_counter())

    def want(self, names: list[str]) -> None:
        """Makes sure these blocks are here or on their way, refilling slots that hold none of them
        (empty ones first, then the longest idle).

        1. pick a slot no block is running from; let its previous read, copy and compute finish
        2. a disk home: submit the read into the slot's host buffer
        3. separate device memory: queue the copy to the device buffer now if the bytes are there, else later
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
            elif name in self._ahead:
                ahead = self._ahead.pop(name)
                slot.host, slot.ticket, slot.submitted = ahead.host, ahead.ticket, ahead.submitted
                slot.source = ahead.host
            else:
                if self.separate:
                    slot.host = self._staging_buffer()
                slot.submitted = time.perf_counter()
                slot.ticket = self.disk.submit(name, slot.host, 0, self._needed(name))
                slot.source = slot.host
            if self.separate and slot.ticket is None:
                self._copy(slot)

    def _staging_buffer(self) -> torch.Tensor:
        """A free staging buffer; with none, the one lent to the read ahead wanted last (its read
        waited for and dropped): the ring's own blocks come first."""
        if not self._staging:
            _, ahead = self._ahead.popitem()
            self._drop_ahead(ahead)
        return self._staging.pop()

    def _drop_ahead(self, ahead: Ahead) -> None:
        """Waits for a read ahead no slot took and gives its buffer back; a failed one is only dropped."""
        try:
            self.disk.wait(ahead.ticket)
        except ZeroliteError:
            pass
        self._staging.append(ahead.host)

    def want_experts(self, name: str, experts) -> None:
        """Makes sure these experts of a block already wanted are here or on their way: copied in
        from the expert cache, or read from disk into their place in the slot (where the block's
        home is host memory they are there already, and only a GPU needs them copied)."""
        slot = self._by_block[name]
        area = self.manifest.block(name).experts
        for expert in experts:
            if expert in slot.experts and slot.experts[expert].dropped:
                self._forget_dropped(slot, expert)
            if expert in slot.experts:
                continue
            fetch = ExpertFetch(*area.extent(expert))
            slot.experts[expert] = fetch
            if not self.memory.holds(name):
                cached = self.cache.get((name, expert)) if self.cache is not None else None
                if cached is not None:
                    self._expert_bytes(slot, fetch).copy_(cached)
                else:
                    fetch.submitted = time.perf_counter()
                    fetch.ticket = self.disk.submit(name, self._expert_bytes(slot, fetch), fetch.start, fetch.length)
                    self.expert_bytes_read += fetch.length
            if self.separate and fetch.ticket is None and name not in self.host_experts:
                fetch.copied = self._copy_expert(slot, fetch)

    def drop_experts(self, name: str, kept) -> None:
        """The block's router has spoken: the reads of its experts not in kept (guesses it did not
        take) give up what has not started yet, so that the disk reads what the step needs instead."""
        slot = self._by_block[name]
        for expert, fetch in slot.experts.items():
            if fetch.ticket is not None and not fetch.dropped and expert not in kept:
                fetch.dropped = True
                spared = self.disk.cancel(fetch.ticket)
                self.expert_bytes_read -= spared
                self.expert_bytes_spared += spared

    def _forget_dropped(self, slot: Slot, expert: int) -> None:
        """Before an expert dropped is asked for again: what its read had under way is done."""
        try:
            self.disk.wait(slot.experts.pop(expert).ticket)
        except ZeroliteError:
            pass  # its bytes were never to be used

    def wait_experts(self, name: str, experts) -> None:
        """These experts' bytes are ready for compute on the compute stream (want_experts came first)."""
        slot = self._by_block[name]
        compute = self.device.compute_stream()
        for expert in experts:
            fetch = slot.experts[expert]
            with self._stalled(f"{name} expert {expert}", reading=fetch.ticket is not None):
                if fetch.ticket is not None:
                    self._land_expert(slot, expert, block=True)
                if self.separate and name not in self.host_experts:
                    self.device.wait_event(compute, fetch.copied)

    def first_here(self, name: str, experts: list[int]) -> tuple[int, bool]:
        """Where host memory is the device's: waits for the soonest of these experts (one here
        already, else the one whose read started first) and returns it, with whether the others
        are all here too (their reads polled, never waited for)."""
        slot = self._by_block[name]
        fetches = {expert: slot.experts[expert] for expert in experts}
        soonest = min(experts, key=lambda e: (fetches[e].ticket is not None, fetches[e].submitted))
        self.wait_experts(name, [soonest])
        for expert in experts:
            if expert != soonest and fetches[expert].ticket is not None:
                self._land_expert(slot, expert, block=False)
        return soonest, all(fetches[e].ticket is None for e in experts)

    def host_bytes(self, name: str) -> torch.Tensor:
        """A block of host_experts' bytes in host memory, where its experts waited for lie."""
        return self._by_block[name].source[:self.manifest.block(name).length]

    def holds(self, name: str) -> bool:
        """Whether the block is in a slot (here, or on its way)."""
        return name in self._by_block

    def advance(self) -> None:
        """Queues the copies of reads that have finished, so they overlap compute; never blocks."""
        if not self.separate:
            return
        for slot in self._slots:
            self._poll(slot)
            for expert, fetch in list(slot.experts.items()):
                if fetch.ticket is not None and not fetch.dropped:
                    self._land_expert(slot, expert, block=False)

    def wait(self, name: str) -> torch.Tensor:
        """The block's bytes, ready for compute on the compute stream (want(name) came first).

        1. wait for its read, if any is still in flight (the host waits: on a CPU device that is
           compute waiting, on a GPU the host that queues compute)
        2. separate device memory: queue the copy if it is not queued yet; make compute wait for
           it on the device
        """
        slot = self._by_block[name]
        entry = self.manifest.block(name)
        with self._stalled(name, reading=slot.ticket is not None):
            if slot.ticket is not None:
                self._await(slot)
            slot.in_use = True
            if not self.separate:
                return slot.source[:entry.length]
            if slot.copied is None:
                self._copy(slot)
            self.device.wait_event(self.device.compute_stream(), slot.copied)
        return slot.device[:device_placement(entry).entry.length]

    @contextlib.contextmanager
    def _stalled(self, what: str, reading: bool):
        """Times compute waiting for what's bytes. On a CPU, the host's wait for the read. On a GPU,
        on the compute stream, from before the host waits for the read: the span starts when the
        device has run the work queued before it, so a device left idle while the host waits for
        the disk counts as waiting (a span queued after the host's wait would start late and miss
        it, and a disk-bound step would pass for compute); the host's own wait is "read wait"."""
        if not self.separate:
            with self.timeline.span("wait", what) if reading else contextlib.nullcontext():
                yield
            return
        with self.timeline.span("wait", what, stream=self.device.compute_stream()):
            with self.timeline.span("read wait", what) if reading else contextlib.nullcontext():
                yield

    def done_with(self, name: str) -> None:
        """Compute is done with the block (on a GPU: once the work queued so far has run)."""
        slot = self._by_block[name]
        slot.in_use = False
        if self.separate:
            slot.computed = self.device.record(self.device.compute_stream())

    def drain(self) -> None:
        """Waits for every read in flight: no read may outlive the buffers it fills. A read that
        failed meanwhile is only dropped: nothing will use its bytes, and the error that matters
        (if any) is the one already on its way up."""
        for ahead in self._ahead.values():
            self._drop_ahead(ahead)
        self._ahead = {}
        for slot in self._slots:
            if slot.ticket is not None or any(f.ticket is not None for f in slot.experts.values()):
                try:
                    self._wait_for_reads(slot)
                except ZeroliteError:
                    pass
                self._forget(slot)

    def close(self) -> None:
        """Before the buffers go: reads in flight are waited for, and so are copies (the read-ahead
        may have queued copies for a forward that never comes). A copy still running would read a
        host buffer about to be unpinned and unmapped, and write a device buffer the allocator is
        about to hand to the next allocation."""
        self.drain()
        for stream in self._streams:
            self.device.synchronize(stream)

    @property
    def _streams(self) -> list:
        """The streams copies into the slots run on."""
        return [stream for stream in (self.copy_stream, self.expert_stream) if stream is not None]

    def _await(self, slot: Slot) -> None:
        ticket, slot.ticket = slot.ticket, None  # spent once waited for, whether the read failed or not
        try:
            finished = self.disk.wait(ticket)
        except ZeroliteError:
            self._forget(slot)
            raise
        self._read_done(slot, finished)

    def _poll(self, slot: Slot) -> None:
        """If the block's read into the slot has finished: checks it and queues its copy; never blocks."""
        if slot.ticket is None:
            return
        try:
            finished = self.disk.poll(slot.ticket)
        except ZeroliteError:
            slot.ticket = None  # spent: a failed read is waited for too
            self._forget(slot)
            raise
        if finished is not None:
            slot.ticket = None
            self._read_done(slot, finished)
            self._copy(slot)

    def _land_expert(self, slot: Slot, expert: int, block: bool) -> None:
        """Once the expert's read is done (waiting for it if block): checks its bytes, keeps them
        in the cache, queues their copy."""
        fetch = slot.experts[expert]
        try:
            finished = self.disk.wait(fetch.ticket) if block else self.disk.poll(fetch.ticket)
            if finished is None:
                return
            fetch.ticket = None
            self.timeline.add("read", f"{slot.block} expert {expert}", fetch.submitted, finished, bytes=fetch.length)
            data = self._expert_bytes(slot, fetch)
            self.disk.verify_part(slot.block, f"expert {expert}", data,
                                  self.manifest.block(slot.block).experts.crc32s[expert])
        except ZeroliteError:
            del slot.experts[expert]  # the ticket is spent; its bytes must never be taken for the expert's
            raise
        if self.cache is not None:
            self.cache.put((slot.block, expert), data)
        if self.separate and slot.block not in self.host_experts:
            fetch.copied = self._copy_expert(slot, fetch)

    def _expert_bytes(self, slot: Slot, fetch: ExpertFetch) -> torch.Tensor:
        return slot.source[fetch.start : fetch.start + fetch.length]

    def _needed(self, name: str) -> int:
        """The bytes want() brings: a block streamed per expert brings its dense part only."""
        entry = self.manifest.block(name)
        return entry.dense_length if name in self.per_expert else entry.length

    def _wait_for_reads(self, slot: Slot) -> None:
        """Waits for every read into the slot's host buffer: the block's and its experts'."""
        failure = None
        for ticket in [slot.ticket] + [f.ticket for f in slot.experts.values()]:
            if ticket is not None:
                try:
                    self.disk.wait(ticket)
                except ZeroliteError as e:
                    failure = failure or e
        slot.ticket = None
        for fetch in slot.experts.values():
            fetch.ticket = None
        if failure is not None:
            self._forget(slot)
            raise failure

    def _forget(self, slot: Slot) -> None:
        """The slot holds no block any more: a failed read's bytes must never be taken for it."""
        self._by_block.pop(slot.block, None)
        slot.block, slot.source, slot.copied, slot.experts_copied = None, None, None, None
        slot.experts = {}

    def _read_done(self, slot: Slot, finished: float) -> None:
        needed = self._needed(slot.block)
        self.timeline.add("read", slot.block, slot.submitted, finished, bytes=needed)
        area = self.manifest.block(slot.block).experts
        if slot.block in self.per_expert:
            self.disk.verify_part(slot.block, "dense part", slot.host[:needed], area.dense_crc32)
        else:
            self.disk.verify(slot.block, slot.host)

    def _empty(self, slot: Slot) -> None:
        self._wait_for_reads(slot)  # the engine may still be writing into the host buffer
        if slot.source is slot.host:  # the engine may not write into the host buffer while a copy reads it
            for copied in [slot.copied] + [f.copied for f in slot.experts.values()]:
                if copied is not None:
                    copied.synchronize()
        if self.separate and slot.host is not None:  # a staging buffer, lent for the block leaving
            self._staging.append(slot.host)
            slot.host = None
        if self.expert_stream is not None:
            # The next block's copies into the slot, on either stream, come after the last ones on
            # the other (compute, which orders them otherwise, may never have run the block).
            if slot.experts_copied is not None:
                self.device.wait_event(self.copy_stream, slot.experts_copied)
            if slot.copied is not None:
                self.device.wait_event(self.expert_stream, slot.copied)
        self._forget(slot)

    def _copy(self, slot: Slot) -> None:
        """Queues the copy of what want() brings to the device, each tensor to its place there
        (zerolite.layout.placement: a layout in place's tensors move to 256-byte offsets)."""
        placed = device_placement(self.manifest.block(slot.block))
        slot.copied = self._copy_moves(slot, placed.within(0, self._needed(slot.block)))

    def _copy_expert(self, slot: Slot, fetch: ExpertFetch):
        """Queues the copy of one expert's bytes to their place on the device (zerolite.layout.placement:
        after the dense part laid out afresh, its tensors at 256-byte offsets), on the experts' stream."""
        moves = device_placement(self.manifest.block(slot.block)).within(fetch.start, fetch.length)
        slot.experts_copied = self._copy_moves(slot, moves, self.expert_stream)
        self.expert_bytes_copied += fetch.length
        return slot.experts_copied

    def _copy_moves(self, slot: Slot, moves: list[Move], stream=None):
        """Queues the copies of the block's bytes to the device, one per move, on stream (the copy
        stream by default); returns the event of the last."""
        stream = self.copy_stream if stream is None else stream
        if slot.computed is not None:
            self.device.wait_event(stream, slot.computed)  # compute may still read the old block
        with self.timeline.span("copy", slot.block, stream=stream, bytes=sum(move.length for move in moves)):
            for move in moves:
                self.device.copy(slot.device[move.to:move.to + move.length],
                                 slot.source[move.start:move.start + move.length], stream)
        return self.device.record(stream)
