"""A converted layout, opened: its manifest checked against its data file; reading is DiskStore's job.

    layout = Layout.open("/nvme/bloom")
    layout.manifest.block("layers.3")       # where the block lies in layout.data_path
"""

from __future__ import annotations

from pathlib import Path

import torch

from zerolite.errors import ZeroliteError
from zerolite.layout.manifest import DTYPES, MANIFEST, BlockEntry, Manifest


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


def tensor_views(block: BlockEntry, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """The block's tensors as views of the bytes in buffer: no copy. A fused expert tensor whose
    experts lie in extents of their own is a strided view over them."""
    views = {}
    for t in block.tensors:
        raw = buffer[t.offset : t.offset + t.span].view(DTYPES[t.dtype])
        if t.expert_stride:
            inner = torch.empty(t.shape[1:], device="meta").stride()
            views[t.name] = raw.as_strided(t.shape, (t.expert_stride // raw.element_size(), *inner))
        else:
            views[t.name] = raw.view(t.shape)
    return views
