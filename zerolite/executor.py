"""The one loop that runs a transformers model whose weights stream through a ring of slots.

The model is transformers' own, built from the layout's config with its parameters on the meta
device. Resident blocks are bound once. Each streamed block (a decoder layer) gets a forward
pre-hook that brings its bytes in and binds them, and a forward hook that unbinds them and frees
its slot; the model's forward code runs unchanged, so any architecture transformers has works.

While block i computes, the blocks the schedule expects next are already being read (and on
CUDA copied), up to prefetch_depth - 1 ahead.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from transformers import AutoConfig, GenerationConfig

from zerolite.binding import BlockBinding
from zerolite.checkpoint import build_meta_model
from zerolite.io import IoEngine
from zerolite.layout import Layout
from zerolite.manifest import DTYPES
from zerolite.plan import Plan
from zerolite.policy import Policy
from zerolite.schedule import Schedule
from zerolite.slots import Slots
from zerolite.store import LayoutStore, MemoryStore
from zerolite.timeline import NO_TIMELINE

GENERATION_CONFIG = "generation_config.json"


class Executor:
    def __init__(self, layout: Layout, policy: Policy, plan: Plan, progress=None, timeline=NO_TIMELINE):
        """Builds the model and makes it ready to run the plan: resident blocks read and bound, hooks set.

        progress (a ByteProgress) is advanced by the bytes read while loading; timeline (a
        Timeline) records reads, copies, waits, compute and steps while the model runs.
        """
        manifest = layout.manifest
        self.layout = layout
        self.policy = policy
        self.timeline = timeline
        self.device = policy.torch_device
        self.plan = plan
        self.model = build_model(layout, self.device)
        self.engine = IoEngine(policy.io_backend, policy.io_queue_depth, policy.io_chunk_bytes)
        self._bindings = {block.name: BlockBinding(self.model, block, manifest.aliases) for block in manifest.blocks}

        started = time.perf_counter()
        resident = MemoryStore.load(layout, self.engine, list(self.plan.resident), pin=False, progress=progress)
        for name in self.plan.resident:
            self._bindings[name].bind(resident.bytes_of(name).to(self.device))
        del resident  # on CUDA a host staging copy: freed before the memory tier takes host memory

        self.disk = LayoutStore(layout, self.engine)
        memory = MemoryStore.load(layout, self.engine, list(plan.in_memory), pin=self.device.type == "cuda",
                                  progress=progress)
        loaded = manifest.nbytes(plan.loaded)
        # The disk's speed as loading saw it: reading blocks again just to time the disk would make
        # some disks (this machine's virtual one) serve the run that follows up to 2x slower.
        self.load_read_gbps = loaded / max(time.perf_counter() - started, 1e-9) / 1e9
        slot_bytes = max((manifest.block(name).length for name in plan.streamed), default=0)
        self.slots = Slots(self.disk if plan.on_disk else None, memory, policy.prefetch_depth, self.device,
                           slot_bytes, timeline)
        self.schedule = Schedule(list(self.plan.streamed))
        # What the ring reads ahead: blocks that need a transfer. On a CPU device a block held in
        # host memory needs none, so the disk reads on through such layers instead of idling.
        self._transferred = frozenset(plan.on_disk if self.device.type == "cpu" else plan.streamed)
        self._running: dict[str, object] = {}  # block -> its open compute span
        self._step = None
        self._steps = 0
        self._hooks = []
        for name in self.plan.streamed:
            module = self.model.get_submodule(f"{manifest.layers_path}.{name.removeprefix('layers.')}")
            self._hooks.append(module.register_forward_pre_hook(self._hook_before(name)))
            self._hooks.append(module.register_forward_hook(self._hook_after(name)))
        self._hooks.append(self.model.register_forward_pre_hook(lambda *_: self._start_step()))
        self._hooks.append(self.model.register_forward_hook(lambda *_: self._end_step()))

    @property
    def bytes_read(self) -> int:
        """Bytes streamed from disk since the executor was made (loading excluded)."""
        return self.disk.bytes_read

    def _hook_before(self, name: str):
        def before(module: nn.Module, args) -> None:
            self.before_block(name)

        return before

    def _hook_after(self, name: str):
        def after(module: nn.Module, args, output) -> None:
            self.after_block(name)

        return after

    def before_block(self, name: str) -> None:
        """1. ask for this block and the ones the schedule expects next: their reads start now
        2. queue copies for reads already finished (CUDA), so they overlap this block's compute
        3. wait for this block's bytes and bind them into its modules
        """
        self.schedule.ran(name)
        self.slots.want([name] + self.schedule.ahead(name, self.policy.prefetch_depth - 1, self._transferred))
        self.slots.advance()
        with self.timeline.span("wait", name):
            self._bindings[name].bind(self.slots.wait(name))
        compute = self.timeline.span("compute", name, stream=self._compute_stream())
        compute.__enter__()  # closed by after_block: the block's forward runs in between
        self._running[name] = compute

    def after_block(self, name: str) -> None:
        self._running.pop(name).__exit__(None, None, None)
        self._bindings[name].unbind()
        self.slots.release(name)

    def _start_step(self) -> None:
        self._step = self.timeline.span("step", f"step {self._steps}", stream=self._compute_stream())
        self._step.__enter__()

    def _end_step(self) -> None:
        self._step.__exit__(None, None, None)
        self._step = None
        self._steps += 1
        self.schedule.end_forward()

    def _compute_stream(self) -> torch.cuda.Stream | None:
        """Where compute is queued: timed there on CUDA, on the host clock otherwise."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" and self.timeline.enabled else None

    def recover(self) -> None:
        """After a forward that raised half-way: unbind what was running and free its slots."""
        for name in list(self._running):
            self.after_block(name)
        if self._step is not None:
            self._end_step()

    def close(self) -> None:
        """Waits for reads still in flight (prefetches for a forward that never came) and unhooks."""
        self.slots.drain()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def build_model(layout: Layout, device: torch.device) -> nn.Module:
    """transformers' model for the layout's config: parameters on meta, buffers real on device."""
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
    return model
