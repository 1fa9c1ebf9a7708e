"""The parts a model runs with, built for one rank before the executor ties them together:

    parts = build_parts(layout, policy, plan, device, world, progress, timeline)
    executor = Executor(parts)

transformers' model on the meta device (quantized linears in place), the disk and its I/O engine,
each block's binding (the resident blocks bound now), the host tier, the expert routing and cache
of a mixture read per expert, the ring of slots, and what the K/V caches share.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from torch import nn

from zerolite.distributed.node_copy import NodeCopy
from zerolite.distributed.world import World
from zerolite.hf import runnable_model
from zerolite.io.device import Device
from zerolite.io.engine import IoEngine, aligned_empty
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import DTYPES
from zerolite.layout.placement import dense_part, device_placement
from zerolite.layout.store import DiskStore, MemoryStore
from zerolite.moe.cache import ExpertCache
from zerolite.moe.counts import ExpertCounts
from zerolite.moe.routing import ExpertRouting, streamed_per_expert
from zerolite.quant.bf16_linear import use_bf16_kernel
from zerolite.quant.linear import dequantize_resident, keeps_dense
from zerolite.quant.linear import install as install_quantized_linears
from zerolite.runtime.binding import BlockBinding
from zerolite.runtime.host_attention import host_attending_caches
from zerolite.runtime.kv_cache import OffloadedCaches
from zerolite.runtime.kv_disk import KVDisk
from zerolite.runtime.plan import Plan, spread
from zerolite.runtime.policy import Policy
from zerolite.runtime.resident import load_resident
from zerolite.runtime.slots import Slots
from zerolite.runtime.timeline import NO_TIMELINE, Timeline


@dataclass
class Parts:
    """What loading built for one rank: the executor runs the model with them, the plan printer and
    the profiler read them."""

    layout: Layout
    policy: Policy
    plan: Plan
    device: Device
    world: World                        # the ranks of a torchrun job, whose ranks on one node share the host tier
    timeline: Timeline                  # records reads, copies, waits, compute and steps while the model runs
    model: nn.Module                    # transformers' own, parameters on meta but where bound
    engine: IoEngine
    disk: DiskStore
    bindings: dict[str, BlockBinding]   # every block's, the resident ones bound
    routing: ExpertRouting              # a mixture's experts read per expert: which the router picks, and guesses
    expert_cache: ExpertCache | None    # experts read from disk, kept across steps in host memory
    slots: Slots
    caches: OffloadedCaches             # the streams and host buffers every K/V cache of this model shares
    loaded_bytes: int                   # read while loading: the resident blocks and the host tier
    load_read_gbps: float               # the disk's speed as loading saw it
    experts_note: str | None            # why a mixture's experts stream whole, where they could not apart

    @property
    def bytes_read(self) -> int:
        """Bytes streamed from disk since loading finished."""
        return self.disk.bytes_read - self.loaded_bytes

    def expert_counts(self) -> ExpertCounts:
        """Running totals of streaming per expert: expert bytes read, cache hits, guesses."""
        return self.routing.counts(self.slots.expert_bytes_read, self.slots.expert_bytes_spared, self.expert_cache)


def build_parts(layout: Layout, policy: Policy, plan: Plan, device: Device, world: World, progress=None,
                timeline: Timeline = NO_TIMELINE) -> Parts:
    """The parts for the plan on this rank, its resident blocks read and bound:

    1. the model on meta, its quantized linears installed; the disk; a binding per block, bound
       where its copy put it on a device of its own
    2. which layers read their experts apart (and where they compute), and their routing
    3. the host tier and the resident blocks, read (progress, a ByteProgress, counts the bytes)
    4. the expert cache and the ring of slots
    """
    manifest = layout.manifest
    timeline.device = device
    model = runnable_model(layout.side_folder, DTYPES[manifest.dtype], device.torch_device)
    install_quantized_linears(model, manifest, device)
    if not device.separate_memory:  # a CPU: its bf16 layers' decode steps through zerolite's kernel
        use_bf16_kernel(model)
    engine = IoEngine(policy.io_backend, policy.io_queue_depth, policy.io_chunk_bytes)
    disk = DiskStore(layout, engine)
    # Where the device has memory of its own, a block's tensors are bound where its copy put them
    # (zerolite.layout.placement: 256-byte offsets, which a layout in place's are not as read).
    bound = {block.name: device_placement(block).entry if device.separate_memory else block
             for block in manifest.blocks}
    bindings = {name: BlockBinding(model, entry, manifest.aliases) for name, entry in bound.items()}

    per_expert, experts_note = streamed_per_expert(model, layout, plan.streamed, plan.on_disk,
                                                   policy.experts == "whole", device.separate_memory)
    host_experts = host_expert_layers(per_expert, manifest.layer_names, policy, device.separate_memory)
    for name in host_experts:  # their experts never go to the device: its slots bind the dense part alone
        bound[name] = dense_part(bound[name])
        bindings[name] = BlockBinding(model, bound[name], manifest.aliases)
    routing = ExpertRouting(model, manifest, per_expert, disk, device, host_experts)

    started = time.perf_counter()
    memory = host_memory(disk, plan, device, world, progress)
    for name, data in load_resident(disk, [n for n in plan.resident if not memory.holds(n)], device, progress):
        bindings[name].bind(data)
    for name in plan.resident:
        if memory.holds(name):
            bindings[name].bind(memory.bytes_of(name))
    if keeps_dense(device, policy.offload):
        dequantize_resident(model, manifest, plan.resident)
    loaded_bytes = disk.bytes_read
    # Reading blocks again just to time the disk would make some disks (virtual ones, whose host
    # caches below the guest) serve the run that follows slower: loading's own reads are timed.
    load_read_gbps = (memory.read_gbps if isinstance(memory, NodeCopy)
                      else loaded_bytes / max(time.perf_counter() - started, 1e-9) / 1e9)

    # Unpinned: a hit is copied on the host into the slot's read buffer, never from the entry to
    # the GPU, and pinning each entry as it is made would register memory on the hot path.
    expert_cache = ExpertCache(plan.expert_cache, aligned_empty) if per_expert and plan.expert_cache else None
    slots = Slots(manifest, disk if plan.on_disk else None, memory, policy.prefetch_depth, device,
                  max((manifest.block(name).length for name in plan.streamed), default=0), timeline, per_expert,
                  expert_cache, device_bytes=max((bound[name].length for name in plan.streamed), default=0),
                  host_experts=host_experts)
    attended_on_host = policy.kv_attention == "cpu" and policy.kv_offload > 0
    disk_kv = kv_disk(layout, policy, engine, device)
    caches = (attended_on_host and host_attending_caches(model, device, world.leads, disk_kv)) or OffloadedCaches(
        device, disk_kv)
    return Parts(layout, policy, plan, device, world, timeline, model, engine, disk, bindings, routing, expert_cache,
                 slots, caches, loaded_bytes, load_read_gbps, experts_note)


def kv_disk(layout: Layout, policy: Policy, engine: IoEngine, device: Device) -> KVDisk | None:
    """Where the K/V kept on disk goes (kv_disk): beside the layout, under the offload root it was
    converted into, read through the weights' engine."""
    return KVDisk(layout.folder.resolve().parent, engine, device) if policy.kv_disk > 0 else None


def host_expert_layers(per_expert: frozenset[str], layers, policy: Policy, separate_memory: bool) -> frozenset[str]:
    """Of the layers read per expert, those whose routed experts the host computes: where the device
    has memory of its own, with `experts` cpu, all of them or cpu_expert_layers of them spread among
    the rest, so that the link copies the others' experts while the host computes."""
    if policy.experts != "cpu" or not separate_memory:
        return frozenset()
    ordered = [name for name in layers if name in per_expert]
    count = len(ordered) if policy.cpu_expert_layers is None else min(policy.cpu_expert_layers, len(ordered))
    return frozenset(spread(ordered, count))


def host_memory(disk: DiskStore, plan: Plan, device: Device, world: World, progress) -> MemoryStore:
    """The streamed layers the plan holds in host memory (pinned on a GPU). Where several ranks
    run on one node, one copy for all of them, which on a CPU also holds the resident blocks
    (host memory is the device's there)."""
    if world.local_size > 1:
        return NodeCopy.load(disk, list(plan.in_host(device.separate_memory)), device, world, progress)
    # On a CPU the tier is the device's own memory, filled once (device.empty: small pages, whose
    # first touch costs far less than huge ones': io.engine.host_mapping).
    allocate = device.pinned_empty if device.separate_memory else device.empty
    return MemoryStore.load(disk, list(plan.in_memory), allocate, progress)
