"""A checkpoint's own safetensors shards as a layout: no second copy of the weights.

A safetensors shard stores each tensor contiguously, and a decoder layer's tensors lie side by
side (the writer orders them by name). So each block is read straight from the shards: a few 4
KiB-aligned pieces (usually one per shard it touches), its tensors taken as views at their offsets
in them. What is written is a small manifest (zerolite.layout.manifest, `shards` set) in a folder
of its own.

A mixture's layers keep their experts in extents of their own, as a converted layout does: each
expert's extent is made, as it is read, from the parts of the checkpoint's per-expert tensors that
transformers fuses into the module's tensors, its whole pages read straight into place where they
lie there as in the shards (zerolite.convert.in_place_experts), so that a step reads only the
experts its router picks, and no byte twice. (NotInPlace is defined there.)

Not every checkpoint can run so; plan_in_place raises NotInPlace with the reason, and the caller
converts instead:
- transformers changes a tensor while loading it other than by joining experts' tensors (a
  transposition, a split; or a fused tensor of experts that do not take their routing): the stored
  bytes are not the module's;
- a tensor's dtype is not the run's (the dtype must change);
- a block's tensors lie so far apart that reading them whole would waste more than WASTE_LIMIT;
- a tensor's offset is not a multiple of its element size (no view can start there).

Safetensors files carry no checksums: a layout in place is read unchecked until `zerolite verify`
hashes its blocks once into its manifest.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, rename_source_key

from zerolite.convert.checkpoint import SAFETENSORS_DTYPES, Checkpoint, safetensors_header
from zerolite.convert.extents import routed_experts
from zerolite.convert.in_place_experts import FusedParts, NotInPlace, expert_area
from zerolite.convert.writer import write_atomically
from zerolite.errors import ZeroliteError
from zerolite.hf import build_meta_model
from zerolite.io.engine import ALIGNMENT, IoEngine, align_up, aligned_empty
from zerolite.layout.blocks import BlockSpec, module_path, partition, stored_tensors
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import (
    DTYPES,
    MANIFEST,
    BlockEntry,
    Manifest,
    Piece,
    Shard,
    TensorEntry,
    choose_dtype,
    dtype_name,
)
from zerolite.layout.store import DiskStore
from zerolite.progress import byte_progress

WASTE_LIMIT = 0.10  # of a block's own bytes: more read besides them, and converting pays
GAP_READ_THROUGH = ALIGNMENT  # tensors closer than a page share a read (its pages are read whole anyway);
                              # farther apart (a layer's fp32 norms stored before every bf16 weight,
                              # a head whose norm lies after the layers), each run is a read of its own


@dataclass(frozen=True)
class Stored:
    """Where one of the module's tensors lies in the shards."""
    shard: int
    start: int   # byte offset in the shard
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


def plan_in_place(checkpoint: Checkpoint, dtype: str | None) -> Manifest:
    """The manifest of checkpoint read in place at dtype (None: the config's), or NotInPlace."""
    if checkpoint.pickled:
        raise NotInPlace("its weights are pickled .bin files, not safetensors")
    config = checkpoint.config()
    torch_dtype = choose_dtype(dtype, config)
    model = build_meta_model(config, torch_dtype)
    blocks = partition(model)
    stored, fused = locate_tensors(checkpoint, model, blocks)
    tensors = stored_tensors(model)
    entries = tuple(place_layer(model, tensors, blocks.layers_path, spec, stored, fused) for spec in blocks.blocks)
    unplaced = set(fused.sources).difference(t.name for block in entries for t in block.tensors)
    if unplaced:  # fused into experts that are not called with their routing: no extents of their own
        target = min(unplaced)
        raise NotInPlace(f"transformers changes {fused.keys[target]} while loading it (fused into {target})")
    shards = tuple(Shard(str(path), (stat := os.stat(path)).st_size, stat.st_mtime_ns)
                   for path in checkpoint.weight_files)
    return Manifest(model_type=config.model_type, dtype=dtype_name(torch_dtype), layers_path=blocks.layers_path,
                    blocks=entries, aliases=blocks.aliases,
                    source={"model": str(checkpoint.folder), "fingerprint": checkpoint.fingerprint()}, shards=shards)


def locate_tensors(checkpoint: Checkpoint, model, blocks) -> tuple[dict[str, Stored], FusedParts]:
    """Each stored module tensor's place in the shards, under the module's name, as transformers'
    loading would name it; and the experts' tensors loading fuses into one (FusedParts).
    NotInPlace where loading would change their bytes otherwise."""
    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    meta_state = model.state_dict()
    stored: dict[str, Stored] = {}
    fused = FusedParts()
    for index, path in enumerate(checkpoint.weight_files):
        data_start, header = safetensors_header(path)
        for key, info in header.items():
            target, converter = rename_source_key(key, renamings, converters, model.base_model_prefix, meta_state)
            if target not in meta_state and key in meta_state:
                target = key
            target = blocks.aliases.get(target, target)
            if blocks.block_of(target) is None or target in stored:  # not the model's, or a tied copy
                continue
            expected = meta_state[target]
            found = SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"])
            if found != dtype_name(expected.dtype):
                raise NotInPlace(f"{key} is stored as {found}, and the run uses {dtype_name(expected.dtype)}")
            begin, end = info["data_offsets"]
            here = Stored(index, data_start + begin, end - begin, found, tuple(info["shape"]))
            if converter is not None:
                fused.add(key, apply_renamings(key, renamings), target, converters, here)
                continue
            if tuple(info["shape"]) != tuple(expected.shape):
                raise NotInPlace(f"{key} has shape {tuple(info['shape'])}, "
                                 f"the model's {target} {tuple(expected.shape)}")
            stored[target] = here
    return stored, fused


def place_layer(model, tensors: dict, layers_path: str, spec: BlockSpec, stored: dict[str, Stored],
                fused: FusedParts) -> BlockEntry:
    """The block as pieces of the shards (place_block); a layer whose experts take their routing,
    its experts apart after them, one extent each (zerolite.convert.in_place_experts). tensors:
    the meta model's stored tensors, by name."""
    experts = routed_experts(model, layers_path, spec.name)
    prefix = f"{module_path(layers_path, spec.name)}.{experts.path}." if experts else None
    apart = [name for name in spec.tensor_names if prefix and name.startswith(prefix)]
    if not apart:
        return place_block(spec, stored)
    dense = place_block(BlockSpec(spec.name, tuple(n for n in spec.tensor_names if n not in apart)), stored)
    area, entries, length = expert_area({name: tensors[name] for name in apart}, dense.length, experts.count,
                                        stored, fused, experts.path)
    return dataclasses.replace(dense, length=dense.length + length, tensors=dense.tensors + tuple(entries),
                               experts=area)


def place_block(spec: BlockSpec, stored: dict[str, Stored]) -> BlockEntry:
    """The block as pieces of the shards: its tensors in file order, runs of them closer than
    GAP_READ_THROUGH read together, each run widened to 4 KiB at both ends."""
    missing = [name for name in spec.tensor_names if name not in stored]
    if missing:
        raise NotInPlace(f"the checkpoint has no tensor for {missing[0]}")
    order = sorted(spec.tensor_names, key=lambda name: (stored[name].shard, stored[name].start))
    runs: list[list[str]] = []
    for name in order:
        last = stored[runs[-1][-1]] if runs else None
        here = stored[name]
        if (last is not None and last.shard == here.shard
                and here.start - (last.start + last.nbytes) <= GAP_READ_THROUGH):
            runs[-1].append(name)
        else:
            runs.append([name])
    needed = sum(stored[name].nbytes for name in order)
    spanned = sum(stored[run[-1]].start + stored[run[-1]].nbytes - stored[run[0]].start for run in runs)
    if spanned - needed > WASTE_LIMIT * needed:
        raise NotInPlace(f"block {spec.name}'s tensors lie apart in the shards: reading them in place would read "
                         f"{(spanned - needed) / needed:.0%} more than they hold")
    pieces, tensors, at = [], [], 0
    for run in runs:
        first, last = stored[run[0]], stored[run[-1]]
        offset = first.start // ALIGNMENT * ALIGNMENT
        piece = Piece(first.shard, offset, align_up(last.start + last.nbytes) - offset)
        for name in run:
            where = at + stored[name].start - offset
            if where % DTYPES[stored[name].dtype].itemsize:
                raise NotInPlace(f"{name} starts at byte {stored[name].start} of its shard, not a multiple of its "
                                 "element size")
            tensors.append(TensorEntry(name, stored[name].dtype, stored[name].shape, where))
        pieces.append(piece)
        at += piece.length
    return BlockEntry(spec.name, 0, at, None, tuple(tensors), pieces=tuple(pieces))


def write_in_place(manifest: Manifest, folder: Path) -> None:
    """The manifest, written atomically into folder (made if need be): the layout's only file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(folder / MANIFEST, manifest.to_json())
    except OSError as e:
        raise ZeroliteError(f"cannot write the manifest of the layout in place into {folder} ({e.strerror}): "
                            "choose another `path`") from e


def record_checksums(layout: Layout, show_progress: bool = True) -> None:
    """Reads every block of a layout in place once and records its CRC-32 in the manifest, which
    every later read is then checked against."""
    disk = DiskStore(layout, IoEngine())
    manifest = layout.manifest
    buffer = aligned_empty(max(block.length for block in manifest.blocks))
    blocks = []
    with byte_progress("hashing", manifest.data_bytes, len(manifest.blocks), show_progress) as progress:
        for block in manifest.blocks:
            disk.wait(disk.submit(block.name, buffer))
            data = buffer[:block.length].numpy()
            area = block.experts
            if area is not None:  # its dense part and each expert are read, and checked, apart too
                area = dataclasses.replace(area, dense_crc32=zlib.crc32(data[:area.offset]), crc32s=tuple(
                    zlib.crc32(data[start:start + length]) for start, length in map(area.extent, range(area.count))))
            blocks.append(dataclasses.replace(block, crc32=zlib.crc32(data), experts=area))
            progress.advance(block.length)
    write_in_place(dataclasses.replace(manifest, blocks=tuple(blocks)), layout.folder)
