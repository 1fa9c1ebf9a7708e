"""The one loop that runs a transformers model whose weights stream through a ring of slots.

The model is transformers' own, built from the layout's config with its parameters on the meta
device, and comes with the rest of its parts (zerolite.runtime.parts): the resident blocks bound,
the host tier filled, the slots made. Each streamed block (a decoder layer) runs inside
Executor.running(name), entered by a forward pre-hook and left by a forward hook: the model's
forward code runs unchanged, so any architecture transformers has works.

While block i computes, the blocks the schedule expects next are already being read (and, where
the device has memory of its own, copied), up to prefetch_depth - 1 ahead.

With micro-batches, a layer bound once runs each of them (zerolite.runtime.micro_batches) before
its hook drops it: one load per layer per step serves the whole batch.

A mixture's layer laid out per expert streams its dense part that way; hooks on its experts
module then bring only the experts the step's router picked, and guess the next layer's, so that
their reads start early (zerolite.moe.routing).
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from zerolite.layout.blocks import module_path
from zerolite.runtime.decode_threads import DecodeThreads, kernel_rows
from zerolite.runtime.micro_batches import MicroBatched
from zerolite.runtime.parts import Parts
from zerolite.runtime.schedule import Schedule


class Executor:
    def __init__(self, parts: Parts):
        """Sets the hooks that run the plan on parts' model: each streamed block's turn, the
        experts' routing, and a step's span on the timeline."""
        self.parts = parts
        self.model, self.device, self.timeline = parts.model, parts.device, parts.timeline
        self.slots, self.routing, self._bindings = parts.slots, parts.routing, parts.bindings
        self.prefetch_depth = parts.policy.prefetch_depth
        plan, manifest = parts.plan, parts.layout.manifest
        self.schedule = Schedule(list(plan.streamed))
        # What the ring reads ahead: blocks that need a transfer. Where host memory is the device's,
        # a block held there needs none, so the disk reads on through such layers instead of idling.
        self._transferred = frozenset(plan.streamed if self.device.separate_memory else plan.on_disk)
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
        if parts.policy.micro_batches > 1:  # every decoder layer, resident ones too: each takes its share's cache
            self._hooks.append(MicroBatched([self.model.get_submodule(module_path(manifest.layers_path, name))
                                             for name in manifest.layer_names], parts.policy.micro_batches))
        # quantized and bf16 layers on the CPU compute with zerolite's kernels, on a pool of their own
        self._decode_threads = None
        if kernel_rows(manifest) and not self.device.separate_memory:
            self._decode_threads = DecodeThreads(self.model, kernel_rows(manifest))
            self._hooks.append(self._decode_threads)
        self._hooks.append(self.model.register_forward_pre_hook(lambda *_: self._start_step()))
        self._hooks.append(self.model.register_forward_hook(lambda *_: self._end_step()))

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
        self.slots.want([name] + self.schedule.ahead(name, self.prefetch_depth - 1, self._transferred))
        self.slots.read_ahead(self.schedule.ahead(name, self.prefetch_depth, self._on_disk))
        self.slots.advance()
        self._bindings[name].bind(self.slots.wait(name))
        try:
            with self.timeline.span("compute", name, stream=self.device.compute_stream()):
                yield
        finally:
            self._bindings[name].unbind()
            self.slots.done_with(name)

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
        if self._decode_threads is not None:
            self._decode_threads.restore()
        if self._step is not None:
            self._end_step()

    def close(self) -> None:
        """Waits for reads in flight and orders compute after copies in flight (prefetches for a
        forward that never came), then unhooks."""
        self.slots.close()
        self.parts.caches.close()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
