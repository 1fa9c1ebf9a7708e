"""A mixture's experts read in place, per expert: the fused expert tensors the module has, mapped
back to where each expert's share of them lies in the checkpoint's shards.

Checkpoints on the hub store a mixture's experts one tensor per expert and matrix (Mixtral's
`block_sparse_moe.experts.N.w1/w2/w3.weight`, Qwen's and DeepSeek-V3's `mlp.experts.N.gate_proj/
up_proj/down_proj.weight`); transformers 5 fuses them while loading (conversion_mapping's
WeightConverter: MergeModulelist stacks the experts, Concatenate joins gate and up), into
`experts.gate_up_proj` [experts, 2 x intermediate, hidden] and `experts.down_proj`. Per expert,
that fusion is only a placing of bytes: expert N's slice of gate_up_proj is its gate tensor's
bytes followed by its up tensor's. So the layer keeps its experts in extents of their own, as a
converted layout does (zerolite.layout.manifest.pack_experts), and the manifest says where each
part of an expert's extent lies in the shards (ExpertSources); reading an expert reads its parts
and places them (zerolite.layout.store). A tensor the checkpoint stores fused already (gpt_oss's)
gives each expert one part: its slice.

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

from zerolite.layout.manifest import ExpertArea, ExpertSources, TensorEntry, pack_experts


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
    """The layer's experts from start (4 KiB aligned) on, one extent per expert as a converted
    layout places them, with each extent's parts in the shards: the area, its tensors' entries,
    and the bytes the experts take. meta_tensors: the experts module's tensors, by state-dict name."""
    entries, stride = pack_experts(meta_tensors, start)
    places, lengths, per_expert = [], [], [[] for _ in range(count)]
    for entry in entries:
        slice_bytes = entry.nbytes // count
        for expert in range(count):
            parts = parts_of(entry, expert, slice_bytes, stored, fused)
            if expert == 0:
                at = entry.offset - start
                for _, _, length in parts:
                    places.append(at)
                    lengths.append(length)
                    at += length
            elif [length for _, _, length in parts] != lengths[len(lengths) - len(parts):]:
                raise NotInPlace(f"the experts of {entry.name} are stored in parts of differing sizes")
            per_expert[expert] += [(shard, offset) for shard, offset, _ in parts]
    sources = ExpertSources(tuple(places), tuple(lengths), tuple(tuple(s for s, _ in parts) for parts in per_expert),
                            tuple(tuple(o for _, o in parts) for parts in per_expert))
    area = ExpertArea(module, start, stride, count, None, (None,) * count, sources)
    return area, entries, count * stride


def parts_of(entry: TensorEntry, expert: int, slice_bytes: int, stored: dict,
             fused: FusedParts) -> list[tuple[int, int, int]]:
    """(shard, offset, bytes) of each part of the expert's slice of a fused module tensor: its
    tensors joined along their first dimension (the slice's), so their bytes one after another."""
    if entry.name in stored:  # stored fused already: the expert's slice of it
        where = stored[entry.name]
        return [(where.shard, where.start + expert * slice_bytes, slice_bytes)]
    joined = fused.sources.get(entry.name, {}).get(expert)
    if not joined or sorted(joined) != list(range(len(joined))):
        raise NotInPlace(f"the checkpoint has no tensor for expert {expert} of {entry.name}")
    parts = [joined[i] for i in range(len(joined))]
    if (any(part.shape[1:] != entry.shape[2:] for part in parts)
            or sum(part.shape[0] for part in parts) != entry.shape[1]):
        raise NotInPlace(f"the tensors transformers fuses into {entry.name} (such as {fused.keys[entry.name]}) do not "
                         f"make its shape {entry.shape}")
    return [(part.shard, part.start, part.nbytes) for part in parts]
