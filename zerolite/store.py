"""Where each block's bytes live between uses: in the layout on disk, or in host memory.

    disk = LayoutStore(layout, engine)        # submit(name, host_buffer) -> ticket, wait(ticket)
    ram = MemoryStore.load(layout, engine, names, pin=True)
    ram.bytes_of("layers.3")                  # the block's bytes, ready to copy or bind

Both hand out raw block bytes; turning them into tensors is layout.tensor_views' job.
"""

from __future__ import annotations

import contextlib

import torch

from zerolite.errors import ZeroliteError
from zerolite.io import IoEngine, aligned_empty
from zerolite.layout import Layout
from zerolite.manifest import BlockEntry


READ_TIMEOUT_S = 120.0  # a block read taking longer means a disk that stopped answering, not a slow one


class LayoutStore:
    """Blocks at home in a layout, read by the engine on demand with O_DIRECT.

    A failed read (EIO, a file cut short) or one that never finishes becomes a ZeroliteError that
    names the file and the cause; nothing waits for ever.
    """

    def __init__(self, layout: Layout, engine: IoEngine, timeout_s: float = READ_TIMEOUT_S):
        self.layout = layout
        self.engine = engine
        self.timeout_s = timeout_s
        self.bytes_read = 0

    def entry(self, name: str) -> BlockEntry:
        return self.layout.manifest.block(name)

    def submit(self, name: str, host_buffer: torch.Tensor) -> int:
        self.bytes_read += self.entry(name).length
        return self.layout.submit_block(name, self.engine, host_buffer)

    def finished(self, ticket: int) -> float | None:
        """When the read finished (it is then waited for), or None while it runs; never blocks."""
        try:
            return self.layout.wait(self.engine, ticket, timeout_s=0.0)
        except TimeoutError:
            return None

    def wait(self, ticket: int) -> float:
        """Blocks until the read is done; returns when it finished (perf_counter clock)."""
        try:
            return self.layout.wait(self.engine, ticket, timeout_s=self.timeout_s)
        except TimeoutError:
            raise ZeroliteError(
                f"reading {self.layout.data_path} has not finished after {self.timeout_s:.0f} s: the disk stopped "
                "answering; check it (dmesg) and run again"
            ) from None


class MemoryStore:
    """Blocks at home in host memory: each read once from the layout into its own aligned buffer,
    page-locked when pin is set so that copies to the GPU run at full PCIe speed."""

    def __init__(self, layout: Layout, buffers: dict[str, torch.Tensor]):
        self.layout = layout
        self._buffers = buffers

    @classmethod
    def load(cls, layout: Layout, engine: IoEngine, names: list[str], pin: bool, progress=None) -> MemoryStore:
        """Reads the named blocks, many in flight at once, and checks each against its checksum."""
        buffers, tickets = {}, []
        for name in names:
            entry = layout.manifest.block(name)
            buffers[name] = aligned_empty(entry.length, pin=pin)
            tickets.append(layout.submit_block(name, engine, buffers[name]))
        try:
            for number, (name, ticket) in enumerate(zip(names, tickets)):
                layout.wait(engine, ticket)
                layout.check(layout.manifest.block(name), buffers[name])
                if progress is not None:
                    progress.advance(layout.manifest.block(name).length)
        except ZeroliteError:
            with contextlib.suppress(ZeroliteError):  # the first failure is the one to report
                layout.wait_all(engine, tickets[number + 1:])  # reads still landing in buffers about to be freed
            raise
        return cls(layout, buffers)

    def entry(self, name: str) -> BlockEntry:
        return self.layout.manifest.block(name)

    def holds(self, name: str) -> bool:
        return name in self._buffers

    def bytes_of(self, name: str) -> torch.Tensor:
        return self._buffers[name]
