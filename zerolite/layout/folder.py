"""A layout, opened: its manifest checked against its data file (in place: against the checkpoint's
shards as they were when it was written); reading is DiskStore's job.

    layout = Layout.open("/nvme/bloom")
    layout.manifest.block("layers.3")       # where the block lies in layout.data_path (or its pieces)
    layout.side_folder                      # where config.json and the tokenizer are
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

    @property
    def side_folder(self) -> Path:
        """The folder holding the model's config, generation config and tokenizer: the layout's,
        or in place the checkpoint's own."""
        return Path(self.manifest.source["model"]) if self.manifest.in_place else self.folder

    @property
    def read_paths(self) -> list[Path]:
        """The files its blocks are read from."""
        return [Path(shard.path) for shard in self.manifest.shards] if self.manifest.in_place else [self.data_path]

    @classmethod
    def open(cls, folder: str | Path) -> Layout:
        """Validates the manifest and the size of the data file; reads no weights."""
        folder = Path(folder).expanduser()
        manifest_path = folder / MANIFEST
        if not manifest_path.is_file():
            unfinished = (folder / "convert.journal").exists()
            hint = " (a conversion into it did not finish: run zerolite convert again)" if unfinished else ""
            raise ZeroliteError(f"no zerolite layout at {folder}{hint}: "
                                f"create one with zerolite convert MODEL --path {folder}")
        manifest = Manifest.from_json(manifest_path.read_text(), manifest_path)
        layout = cls(folder, manifest)
        if manifest.in_place:
            check_shards_unchanged(manifest, folder)
            return layout
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


def check_shards_unchanged(manifest: Manifest, folder: Path) -> None:
    """Refuses a layout in place whose shards are gone or changed: its pieces would read other bytes."""
    for shard in manifest.shards:
        try:
            stat = Path(shard.path).stat()
        except OSError as e:
            raise ZeroliteError(f"{shard.path}, which the layout in place at {folder} reads, is gone ({e.strerror}): "
                                f"delete {folder} and run again to plan the checkpoint anew") from None
        if (stat.st_size, stat.st_mtime_ns) != (shard.size, shard.mtime_ns):
            raise ZeroliteError(f"{shard.path} changed after the layout in place at {folder} was planned: "
                                f"delete {folder} and run again to plan the checkpoint anew")


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
