"""Where each block's bytes live between uses: in the layout on disk, or in host memory.

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
from zerolite.io.engine import IoEngine, aligned_empty
from zerolite.layout.folder import Layout, tensor_views
from zerolite.layout.manifest import BlockEntry

READ_TIMEOUT_S = 120.0  # a block read taking longer means a disk that stopped answering, not a slow one


class DiskStore:
    """Blocks at home in a layout, read by the engine with O_DIRECT. The one place that owns the
    engine's tickets, the time-out, each block's checksum and the translation of a failure (EIO, a
    file cut short, a disk that stopped answering) into one ZeroliteError naming file and cause."""

    def __init__(self, layout: Layout, engine: IoEngine, timeout_s: float = READ_TIMEOUT_S):
        self.layout = layout
        self.engine = engine
        self.timeout_s = timeout_s
        self.bytes_read = 0          # bytes submitted through submit(): what streaming read
        self._verified: set[str] = set()

    def entry(self, name: str) -> BlockEntry:
        return self.layout.manifest.block(name)

    def submit(self, name: str, buffer: torch.Tensor, start: int = 0, length: int | None = None) -> int:
        """Starts reading the block's bytes [start, start + length) (all of them by default) into
        buffer (4 KiB aligned); returns the ticket."""
        entry = self.entry(name)
        length = entry.length - start if length is None else length
        self.bytes_read += length
        return self.engine.submit(self.layout.data_path, buffer[:length], entry.offset + start)

    def poll(self, ticket: int) -> float | None:
        """When the read finished (the ticket is then spent), or None while it runs; never blocks."""
        with self._failures():
            return self.engine.poll(ticket)

    def wait(self, ticket: int) -> float:
        """Blocks until the read is done; returns when it finished (perf_counter clock)."""
        with self._failures():
            try:
                return self.engine.wait(ticket, self.timeout_s)
            except TimeoutError:
                raise ZeroliteError(
                    f"reading {self.layout.data_path} has not finished after {self.timeout_s:.0f} s: the disk "
                    "stopped answering; check it (dmesg) and run again"
                ) from None

    def wait_all(self, tickets: list[int]) -> None:
        """Waits for every ticket, even after one failed (no read may outlive its buffer), then
        raises the first failure."""
        failure = None
        for ticket in tickets:
            try:
                self.wait(ticket)
            except ZeroliteError as e:
                failure = failure or e
        if failure is not None:
            raise failure

    def verify(self, name: str, buffer: torch.Tensor) -> None:
        """Checks the block's bytes against its checksum, once per block and run: CRC-32 runs
        faster than a disk reads, and catches a layout altered after convert before its bytes
        are used."""
        if name not in self._verified:
            self.verify_crc(name, zlib.crc32(buffer[: self.entry(name).length].numpy()))

    def verify_crc(self, name: str, crc32: int) -> None:
        """Checks a CRC-32 computed over the block's bytes (in pieces, say) against its checksum."""
        if crc32 != self.entry(name).crc32:
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
        return ZeroliteError(
            f"block {what} of layout {self.layout.folder} fails its checksum ({self.layout.manifest.data_file} "
            f"was altered or the disk returned bad data): convert the model again"
        )

    def read(self, name: str, buffer: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Reads one block (submit, wait, verify) and returns its tensors as views of buffer."""
        entry = self.entry(name)
        buffer = aligned_empty(entry.length) if buffer is None else buffer
        self.wait(self.submit(name, buffer))
        self.verify_crc(name, zlib.crc32(buffer[: entry.length].numpy()))  # every read() checks, not once per run
        return tensor_views(entry, buffer)

    @contextlib.contextmanager
    def _failures(self):
        try:
            yield
        except OSError as e:
            raise ZeroliteError(
                f"reading the layout failed: {' '.join(str(e).split())}: check the disk (dmesg), or convert the model "
                f"again (zerolite convert MODEL --path {self.layout.folder})"
            ) from e


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
            for number, (name, ticket) in enumerate(zip(names, tickets)):
                disk.wait(ticket)
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
