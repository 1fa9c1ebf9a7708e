"""The layout a model runs from: the one given; else the checkpoint's own shards, read in place;
else the checkpoint converted into a layout, once."""

from __future__ import annotations

import sys
from pathlib import Path

from zerolite.convert.checkpoint import Checkpoint
from zerolite.convert.in_place import NotInPlace, plan_in_place, write_in_place
from zerolite.convert.paths import builtin_gguf, default_layout_path
from zerolite.convert.writer import JOURNAL, convert, holds_layout, read_existing_manifest
from zerolite.errors import ZeroliteError
from zerolite.io.engine import supports_direct_io
from zerolite.layout.manifest import MANIFEST

IN_PLACE_SUFFIX = "-in-place"


def ensure_layout(model, path, dtype, allow_pickle: bool, show_progress: bool) -> Path:
    """The layout folder to run from: model itself if it is one, else model's shards in place
    (only a manifest written, into a folder of its own), else model converted (once).

    path is a layout (or an unfinished conversion) to use, or else an offload root such as /nvme
    holding one layout per model, each in a folder of its own (default: zerolite's cache).
    """
    path = Path(path).expanduser() if path is not None else None
    if model is None and path is not None and holds_layout(path):
        model = path  # no --model: --path names the layout to run
    if model is not None and (Path(model).expanduser() / MANIFEST).is_file():
        return Path(model).expanduser()
    if model is not None and (Path(model).expanduser() / JOURNAL).is_file():
        raise ZeroliteError(
            f"the conversion into {model} did not finish: run zerolite convert MODEL --path {model} again to complete it"
        )
    source = str(model) if model is not None else str(builtin_gguf())
    if path is not None and holds_layout(path):
        folder = path
    else:
        folder = default_layout_path(source, dtype, root=path)
        if not source.endswith(".gguf"):  # a GGUF file is dequantised: there is nothing to read in place
            try:
                return in_place(source, folder.with_name(folder.name + IN_PLACE_SUFFIX), dtype, allow_pickle)
            except NotInPlace as e:
                print(f"zerolite: converting {source} once, as it cannot stream in place: {e}", file=sys.stderr)
    convert(source, folder, dtype=dtype, allow_pickle=allow_pickle, show_progress=show_progress)
    return folder


def in_place(source: str, folder: Path, dtype, allow_pickle: bool) -> Path:
    """folder holding the manifest of source's shards read in place, planned now if it is not
    there yet for this dtype; NotInPlace where they cannot be."""
    checkpoint = Checkpoint.open(source, allow_pickle)
    existing = read_existing_manifest(folder)
    if existing is not None and existing.in_place and existing.source["model"] == str(checkpoint.folder):
        return folder  # opening it checks that its shards have not changed since
    if not all(supports_direct_io(path) for path in checkpoint.weight_files):
        raise NotInPlace(f"the file system of {checkpoint.folder} refuses O_DIRECT reads")
    write_in_place(plan_in_place(checkpoint, dtype), folder)
    return folder
