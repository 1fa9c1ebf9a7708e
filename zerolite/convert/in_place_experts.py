"""A mixture's experts read in place, per expert: the fused expert tensors the module has, mapped
back to where each expert's share of them lies in the checkpoint's shards.

Checkpoints on the hub store a mixture's experts one tensor per expert and matrix (Mixtral's
`block_sparse_moe.experts.N.w1/w2/w3.weight`, Qwen's and DeepSeek-V3's `mlp.experts.N.gate_proj/
up_proj/down_proj.weight`); transformers 5 fuses them while loading (conversion_mapping's
WeightConverter: MergeModulelist stacks the experts, Concatenate joins gate and up), into
`experts.gate_up_proj` [experts, 2 x intermediate, hidden] and `experts.down_proj`. Per expert,
that fusion is only a placing of bytes: expert N's slice of gate_up_proj is its gate tensor's
bytes followed by its up tensor's. So the layer keeps its experts in extents of their own, as a
converted layout does, and the manifest says where each part of an expert's extent lies in the
shards (ExpertSources); reading an expert reads its parts and places them (zerolite.layout.store).
A tensor the checkpoint stores fused already (gpt_oss's) gives each expert one part: its slice.

    fused = FusedParts()                          # filled by locate_tensors as it meets each key
    fused.add(key, renamed, target, converters, stored)
    area, entries, length = expert_area(meta_tensors, start, count, stored, fused, module)

Any other conversion (a transposition, a split, a dequantisation) is not a placing of bytes: it
raises NotInPlace, and the checkpoint is converted.
"""

from __future__ import annotations

import re
from collections import defaultdict

from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

from zerolite.io.engine import ALIGNMENT
from zerolite.layout.manifest import (
    TENSOR_ALIGNMENT,
    ExpertArea,
    ExpertSources,
    TensorEntry,
    dtype_name,
    round_up,
)


class NotInPlace(Exception):
    """The checkpoint cannot be streamed where it lies; the message says why."""


class FusedParts:
    """The checkpoint tensors transformers fuses into a module tensor, by target: per expert, the
    stored tensors in the order the conversion joins them."""

    def __init__(self):
        self.sources: dict[str, dict[int, dict[int, object]]] = defaultdict(lambda: defaultdict(dict))
        self.keys: dict[str, str] = {}  # target -> a checkpoint key fused into it, for the line saying why

    def add(self, key: str, renamed: str, target: str, converters: list[WeightConverter], stored) -> None:
        """stored: where key lies in the shards (convert.in_place.Stored). renamed: key after
        transformers' renamings, as its converters match it."""
        converter, pattern = next((c, p) for c in converters for p in [c.rename_source_key(renamed)[1]] if p)
        operations = [type(op) for op in converter.operations]
        joins = operations == [MergeModulelist] or (operations == [MergeModulelist, Concatenate]
                                                   and converter.operations[1].dim == 1)
        expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
        if not joins or converter.operations[0].dim != 0 or expert is None:
            raise NotInPlace(f"transformers changes {key} while loading it ({pattern} into {target})")
        self.sources[target][int(expert.group(1))][converter.source_patterns.index(pattern)] = stored
        self.keys.setdefault(target, key)


def expert_area(meta_tensors: dict, start: int, count: int, stored: dict, fused: FusedParts,
                module: str) -> tuple[ExpertArea, list[TensorEntry], int]:
    """The layer's experts from start (4 KiB aligned) on, one extent per expert, with each extent's
    parts in the shards: the area, its tensors' entries, and the bytes the experts take.
    meta_tensors: the experts module's tensors, by state-dict name.

    Each fused tensor's slice lies in the extent at the offset within a page that its parts have
    in the shards, where every expert's agree (a checkpoint whose experts' tensors are whole pages
    long, as real ones are): then an expert's whole pages are read straight into the slot, and
    only the ends of its parts, within a page, go through scratch (zerolite.layout.expert_parts).
    Else at TENSOR_ALIGNMENT, as a converted layout places it, every byte through scratch."""
    parts = {name: [parts_of(name, tensor, expert, stored, fused) for expert in range(count)]
             for name, tensor in meta_tensors.items()}
    places, lengths, slices, cursor = [], [], {}, 0
    for name, tensor in meta_tensors.items():
        first = parts[name][0]
        if any([length for _, _, length in mine] != [length for _, _, length in first] for mine in parts[name]):
            raise NotInPlace(f"the experts of {name} are stored in parts of differing sizes")
        slices[name] = cursor = page_matched(cursor, parts[name], tensor.dtype.itemsize)
        for _, _, length in first:
            places.append(cursor)
            lengths.append(length)
            cursor += length
    stride = round_up(cursor, ALIGNMENT)
    entries = [TensorEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), start + slices[name], stride)
               for name, tensor in meta_tensors.items()]
    per_expert = [[where for name in meta_tensors for where in parts[name][expert]] for expert in range(count)]
    sources = ExpertSources(tuple(places), tuple(lengths), tuple(tuple(s for s, _, _ in mine) for mine in per_expert),
                            tuple(tuple(o for _, o, _ in mine) for mine in per_expert))
    area = ExpertArea(module, start, stride, count, None, (None,) * count, sources)
    return area, entries, count * stride


def page_matched(cursor: int, experts: list[list[tuple[int, int, int]]], itemsize: int) -> int:
    """The first offset from cursor at which a slice made of these parts (per expert) lies as they
    lie in their pages of the shards, where every expert's parts agree and that offset suits the
    dtype; else the first at TENSOR_ALIGNMENT."""
    residues = set()
    for mine in experts:
        at = 0
        for _, offset, length in mine:
            residues.add((offset - at) % ALIGNMENT)
            at += length
    if len(residues) == 1 and (residue := residues.pop()) % itemsize == 0:
        return cursor + (residue - cursor) % ALIGNMENT
    return round_up(cursor, TENSOR_ALIGNMENT)


def parts_of(name: str, tensor, expert: int, stored: dict, fused: FusedParts) -> list[tuple[int, int, int]]:
    """(shard, offset, bytes) of each part of the expert's slice of a fused module tensor (tensor:
    its meta tensor): its checkpoint tensors joined along their first dimension (the slice's), so
    their bytes one after another."""
    slice_bytes = tensor[0].numel() * tensor.dtype.itemsize
    if name in stored:  # stored fused already: the expert's slice of it
        where = stored[name]
        return [(where.shard, where.start + expert * slice_bytes, slice_bytes)]
    joined = fused.sources.get(name, {}).get(expert)
    if not joined or sorted(joined) != list(range(len(joined))):
        raise NotInPlace(f"the checkpoint has no tensor for expert {expert} of {name}")
    parts = [joined[i] for i in range(len(joined))]
    if (any(part.shape[1:] != tuple(tensor.shape[2:]) for part in parts)
            or sum(part.shape[0] for part in parts) != tensor.shape[1]):
        raise NotInPlace(f"the tensors transformers fuses into {name} (such as {fused.keys[name]}) do not "
                         f"make its shape {tuple(tensor.shape)}")
    return [(part.shard, part.start, part.nbytes) for part in parts]
