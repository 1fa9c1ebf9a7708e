"""The one loop that runs a transformers model whose weights stream through a ring of slots.

The model is transformers' own, built from the layout's config with its parameters on the meta
device. Resident blocks are bound once. Each streamed block (a decoder layer) runs inside
Executor.running(name), entered by a forward pre-hook and left by a forward hook: the model's
forward code runs unchanged, so any architecture transformers has works.

While block i computes, the blocks the schedule expects next are already being read (and, where
the device has memory of its own, copied), up to prefetch_depth - 1 ahead.

A mixture's layer laid out per expert streams its dense part that way; hooks on its experts
module then bring only the experts the step's router picked, and guess the next layer's, so that
their reads start early (zerolite.moe.routing).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AutoConfig, GenerationConfig
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from zerolite.convert.checkpoint import build_meta_model
from zerolite.distributed.node_copy import NodeCopy
from zerolite.distributed.world import SINGLE, World
from zerolite.hf import keep_experts_implementation, skip_rescaling_by_one
from zerolite.io.device import Device
from zerolite.io.engine import IoEngine, aligned_empty
from zerolite.layout.blocks import module_path
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import DTYPES
from zerolite.layout.placement import device_placement
from zerolite.layout.store import DiskStore, MemoryStore
from zerolite.moe.cache import ExpertCache
from zerolite.moe.counts import ExpertCounts
from zerolite.moe.routing import ExpertRouting, streamed_per_expert
from zerolite.quant.linear import dequantize_resident, keeps_dense
from zerolite.quant.linear import install as install_quantized_linears
from zerolite.runtime.binding import BlockBinding
from zerolite.runtime.kv_cache import HostBufferPool
from zerolite.runtime.plan import Plan
from zerolite.runtime.policy import Policy
from zerolite.runtime.resident import load_resident
from zerolite.runtime.schedule import Schedule
from zerolite.runtime.slots import Slots
from zerolite.runtime.timeline import NO_TIMELINE

GENERATION_CONFIG = "generation_config.json"


class Executor:
    def __init__(self, layout: Layout, policy: Policy, plan: Plan, device: Device, progress=None, timeline=NO_TIMELINE,
                 world: World = SINGLE):
        """Builds the model and makes it ready to run the plan: resident blocks read and bound, hooks set.

        progress (a ByteProgress) is advanced by the bytes read while loading; timeline (a
        Timeline) records reads, copies, waits, compute and steps while the model runs. world:
        the ranks of a torchrun job, whose ranks on one node share what host memory holds.
        """
        manifest = layout.manifest
        self.layout = layout
        self.policy = policy
        self.plan = plan
        self.device = device
        self.timeline = timeline
        timeline.device = device
        self.model = build_model(layout, device.torch_device)
        install_quantized_linears(self.model, manifest, device)
        self.engine = IoEngine(policy.io_backend, policy.io_queue_depth, policy.io_chunk_bytes)
        self.disk = DiskStore(layout, self.engine)
        # Where the device has memory of its own, a block's tensors are bound where its copy put them
        # (zerolite.layout.placement: 256-byte offsets, which a layout in place's are not as read).
        bound = {block.name: device_placement(block).entry if device.separate_memory else block for block in manifest.blocks}
        self._bindings = {name: BlockBinding(self.model, entry, manifest.aliases) for name, entry in bound.items()}

        self.per_expert, self.experts_note = streamed_per_expert(self.model, layout, plan.streamed, plan.on_disk,
                                                                 policy.experts == "whole", device.separate_memory)
        # Where the device has memory of its own, `experts` cpu computes those layers' experts on the host
        self.host_experts = self.per_expert if policy.experts == "cpu" and device.separate_memory else frozenset()
        started = time.perf_counter()
        self.routing = ExpertRouting(self.model, manifest, self.per_expert, self.disk, device, self.host_experts)
        memory = host_memory(self.disk, plan, device, world, progress)
        for name, data in load_resident(self.disk, [n for n in plan.resident if not memory.holds(n)], device, progress):
            self._bindings[name].bind(data)
        for name in plan.resident:
            if memory.holds(name):
                self._bindings[name].bind(memory.bytes_of(name))
        if keeps_dense(device, policy.offload):
            dequantize_resident(self.model, manifest, plan.resident)
        self.loaded_bytes = self.disk.bytes_read  # read while loading: the resident blocks and the host tier
        # The disk's speed as loading saw it: reading blocks again just to time the disk would make
        # some disks (virtual ones, whose host caches below the guest) serve the run that follows slower.
        self.load_read_gbps = (memory.read_gbps if isinstance(memory, NodeCopy)
                               else self.loaded_bytes / max(time.perf_counter() - started, 1e-9) / 1e9)
        slot_bytes = max((manifest.block(name).length for name in plan.streamed), default=0)
        # Unpinned: a hit is copied on the host into the slot's read buffer, never from the entry to
        # the GPU, and pinning each entry as it is made would register memory on the hot path.
        self.expert_cache = (ExpertCache(plan.expert_cache, aligned_empty)
                             if self.per_expert and plan.expert_cache else None)
        self.slots = Slots(manifest, self.disk if plan.on_disk else None, memory, policy.prefetch_depth, device,
                           slot_bytes, timeline, self.per_expert, self.expert_cache,
                           device_bytes=max((bound[name].length for name in plan.streamed), default=0),
                           host_experts=self.host_experts)
        self.schedule = Schedule(list(plan.streamed))
        # (fetches, appends) and the pinned host buffers for every K/V cache it offloads
        self.kv_streams = (device.new_stream(), device.new_stream()) if device.separate_memory else None
        self.kv_buffers = HostBufferPool(device)
        # What the ring reads ahead: blocks that need a transfer. Where host memory is the device's,
        # a block held there needs none, so the disk reads on through such layers instead of idling.
        self._transferred = frozenset(plan.streamed if device.separate_memory else plan.on_disk)
        self._on_disk = frozenset(plan.on_disk)
        self._running: dict[str, object] = {}  # block -> its running() context, entered and not yet left
        self._step = None
        self._steps = 0
        self._hooks = []
        for name in plan.streamed:
            module = self.model.get_submodule(module_path(manifest.layers_path, name))
            self._hooks.append(module.register_forward_pre_hook(self._enter(name)))
            self._hooks.append(module.register_forward_hook(self._leave(name)))
        self._hooks += self.routing.attach(self.model, manifest, self.slots)
        self._hooks.append(self.model.register_forward_pre_hook(lambda *_: self._start_step()))
        self._hooks.append(self.model.register_forward_hook(lambda *_: self._end_step()))

    @property
    def bytes_read(self) -> int:
        """Bytes streamed from disk since loading finished."""
        return self.disk.bytes_read - self.loaded_bytes

    def expert_counts(self) -> ExpertCounts:
        """Running totals of streaming per expert: expert bytes read, cache hits, guesses."""
        return self.routing.counts(self.slots.expert_bytes_read, self.expert_cache)

    @contextmanager
    def running(self, name: str):
        """One streamed block's turn, the whole per-layer pipeline in one place:

        1. ask for this block and the ones the schedule expects next: their reads start now; on
           a GPU, the disk's next blocks too, into staging buffers apart from the ring
        2. queue copies for reads already finished, so they overlap this block's compute
        3. wait for this block's bytes and bind them into its modules
        4. the block's forward runs (the body), on the compute span
        5. unbind and release the slot (on a GPU the next copy into it waits for this compute)
        """
        self.schedule.ran(name)
        self.slots.want([name] + self.schedule.ahead(name, self.policy.prefetch_depth - 1, self._transferred))
        self.slots.read_ahead(self.schedule.ahead(name, self.policy.prefetch_depth, self._on_disk))
        self.slots.advance()
        self._bindings[name].bind(self.slots.wait(name))
        try:
            with self.timeline.span("compute", name, stream=self.device.compute_stream()):
                yield
        finally:
            self._bindings[name].unbind()
            self.slots.release(name)

    def _enter(self, name: str):
        def before(module: nn.Module, args) -> None:
            context = self.running(name)
            context.__enter__()
            self._running[name] = context

        return before

    def _leave(self, name: str):
        def after(module: nn.Module, args, output) -> None:
            self._running.pop(name).__exit__(None, None, None)
            self.routing.layer_done(name)

        return after

    def _start_step(self) -> None:
        self._step = self.timeline.span("step", f"step {self._steps}", stream=self.device.compute_stream())
        self._step.__enter__()

    def _end_step(self) -> None:
        self._step.__exit__(None, None, None)
        self._step = None
        self._steps += 1
        self.schedule.end_forward()

    def recover(self) -> None:
        """After a forward that raised half-way: unbind what was running and free its slots, once
        the copies still queued (a layer's K/V appends) have landed in the buffers that frees."""
        self.device.synchronize()
        for name in list(self._running):
            self._running.pop(name).__exit__(None, None, None)
        self.routing.reset()
        if self._step is not None:
            self._end_step()

    def close(self) -> None:
        """Waits for reads in flight and orders compute after copies in flight (prefetches for a
        forward that never came), then unhooks."""
        self.slots.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


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


def build_model(layout: Layout, device: torch.device) -> nn.Module:
    """transformers' model for the layout's config: parameters on meta, buffers real on device.

    Compilation and CUDA graphs are off: they capture the addresses of the weights, which change
    every time a slot is rebound. A static cache that a config asks for by default (Gemma-2's
    "hybrid") gives way to the dynamic one, which zerolite's K/V offload also builds on.
    """
    config = AutoConfig.from_pretrained(layout.side_folder)
    model = build_meta_model(config, DTYPES[layout.manifest.dtype], real_buffers=True)
    model.eval()
    model.requires_grad_(False)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)
    if (layout.side_folder / GENERATION_CONFIG).is_file():
        model.generation_config = GenerationConfig.from_pretrained(layout.side_folder)
    model.generation_config.disable_compile = True
    if model.generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        model.generation_config.cache_implementation = None
    keep_experts_implementation(model)
    skip_rescaling_by_one(model, config)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(contiguous_input)
    return model


def contiguous_input(module: nn.Module, args: tuple) -> tuple:
    """A Linear's input, made contiguous (a no-op when it is). On a CPU, torch runs linear on a
    strided 16-bit 3-D input whose weight does not require grad on a slow path that also expands
    the weight once per sequence, and the head applied to generate's last position
    (hidden[:, -1:, :]) is such an input: its time and memory then grow with the batch times the
    head (a copy of a 32000 x 256 bf16 head per sequence is 1 GB for 64 sequences). Copying that
    strided input costs next to nothing: one row per sequence."""
    return (args[0].contiguous(), *args[1:])
