"""The one loop that runs a transformers model whose weights stream through a ring of slots.

The model is transformers' own, built from the layout's config with its parameters on the meta
device. Resident blocks are bound once. Each streamed block (a decoder layer) runs inside
Executor.running(name), entered by a forward pre-hook and left by a forward hook: the model's
forward code runs unchanged, so any architecture transformers has works.

While block i computes, the blocks the schedule expects next are already being read (and, where
the device has memory of its own, copied), up to prefetch_depth - 1 ahead.

A mixture's layer laid out per expert streams its dense part that way; its experts module's
forward pre-hook then brings only the experts the step's router picked (Executor.routing), and
guesses the next layer's, so that their reads start early (zerolite.moe.guess).
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import nn
from transformers import AutoConfig, GenerationConfig
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from zerolite.runtime.binding import BlockBinding
from zerolite.layout.blocks import module_path
from zerolite.convert.checkpoint import build_meta_model
from zerolite.io.device import Device
from zerolite.errors import ZeroliteError
from zerolite.moe.cache import ExpertCache
from zerolite.moe.counts import ExpertCounts
from zerolite.moe.guess import ExpertGuess
from zerolite.moe.experts import find_experts
from zerolite.io.engine import IoEngine
from zerolite.layout.folder import Layout
from zerolite.layout.manifest import DTYPES
from zerolite.dist.node_copy import NodeCopy
from zerolite.runtime.plan import Plan
from zerolite.runtime.policy import Policy
from zerolite.quant.linear import install as install_quantized_linears
from zerolite.runtime.resident import load_resident
from zerolite.runtime.schedule import Schedule
from zerolite.runtime.slots import Slots
from zerolite.layout.store import DiskStore, MemoryStore
from zerolite.runtime.timeline import NO_TIMELINE
from zerolite.dist.world import SINGLE, World

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
        self._bindings = {block.name: BlockBinding(self.model, block, manifest.aliases) for block in manifest.blocks}

        self.per_expert, self.experts_note = streamed_per_expert(self.model, layout, plan, policy, device)
        started = time.perf_counter()
        self.guess = ExpertGuess(self.model, manifest, self.per_expert, self.disk, device)
        memory = host_memory(self.disk, plan, device, world, progress)
        for name, data in load_resident(self.disk, [n for n in plan.resident if not memory.holds(n)], device, progress):
            self._bindings[name].bind(data)
        for name in plan.resident:
            if memory.holds(name):
                self._bindings[name].bind(memory.bytes_of(name))
        self._loaded_bytes = self.disk.bytes_read
        # The disk's speed as loading saw it: reading blocks again just to time the disk would make
        # some disks (virtual ones) serve the run that follows up to 2x slower.
        self.load_read_gbps = (memory.read_gbps if isinstance(memory, NodeCopy)
                               else self._loaded_bytes / max(time.perf_counter() - started, 1e-9) / 1e9)
        slot_bytes = max((manifest.block(name).length for name in plan.streamed), default=0)
        self.expert_cache = (ExpertCache(plan.expert_cache, device.pinned_empty)
                             if self.per_expert and plan.expert_cache else None)
        self.slots = Slots(manifest, self.disk if plan.on_disk else None, memory, policy.prefetch_depth, device,
                           slot_bytes, timeline, self.per_expert, self.expert_cache)
        layers = manifest.layer_names
        self._next_layer = {a: b for a, b in zip(layers, layers[1:]) if a in self.per_expert and b in self.per_expert}
        self._routed: set[str] = set()  # layers streamed per expert whose experts were called with their routing
        self._later: dict[str, tuple] = {}  # layer -> the experts module's arguments for the share routing() left
        self.schedule = Schedule(list(plan.streamed))
        # (fetches, appends) for every K/V cache it offloads
        self.kv_streams = (device.new_stream(), device.new_stream()) if device.separate_memory else None
        # What the ring reads ahead: blocks that need a transfer. Where host memory is the device's,
        # a block held there needs none, so the disk reads on through such layers instead of idling.
        self._transferred = frozenset(plan.streamed if device.separate_memory else plan.on_disk)
        self._running: dict[str, object] = {}  # block -> its running() context, entered and not yet left
        self._step = None
        self._steps = 0
        self._hooks = []
        for name in plan.streamed:
            module = self.model.get_submodule(module_path(manifest.layers_path, name))
            self._hooks.append(module.register_forward_pre_hook(self._enter(name)))
            self._hooks.append(module.register_forward_hook(self._leave(name)))
        for name in self.per_expert:
            experts = self.model.get_submodule(module_path(manifest.layers_path, name) + "." + manifest.block(name).experts.module)
            before, after = self._route(name)
            self._hooks += [experts.register_forward_pre_hook(before), experts.register_forward_hook(after)]
        self._hooks.append(self.model.register_forward_pre_hook(lambda *_: self._start_step()))
        self._hooks.append(self.model.register_forward_hook(lambda *_: self._end_step()))

    @property
    def bytes_read(self) -> int:
        """Bytes streamed from disk since loading finished."""
        return self.disk.bytes_read - self._loaded_bytes

    def expert_counts(self) -> ExpertCounts:
        """Running totals of streaming per expert: expert bytes read, cache hits, guesses."""
        cache = self.expert_cache
        return ExpertCounts(self.slots.expert_bytes_read, cache.hits if cache else 0,
                            cache.hits + cache.misses if cache else 0, self.guess.made, self.guess.right,
                            self.guess.early_unused)

    @contextmanager
    def running(self, name: str):
        """One streamed block's turn, the whole per-layer pipeline in one place:

        1. ask for this block and the ones the schedule expects next: their reads start now
        2. queue copies for reads already finished, so they overlap this block's compute
        3. wait for this block's bytes and bind them into its modules
        4. the block's forward runs (the body), on the compute span
        5. unbind and release the slot (on a GPU the next copy into it waits for this compute)
        """
        self.schedule.ran(name)
        self.slots.want([name] + self.schedule.ahead(name, self.policy.prefetch_depth - 1, self._transferred))
        self.slots.advance()
        self._bindings[name].bind(self.slots.wait(name))
        try:
            with self.timeline.span("compute", name, stream=self.device.compute_stream()):
                yield
        finally:
            self._bindings[name].unbind()
            self.slots.release(name)

    def routing(self, name: str, hidden: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor | None = None,
                experts: nn.Module | None = None):
        """A mixture's layer streamed per expert, its router having picked (chosen: [tokens, k],
        with their weights):

        1. the experts to bring: the union over every position (padding included: its outputs
           must be finite too, or attention's zero weights on them would still make NaN)
        2. ask for them: those not here already (guessed, cached) start reading now
        3. guess the next layer's from these hidden states; read early those of reliable ranks
        4. wait for this layer's; but where one token picked two experts and only one of them is
           here (on a CPU), return the experts module's arguments narrowed to that one: it
           computes while the other lands, and routed_later() adds the other's share
        """
        routed = sorted(set(chosen.flatten().tolist()))
        self.guess.score(name, routed)
        self.slots.want_experts(name, routed)
        upcoming = self._next_layer.get(name)
        if upcoming is not None and self.guess.can_guess(upcoming) and self.slots.holds(upcoming):
            self.slots.want_experts(upcoming, self.guess.next(upcoming, hidden, chosen.shape[-1]))
        self._routed.add(name)
        if not (chosen.shape == (1, 2) and len(routed) == 2 and weights is not None and not self.device.separate_memory
                and splits_exactly(experts, hidden)):
            self.slots.wait_experts(name, routed)
            return None
        here, both = self.slots.first_here(name, routed)
        if both:
            return None
        first = chosen[0].tolist().index(here)
        self._later[name] = (hidden, chosen, weights, first)
        return hidden, chosen[:, first:first + 1], torch.ones_like(weights[:, :1])

    def routed_later(self, name: str, experts: nn.Module, output: torch.Tensor) -> torch.Tensor | None:
        """The layer's output once the expert routing() left for later is here: each expert's output
        (asked for with weight 1, so exactly its own), weighted and summed over k as grouped_mm
        sums them (in the weights' precision, rounded once), so the result is the one call's."""
        later = self._later.pop(name, None)
        if later is None:
            return None
        hidden, chosen, weights, first = later
        self.slots.wait_experts(name, [chosen[0, 1 - first].item()])
        second = experts.forward(hidden, chosen[:, 1 - first:2 - first], torch.ones_like(weights[:, :1]))  # no hooks again
        own = (output, second) if first == 0 else (second, output)
        return torch.stack([own[k] * weights[:, k:k + 1] for k in range(2)], dim=1).sum(dim=1).to(hidden.dtype)

    def _route(self, name: str):
        def before(module: nn.Module, args):
            return self.routing(name, args[0], args[1], args[2] if len(args) == 3 else None, module)

        def after(module: nn.Module, args, output):
            return self.routed_later(name, module, output)

        return before, after

    def _enter(self, name: str):
        def before(module: nn.Module, args) -> None:
            context = self.running(name)
            context.__enter__()
            self._running[name] = context

        return before

    def _leave(self, name: str):
        def after(module: nn.Module, args, output) -> None:
            self._running.pop(name).__exit__(None, None, None)
            if name in self.per_expert and name not in self._routed:
                raise ZeroliteError(
                    f"{name}'s experts ran without being called with their routing (a kernel replaced transformers' "
                    "mixture forward?), so zerolite could not bring the ones they used: load with --experts whole"
                )
            self._routed.discard(name)

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
        self._routed.clear()
        self._later.clear()
        if self._step is not None:
            self._end_step()

    def close(self) -> None:
        """Waits for reads in flight and orders compute after copies in flight (prefetches for a
        forward that never came), then unhooks."""
        self.slots.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def splits_exactly(experts: nn.Module | None, hidden: torch.Tensor) -> bool:
    """Whether a token's two experts computed apart give the one call's result bit for bit: with
    transformers' grouped_mm (the default, on CPUs too), whose sum over k routed_later() repeats,
    on bfloat16, where it runs torch's own grouped matmul. (Other dtypes go through its per-expert
    fallback, whose float32 matmul rounds a row differently by where it lands in the output: 1e-5
    on tiny gpt_oss logits. eager rounds each share to the hidden states' precision first.)"""
    config = getattr(experts, "config", None)
    return getattr(config, "_experts_implementation", None) == "grouped_mm" and hidden.dtype == torch.bfloat16


def host_memory(disk: DiskStore, plan: Plan, device: Device, world: World, progress) -> MemoryStore:
    """The streamed layers the plan holds in host memory (pinned on a GPU). Where several ranks
    run on one node, one copy for all of them, which on a CPU also holds the resident blocks
    (host memory is the device's there)."""
    if world.local_size > 1:
        return NodeCopy.load(disk, list(plan.in_host(device.separate_memory)), device, world, progress)
    return MemoryStore.load(disk, list(plan.in_memory), device.pinned_empty, progress)


def streamed_per_expert(model: nn.Module, layout: Layout, plan: Plan, policy: Policy,
                        device: Device) -> tuple[frozenset[str], str | None]:
    """The streamed layers whose experts move apart from their dense part: a mixture's layers
    laid out per expert whose experts take their routing, where a step moves their bytes at all
    (on a CPU a layer held in host memory moves nothing). And, where a mixture's layers must
    stream whole instead, one line saying why."""
    if policy.experts == "whole":
        return frozenset(), None
    per_expert, why = [], None
    for name in plan.streamed:
        if name not in plan.on_disk and not device.separate_memory:
            continue
        experts = find_experts(model.get_submodule(module_path(layout.manifest.layers_path, name)))
        area = layout.manifest.block(name).experts
        if experts is None:
            continue
        if not experts.routed:
            why = f"its experts module ({experts.kind}) is not called with the router's choice"
        elif area is None or area.module != experts.path:
            why = (f"the layout at {layout.folder} keeps each layer's experts together: convert the model again "
                   f"(zerolite convert MODEL --path {layout.folder}) to read only the experts the router picks")
        else:
            per_expert.append(name)
    note = f"{layout.manifest.model_type}'s layers stream whole, every expert at every step: {why}" if why else None
    return frozenset(per_expert), note


def build_model(layout: Layout, device: torch.device) -> nn.Module:
    """transformers' model for the layout's config: parameters on meta, buffers real on device.

    Compilation and CUDA graphs are off: they capture the addresses of the weights, which change
    every time a slot is rebound. A static cache that a config asks for by default (Gemma-2's
    "hybrid") gives way to the dynamic one, which zerolite's K/V offload also builds on.
    """
    config = AutoConfig.from_pretrained(layout.folder)
    model = build_meta_model(config, DTYPES[layout.manifest.dtype], real_buffers=True)
    model.eval()
    model.requires_grad_(False)
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)
    if (layout.folder / GENERATION_CONFIG).is_file():
        model.generation_config = GenerationConfig.from_pretrained(layout.folder)
    model.generation_config.disable_compile = True
    if model.generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        model.generation_config.cache_implementation = None
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(contiguous_input)
    return model


def contiguous_input(module: nn.Module, args: tuple) -> tuple:
    """A Linear's input, made contiguous (a no-op when it is). On a CPU, torch runs linear on a
    strided 16-bit 3-D input whose weight does not require grad on a slow path that also expands
    the weight once per sequence: the head applied to generate's last position
    (hidden[:, -1:, :]), for 16 sequences over a 32000 x 2048 bf16 head, took 5.1 s instead of
    14 ms, and 64 sequences over a 32000 x 256 head took 1 GB. Copying that strided input costs a
    few microseconds."""
    return (args[0].contiguous(), *args[1:])
