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
from zerolite.layout.manifest import MANIFEST, QUANTIZED_WEIGHTS

IN_PLACE_SUFFIX = "-in-place"


def ensure_layout(model, path, dtype, allow_pickle: bool, show_progress: bool, weights: str | None = None) -> Path:
    """The layout folder to run from: model itself if it is one, else model's shards in place
    (only a manifest written, into a folder of its own), else model converted (once).

    path is a layout (or an unfinished conversion) to use, or else an offload root such as /nvme
    holding one layout per model, each in a folder of its own (default: zerolite's cache).
    weights: "int8" or "int4" converts the layers' weights so (into a folder of their own);
    "stored" or None keeps the checkpoint's precision. A layout given must already be in them.
    """
    weights = None if weights == "stored" else weights
    if weights not in (None, *QUANTIZED_WEIGHTS):
        raise ZeroliteError(f"unknown `weights` {weights!r}: choose stored, int8 or int4")
    path = Path(path).expanduser() if path is not None else None
    if model is None and path is not None and holds_layout(path):
        model = path  # no --model: --path names the layout to run
    if model is not None and (Path(model).expanduser() / MANIFEST).is_file():
        return layout_in(Path(model).expanduser(), weights)
    if model is not None and (Path(model).expanduser() / JOURNAL).is_file():
        raise ZeroliteError(
            f"the conversion into {model} did not finish: "
            f"run zerolite convert MODEL --path {model} again to complete it"
        )
    source = str(model) if model is not None else str(builtin_gguf())
    if path is not None and holds_layout(path):
        return convert_into(source, path, dtype, allow_pickle, show_progress, weights)
    folder = default_layout_path(source, dtype, root=path)
    if weights is not None:
        folder = folder.with_name(f"{folder.name}-{weights}")
        if not (folder / MANIFEST).is_file():
            print(f"zerolite: converting {source} once, as it cannot stream in place: --weights {weights} stores its "
                  f"layers' weights as {weights}", file=sys.stderr)
    elif not source.endswith(".gguf"):  # a GGUF file is dequantised: there is nothing to read in place
        try:
            return in_place(source, folder.with_name(folder.name + IN_PLACE_SUFFIX), dtype, allow_pickle)
        except NotInPlace as e:
            print(f"zerolite: converting {source} once, as it cannot stream in place: {e}", file=sys.stderr)
    return convert_into(source, folder, dtype, allow_pickle, show_progress, weights)


def convert_into(source: str, folder: Path, dtype, allow_pickle: bool, show_progress: bool,
                 weights: str | None) -> Path:
    convert(source, folder, dtype=dtype, allow_pickle=allow_pickle, show_progress=show_progress, weights=weights)
    return layout_in(folder, weights)


def layout_in(folder: Path, weights: str | None) -> Path:
    """folder, once its layout is checked to hold the weights asked for (None: any)."""
    if weights is None:
        return folder
    manifest = read_existing_manifest(folder)
    stored = (manifest.quantization or {}).get("weights") if manifest is not None else None
    if stored != weights:
        raise ZeroliteError(f"{folder} holds {stored or 'unquantized'} weights, not {weights}: give the checkpoint "
                            f"as the model to convert it with --weights {weights}, or leave out --weights")
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
