"""Where each block's tensors go in a layout's data file, planned from the meta model's shapes
alone before a byte is written: each block one extent after the last, a layer whose experts take
their routing with each expert in an extent of its own after its dense part.

    planned = plan_extents(meta_model, blocks, scheme, targets)     # block name -> BlockEntry
"""

from __future__ import annotations

from zerolite.layout.blocks import BlockPartition, module_path, stored_tensors
from zerolite.layout.manifest import BlockEntry, ExpertArea, Manifest, pack, pack_experts
from zerolite.moe.experts import Experts, find_experts
from zerolite.quant.quantize import LinearShape, WeightScheme


def plan_extents(meta_model, blocks: BlockPartition, scheme: WeightScheme | None = None,
                 targets: dict[str, LinearShape] | None = None) -> dict[str, BlockEntry]:
    """Every block's place in the data file, from shapes alone (checksums still zero), as the
    scheme quantizes them. A layer whose experts take their routing keeps each expert in an
    extent of its own after the layer's dense part (zerolite.moe.experts)."""
    tensors = stored_tensors(meta_model)
    planned, offset = {}, 0
    for block in blocks.blocks:
        stored = {name: tensors[name] for name in block.tensor_names}
        experts = routed_experts(meta_model, blocks.layers_path, block.name)
        prefix = f"{module_path(blocks.layers_path, block.name)}.{experts.path}." if experts else None
        fused = {name: t for name, t in stored.items() if prefix and name.startswith(prefix)}
        dense = {name: t for name, t in stored.items() if name not in fused}
        entries, length = pack(scheme.meta_tensors(dense, targets) if scheme else dense)
        area = None
        if fused:
            expert_entries, stride = pack_experts(fused, length)
            area = ExpertArea(experts.path, length, stride, experts.count, 0, (0,) * experts.count)
            entries += expert_entries
            length += experts.count * stride
        planned[block.name] = BlockEntry(block.name, offset, length, 0, tuple(entries), area)
        offset += length
    return planned


def routed_experts(meta_model, layers_path: str, block_name: str) -> Experts | None:
    """The layer's experts, where a step can read only those its router picks."""
    if not block_name.startswith("layers."):
        return None
    experts = find_experts(meta_model.get_submodule(module_path(layers_path, block_name)))
    return experts if experts is not None and experts.routed else None


def same_extents(existing: Manifest, planned: dict[str, BlockEntry]) -> bool:
    """The layout places every tensor where this zerolite would (one converted before experts had
    extents of their own is converted again, to stream per expert)."""
    def places(block: BlockEntry):
        return block.name, block.offset, block.length, block.tensors, block.experts and block.experts.stride

    return [places(b) for b in existing.blocks] == [places(b) for b in planned.values()]


def data_bytes(planned: dict[str, BlockEntry]) -> int:
    last = list(planned.values())[-1]
    return last.offset + last.length
