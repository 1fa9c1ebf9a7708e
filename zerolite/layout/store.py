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

import torch

from zerolite.errors import ZeroliteError
from zerolite.io.engine import ALIGNMENT, IoEngine, aligned_empty, pread_into
from zerolite.layout.folder import Layout, tensor_views
from zerolite.layout.manifest import BlockEntry

READ_TIMEOUT_S = 120.0  # a block read taking longer means a disk that stopped answering, not a slow one


class DiskStore:
    """Blocks at home in a layout, read by the engine with O_DIRECT. The one place that owns the
    engine's tickets, the time-out, each block's checksum and the translation of a failure (EIO, a
    file cut short, a disk that stopped answering) into one ZeroliteError naming file and cause.

    A block in place is several pieces of the checkpoint's shards, one read each; its ticket stands
    for all of them."""

    def __init__(self, layout: Layout, engine: IoEngine, timeout_s: float = READ_TIMEOUT_S):
        self.layout = layout
        self.engine = engine
        self.timeout_s = timeout_s
        self.bytes_read = 0          # bytes submitted through submit(): what streaming read
        self._verified: set[str] = set()
        self._pieces: dict[int, list[int]] = {}      # a block in place's ticket -> its reads still running
        self._finished: dict[int, float] = {}        # ... and when the latest one done so far finished

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
        tickets = []
        for path, size, offset, at, nbytes in self._piece_reads(entry, start, length):
            direct = max(min(offset + nbytes, size // ALIGNMENT * ALIGNMENT) - offset, 0)
            if direct:
                tickets.append(self.engine.submit(path, buffer[at:at + direct], offset))
            if direct < nbytes:
                self._read_tail(path, size, offset + direct, buffer[at + direct:at + nbytes])
        ticket = tickets[0] if tickets else self.engine.submit(self.layout.read_paths[0], buffer[:0], 0)
        self._pieces[ticket], self._finished[ticket] = tickets, 0.0
        return ticket

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

    def poll(self, ticket: int) -> float | None:
        """When the read finished (the ticket is then spent), or None while it runs; never blocks."""
        with self._failures():
            if ticket not in self._pieces:
                return self.engine.poll(ticket)
            running = self._pieces[ticket]
            while running:
                finished = self.engine.poll(running[0])
                if finished is None:
                    return None
                self._finished[ticket] = max(self._finished[ticket], finished)
                running.pop(0)
            del self._pieces[ticket]
            return self._finished.pop(ticket)

    def wait(self, ticket: int) -> float:
        """Blocks until the read is done; returns when it finished (perf_counter clock)."""
        if ticket not in self._pieces:
            return self._wait_one(ticket)
        running, finished = self._pieces.pop(ticket), self._finished.pop(ticket)
        return max([finished, *self._wait_every(running, self._wait_one)])

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

    def verify_part(self, name: str, part: str, data: torch.Tensor, crc32: int) -> None:
        """Checks part of a block read on its own (a mixture's dense part, or one expert) against
        its checksum, once per part and run."""
        key = f"{name} {part}"
        if key not in self._verified:
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
