"""Where each block's bytes live between uses: in the layout on disk (its data file, or in place
the checkpoint's shards), or in host memory.

    disk = DiskStore(layout, engine)            # submit(name, buffer, start=0, length=None) -> ticket; poll / wait
    ram = MemoryStore.load(disk, names, device.pinned_empty)  # each block read once into host memory
                                                # from allocate(nbytes), here pinned on a GPU
    ram.bytes_of("layers.3")                    # the block's bytes, ready to copy or bind

Both hand out raw block bytes; turning them into tensors is zerolite.layout.folder.tensor_views' job.
"""

from __future__ import annotations

import contextlib
import zlib
from collections import deque
from dataclasses import dataclass, field

import torch

from zerolite.errors import ZeroliteError
from zerolite.io.engine import ALIGNMENT, IoEngine, aligned_empty, pread_into
from zerolite.layout.expert_parts import ExpertRead, expert_read
from zerolite.layout.folder import Layout, tensor_views
from zerolite.layout.manifest import BlockEntry

READ_TIMEOUT_S = 120.0  # a block read taking longer means a disk that stopped answering, not a slow one
SCRATCH_LIMIT = 512 << 20  # in place, experts' reads in flight at once land in scratch of at most this many
                           # bytes (at least one expert's): a whole layer read for host memory waits
                           # for its first experts to be placed before it reads the rest


@dataclass(eq=False)
class Landing:
    """Reads whose bytes go to one place: a block in place's pieces, straight into the buffer; one
    expert's parts, into scratch, then each copied to its place in the expert's extent."""
    tickets: list[int]
    finished: float = 0.0
    scratch: torch.Tensor | None = None
    into: torch.Tensor | None = None               # the buffer the block's bytes are read into
    copies: list[tuple[int, int, int]] = field(default_factory=list)  # (from in scratch, to in into, bytes)
    padding: list[tuple[int, int]] = field(default_factory=list)      # (start, end) in into: zeros


class DiskStore:
    """Blocks at home in a layout, read by the engine with O_DIRECT. The one place that owns the
    engine's tickets, the time-out, each block's checksum and the translation of a failure (EIO, a
    file cut short, a disk that stopped answering) into one ZeroliteError naming file and cause.

    A block in place is several pieces of the checkpoint's shards, one read each; its ticket stands
    for all of them. A mixture's layer in place has its experts' extents made as they are read:
    each expert's parts (zerolite.layout.expert_parts) are read into scratch and, once the read is
    done (polled or waited for), copied to their places."""

    def __init__(self, layout: Layout, engine: IoEngine, timeout_s: float = READ_TIMEOUT_S):
        self.layout = layout
        self.engine = engine
        self.timeout_s = timeout_s
        self.bytes_read = 0          # bytes submitted through submit(): what streaming read
        self._verified: set[str] = set()
        self._pending: dict[int, list[Landing]] = {}  # a block in place's ticket -> its reads
        self._in_flight: deque[Landing] = deque()     # experts' reads into scratch not yet placed, oldest first
        self._free_scratch: list[torch.Tensor] = []
        self._scratch_held = 0                        # bytes of scratch lent to reads in flight
        self._expert_reads: dict[tuple[str, int], ExpertRead] = {}

    def entry(self, name: str) -> BlockEntry:
        return self.layout.manifest.block(name)

    def submit(self, name: str, buffer: torch.Tensor, start: int = 0, length: int | None = None) -> int:
        """Starts reading the block's bytes [start, start + length) (all of them by default) into
        buffer (4 KiB aligned); returns the ticket."""
        entry = self.entry(name)
        length = entry.length - start if length is None else length
        self.bytes_read += length
        if not entry.pieces:
            return self.engine.submit(self.layout.data_path, buffer[:length], entry.offset + start)
        # The experts first: reading them may wait for earlier ones to make room in scratch, and
        # a failure then must leave no read of this call landing in buffer.
        landings = [self._read_expert(entry, expert, buffer, start, length)
                    for expert in self._experts_within(entry, start, length)]
        tickets = []
        for path, size, offset, at, nbytes in self._piece_reads(entry, start, length):
            tickets += self._read(path, size, offset, buffer[at:at + nbytes])
        if not tickets and not any(landing.tickets for landing in landings):  # a ticket to stand for none
            tickets.append(self.engine.submit(self.layout.read_paths[0], buffer[:0], 0))
        landings.insert(0, Landing(tickets))
        ticket = next(ticket for landing in landings for ticket in landing.tickets)
        self._pending[ticket] = landings
        return ticket

    def _read(self, path: str, size: int, offset: int, into: torch.Tensor) -> list[int]:
        """Starts reading into from the file at offset (4 KiB aligned): its tickets (none where it
        all lies in the file's last, unaligned page, which _read_tail reads at once)."""
        direct = max(min(offset + into.numel(), size // ALIGNMENT * ALIGNMENT) - offset, 0)
        if direct < into.numel():
            self._read_tail(path, size, offset + direct, into[direct:])
        return [self.engine.submit(path, into[:direct], offset)] if direct else []

    @staticmethod
    def _experts_within(entry: BlockEntry, start: int, length: int) -> range:
        """The experts of a block in place whose extents overlap its bytes [start, start + length)."""
        area = entry.experts
        if area is None or area.sources is None or start + length <= area.offset:
            return range(0)
        return range(max(start - area.offset, 0) // area.stride, (start + length - 1 - area.offset) // area.stride + 1)

    def _read_expert(self, entry: BlockEntry, expert: int, buffer: torch.Tensor, start: int, length: int) -> Landing:
        """Starts reading one expert's parts: their whole pages that lie as in the shards straight
        into buffer where it holds the whole extent, the rest into scratch; the landing says where
        those go in buffer (which holds the block's bytes [start, start + length))."""
        area = entry.experts
        extent = area.offset + expert * area.stride - start  # in buffer
        direct = 0 <= extent and extent + area.stride <= length and (buffer.data_ptr() + extent) % ALIGNMENT == 0
        key = (entry.name, expert, direct)
        if key not in self._expert_reads:
            self._expert_reads[key] = expert_read(area.sources, expert, area.stride, direct)
        plan = self._expert_reads[key]
        landing = Landing([], scratch=self._scratch(plan.scratch_bytes) if plan.reads else None, into=buffer[:length])
        for source, to, nbytes in plan.copies:
            low, high = max(extent + to, 0), min(extent + to + nbytes, length)
            if low < high:
                landing.copies.append((source + low - extent - to, low, high - low))
        landing.padding = [(max(extent + a, 0), min(extent + b, length)) for a, b in plan.padding
                           if extent + a < length and extent + b > 0]
        reads, at = [], 0
        for shard, offset, nbytes, to in plan.direct:
            reads.append((shard, offset, buffer[extent + to:extent + to + nbytes]))
        for shard, offset, nbytes in plan.reads:
            reads.append((shard, offset, landing.scratch[at:at + nbytes]))
            at += nbytes
        shards = self.layout.manifest.shards
        for shard, offset, into in sorted(reads, key=lambda read: read[:2]):  # in file order: a disk reads ahead
            landing.tickets += self._read(shards[shard].path, shards[shard].size, offset, into)
        if landing.scratch is not None:
            self._in_flight.append(landing)
        return landing

    def _scratch(self, nbytes: int) -> torch.Tensor:
        """A scratch buffer of at least nbytes; where experts in flight hold SCRATCH_LIMIT already,
        once the oldest of them are placed."""
        while self._in_flight and self._scratch_held + nbytes > SCRATCH_LIMIT:
            self._settle(self._in_flight[0], block=True)
        fits = [i for i, buffer in enumerate(self._free_scratch) if buffer.numel() >= nbytes]
        if fits:
            buffer = self._free_scratch.pop(min(fits, key=lambda i: self._free_scratch[i].numel()))
        else:
            buffer = aligned_empty(nbytes + 2 * ALIGNMENT)  # room for a neighbour a page or two longer
        self._scratch_held += buffer.numel()
        return buffer

    def _settle(self, landing: Landing, block: bool) -> bool:
        """Whether the landing's reads are done, waiting for them if block; once they are, an
        expert's parts read into scratch are copied to their places (its padding zeroed) and the
        scratch is free again."""
        if landing.scratch is None and not landing.tickets and not landing.padding:
            return True
        with self._failures():
            if block:
                tickets, landing.tickets = landing.tickets, []
                try:
                    landing.finished = max([landing.finished, *self._wait_every(tickets, self._wait_one)])
                except ZeroliteError:
                    self._release(landing)  # every read waited for: the scratch may go back
                    raise
            else:
                while landing.tickets:
                    try:
                        finished = self.engine.poll(landing.tickets[0])
                    except OSError:
                        landing.tickets.pop(0)
                        self._forget(landing)  # its other reads may still land in the scratch: never lent again
                        raise
                    if finished is None:
                        return False
                    landing.finished = max(landing.finished, finished)
                    landing.tickets.pop(0)
        if landing.scratch is not None or landing.padding:
            # numpy's copy: one memcpy on this thread. torch's copy_ of bytes splits it over its
            # OpenMP threads, which on a busy 2-core machine copied 4x slower (1.0 against 4.6 GB/s).
            into = landing.into.numpy()
            scratch = landing.scratch.numpy() if landing.scratch is not None else None
            for source, to, nbytes in landing.copies:
                into[to:to + nbytes] = scratch[source:source + nbytes]
            for low, high in landing.padding:
                into[low:high] = 0
            landing.padding = []
            self._release(landing)
        return True

    def _release(self, landing: Landing) -> None:
        if landing.scratch is not None:
            self._free_scratch.append(landing.scratch)
            self._forget(landing)

    def _forget(self, landing: Landing) -> None:
        if landing.scratch is not None:
            self._scratch_held -= landing.scratch.numel()
            landing.scratch = None
            self._in_flight.remove(landing)

    def _piece_reads(self, entry: BlockEntry, start: int, length: int):
        """(path, its size, file offset, offset in the buffer, bytes) of each piece's share of
        the block's bytes [start, start + length)."""
        at = 0
        for piece in entry.pieces:
            low, high = max(start, at), min(start + length, at + piece.length)
            if low < high:
                shard = self.layout.manifest.shards[piece.shard]
                yield shard.path, shard.size, piece.offset + low - at, low - start, high - low
            at += piece.length

    def _read_tail(self, path: str, size: int, offset: int, into: torch.Tensor) -> None:
        """A shard's last bytes, which end inside an aligned page (O_DIRECT reads whole pages):
        read through the page cache, under 4 KiB once per block, and past the end zeros."""
        into.zero_()
        with self._failures():
            pread_into(path, into[:max(size - offset, 0)], offset)

    def cancel(self, ticket: int) -> int:
        """Gives up what has not started of the read (its bytes are then never to be used: an
        expert's parts in scratch are not copied to their places); returns the bytes spared,
        which no longer count as read. The ticket is still waited for (or polled) as before."""
        landings = self._pending.get(ticket)
        tickets = [ticket] if landings is None else [t for landing in landings for t in landing.tickets]
        with self._failures():
            spared = sum(self.engine.cancel(t) for t in tickets)
        for landing in landings or []:
            landing.copies, landing.padding = [], []
        self.bytes_read -= spared
        return spared

    def poll(self, ticket: int) -> float | None:
        """When the read finished (the ticket is then spent), or None while it runs; never blocks."""
        if ticket not in self._pending:
            with self._failures():
                return self.engine.poll(ticket)
        landings = self._pending[ticket]
        try:
            if not all([self._settle(landing, block=False) for landing in landings]):
                return None
        except ZeroliteError:
            del self._pending[ticket]
            raise
        del self._pending[ticket]
        return max(landing.finished for landing in landings)

    def wait(self, ticket: int) -> float:
        """Blocks until the read is done; returns when it finished (perf_counter clock)."""
        if ticket not in self._pending:
            return self._wait_one(ticket)
        landings = self._pending.pop(ticket)
        self._wait_every(landings, lambda landing: self._settle(landing, block=True))
        return max(landing.finished for landing in landings)

    def _wait_one(self, ticket: int) -> float:
        with self._failures():
            try:
                return self.engine.wait(ticket, self.timeout_s)
            except TimeoutError:
                raise ZeroliteError(
                    f"reading {self._where} has not finished after {self.timeout_s:.0f} s: the disk "
                    "stopped answering; check it (dmesg) and run again"
                ) from None

    @property
    def _where(self) -> str:
        if self.layout.manifest.in_place:
            return f"the checkpoint in {self.layout.side_folder}"
        return str(self.layout.data_path)

    def wait_all(self, tickets: list[int]) -> None:
        """Waits for every ticket, even after one failed (no read may outlive its buffer), then
        raises the first failure."""
        self._wait_every(tickets, self.wait)

    @staticmethod
    def _wait_every(tickets: list[int], wait) -> list[float]:
        """wait(ticket) for each, even after one failed (no read may outlive its buffer); when
        each finished, or the first failure."""
        finished, failure = [], None
        for ticket in tickets:
            try:
                finished.append(wait(ticket))
            except ZeroliteError as e:
                failure = failure or e
        if failure is not None:
            raise failure
        return finished

    def verify(self, name: str, buffer: torch.Tensor) -> None:
        """Checks the block's bytes against its checksum, once per block and run: CRC-32 runs
        faster than a disk reads, and catches a layout altered after convert before its bytes
        are used."""
        if name not in self._verified:
            self.verify_crc(name, zlib.crc32(buffer[: self.entry(name).length].numpy()))

    def verify_crc(self, name: str, crc32: int) -> None:
        """Checks a CRC-32 computed over the block's bytes (in pieces, say) against its checksum
        (a block in place has none until `zerolite verify` records one)."""
        if self.entry(name).crc32 not in (None, crc32):
            raise self._damaged(name)
        self._verified.add(name)

    def verify_part(self, name: str, part: str, data: torch.Tensor, crc32: int | None) -> None:
        """Checks part of a block read on its own (a mixture's dense part, or one expert) against
        its checksum, once per part and run (in place, none until `zerolite verify` records one)."""
        key = f"{name} {part}"
        if key not in self._verified and crc32 is not None:
            if zlib.crc32(data.numpy()) != crc32:
                raise self._damaged(f"{name} ({part})")
            self._verified.add(key)

    def _damaged(self, what: str) -> ZeroliteError:
        if self.layout.manifest.in_place:
            return ZeroliteError(f"block {what} of the checkpoint in {self.layout.side_folder} fails the checksum "
                                 "`zerolite verify` recorded (a shard was altered or the disk returned bad data): "
                                 "download the model again")
        return ZeroliteError(
            f"block {what} of layout {self.layout.folder} fails its checksum ({self.layout.manifest.data_file} "
            f"was altered or the disk returned bad data): convert the model again"
        )

    def read(self, name: str, buffer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Reads one block (submit, wait, verify) and returns its tensors as views of buffer."""
        entry = self.entry(name)
        buffer = aligned_empty(entry.length, huge_pages=False) if buffer is None else buffer  # read into once
        self.wait(self.submit(name, buffer))
        self.verify_crc(name, zlib.crc32(buffer[: entry.length].numpy()))  # every read() checks, not once per run
        return tensor_views(entry, buffer)

    @contextlib.contextmanager
    def _failures(self):
        try:
            yield
        except OSError as e:
            fix = ("download the model again" if self.layout.manifest.in_place
                   else f"convert the model again (zerolite convert MODEL --path {self.layout.folder})")
            raise ZeroliteError(f"reading the layout failed: {' '.join(str(e).split())}: "
                                f"check the disk (dmesg), or {fix}") from e


class MemoryStore:
    """Blocks at home in host memory: each read once from the layout into its own buffer, pinned
    where the device copies from host memory, so that copies run at full link speed."""

    def __init__(self, buffers: dict[str, torch.Tensor]):
        self._buffers = buffers

    @classmethod
    def load(cls, disk: DiskStore, names: list[str], allocate=aligned_empty, progress=None) -> MemoryStore:
        """Reads the named blocks, many in flight at once, into buffers from allocate(nbytes), and
        checks each against its checksum."""
        buffers, tickets = {}, []
        for name in names:
            buffers[name] = allocate(disk.entry(name).length)
            tickets.append(disk.submit(name, buffers[name]))
        try:
            for number, name in enumerate(names):
                disk.wait(tickets[number])
                disk.verify(name, buffers[name])
                if progress is not None:
                    progress.advance(disk.entry(name).length)
        except ZeroliteError:
            with contextlib.suppress(ZeroliteError):  # the first failure is the one to report
                disk.wait_all(tickets[number + 1:])  # reads still landing in buffers about to be freed
            raise
        return cls(buffers)

    def holds(self, name: str) -> bool:
        return name in self._buffers

    def bytes_of(self, name: str) -> torch.Tensor:
        return self._buffers[name]
