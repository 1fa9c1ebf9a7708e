"""A converted layout, read back: any block into aligned memory through the I/O engine.

    layout = Layout.open("/nvme/bloom")
    tensors = layout.read_block("layers.3", engine, verify=True)
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from zerolite.errors import ZeroliteError
from zerolite.io import IoEngine, aligned_empty
from zerolite.manifest import DTYPES, MANIFEST, BlockEntry, Manifest


class Layout:
    def __init__(self, folder: Path, manifest: Manifest):
        self.folder = folder
        self.manifest = manifest
        self.data_path = folder / manifest.data_file

    @classmethod
    def open(cls, folder: str | Path) -> Layout:
        """Validates the manifest and the size of the data file; reads no weights."""
        folder = Path(folder).expanduser()
        manifest_path = folder / MANIFEST
        if not manifest_path.is_file():
            hint = " (a conversion into it did not finish: run zerolite convert again)" if (folder / "convert.journal").exists() else ""
            raise ZeroliteError(f"no zerolite layout at {folder}{hint}: create one with zerolite convert MODEL --path {folder}")
        manifest = Manifest.from_json(manifest_path.read_text(), manifest_path)
        layout = cls(folder, manifest)
        size = layout.data_path.stat().st_size if layout.data_path.is_file() else 0
        if size < manifest.data_bytes:
            raise ZeroliteError(
                f"layout {folder} is damaged: {manifest.data_file} is {size} bytes but the manifest needs "
                f"{manifest.data_bytes}: convert the model again (zerolite convert MODEL --path {folder})"
            )
        return layout

    @property
    def blocks(self) -> tuple[BlockEntry, ...]:
        return self.manifest.blocks

    def submit_block(self, name: str, engine: IoEngine, buffer: torch.Tensor) -> int:
        """Starts reading a block into buffer (aligned, at least the block's length); returns the ticket."""
        block = self.manifest.block(name)
        return engine.submit(self.data_path, buffer[: block.length], block.offset)

    def wait(self, engine: IoEngine, ticket: int, timeout_s: float | None = None) -> float:
        """engine.wait, with a failed read (EIO, the file cut short) as a ZeroliteError naming file and cause."""
        try:
            return engine.wait(ticket, timeout_s)
        except TimeoutError:
            raise
        except OSError as e:
            raise ZeroliteError(
                f"reading the layout failed: {' '.join(str(e).split())}: check the disk (dmesg), or convert the model "
                f"again (zerolite convert MODEL --path {self.folder})"
            ) from e

    def wait_all(self, engine: IoEngine, tickets: list[int]) -> list[float]:
        """Waits for every ticket, even after one failed (no read may outlive its buffer), then
        raises the first failure; returns when each finished."""
        finished, failure = [], None
        for ticket in tickets:
            try:
                finished.append(self.wait(engine, ticket))
            except ZeroliteError as e:
                failure = failure or e
        if failure is not None:
            raise failure
        return finished

    def read_block(
        self, name: str, engine: IoEngine, buffer: torch.Tensor | None = None, verify: bool = False
    ) -> dict[str, torch.Tensor]:
        """Reads one block and returns its tensors (views into buffer), the checksum checked if asked."""
        block = self.manifest.block(name)
        if buffer is None:
            buffer = aligned_empty(block.length)
        self.wait(engine, self.submit_block(name, engine, buffer))
        if verify:
            self.check(block, buffer)
        return tensor_views(block, buffer)

    def check(self, block: BlockEntry, buffer: torch.Tensor) -> None:
        if zlib.crc32(buffer[: block.length].numpy()) != block.crc32:
            raise ZeroliteError(
                f"block {block.name} of layout {self.folder} fails its checksum ({self.manifest.data_file} "
                f"was altered or the disk returned bad data): convert the model again"
            )


def tensor_views(block: BlockEntry, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The block's tensors as views of the bytes in buffer: no copy."""
    views = {}
    for t in block.tensors:
        raw = buffer[t.offset : t.offset + t.nbytes]
        views[t.name] = raw.view(DTYPES[t.dtype]).view(t.shape)
    return views
