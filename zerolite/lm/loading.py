"""zerolite.load: a model opened for streamed inference, in four steps alike on every rank of a
torchrun job: the layout (converted once per node), each rank's device, the executor, and the
draft where there is one (held whole, loaded before the budgets are measured).

    lm = zerolite.load("/nvme/bloom", offload="nvme")
    lm = load_spec(LoadSpec(model="/nvme/bloom", cpu_memory="24GB"))     # as the command line does
"""

from __future__ import annotations

import dataclasses
import time

from zerolite.convert.resolve import ensure_layout
from zerolite.distributed.world import SINGLE, World
from zerolite.hf import quiet_transformers
from zerolite.lm.offloaded_lm import OffloadedLM
from zerolite.planner import measurements
from zerolite.runtime.load_spec import LoadSpec
from zerolite.runtime.loader import build_executor
from zerolite.runtime.opening import Opened, open_on_rank
from zerolite.runtime.policy import Policy
from zerolite.runtime.timeline import NO_TIMELINE, Timeline
from zerolite.speculative.draft import SELF_DRAFTS, checked_draft_layout, draft_layout
from zerolite.speculative.draft_speed import draft_step_s, quantize_head, ring_depth

FILL_RECORDED_BYTES = 256 << 20  # a load that read this much (or more) records how fast memory filled


def load(
    model=None,
    offload: str = "nvme",
    path=None,
    device="auto",
    dtype: str | None = None,
    allow_pickle: bool = False,
    show_progress: bool = True,
    timeline: Timeline | None = None,
    draft=None,
    draft_group_size: int | None = None,
    world: World | None = None,
    weights: str | None = None,
    **policy,
) -> OffloadedLM:
    """Loads model for streamed inference.

    model: a zerolite layout folder, or a checkpoint (model folder, .gguf file, hub id in the local
    cache), converted first into path (default: zerolite's cache) and reused on later loads.
    None means the built-in SmolLM2-135M-Instruct. timeline, if given, records what the executor
    does (zerolite profile). draft: a layout or checkpoint sharing the model's tokenizer, or
    "self-int4" / "self-int8" (with draft_group_size), held resident to draft for speculative
    decoding at batch 1 (zerolite.speculative.draft). weights: "int8" or "int4" runs a checkpoint converted
    so (once, into a folder of its own; a layout given must hold them), "stored" or None its own
    precision. The remaining keywords are Policy fields (prefetch_depth, gpu_memory,
    cpu_memory (bytes, or sizes such as "24GB"), kv_offload, io_backend, ...).

    Under torchrun (world: default from the environment) every rank calls load alike: each runs
    on its own device (cuda is the GPU of its LOCAL_RANK), the ranks of a node share one copy of
    the host-memory tier (zerolite.distributed.node_copy), all make the same plan, and a failure on any rank
    raises on every rank (zerolite.distributed.world).
    """
    spec = LoadSpec(model=model, offload=offload, path=path, device=device, dtype=dtype, weights=weights,
                    allow_pickle=allow_pickle, draft=draft, draft_group_size=draft_group_size, **policy)
    return load_spec(spec, show_progress, timeline, world)


def load_spec(spec: LoadSpec, show_progress: bool = True, timeline: Timeline | None = None,
              world: World | None = None) -> OffloadedLM:
    """What spec asks for, loaded (zerolite.load's arguments are made a LoadSpec; the command line
    makes one of its options):

    1. the layout: the node's first rank converts the model where need be, the others open what it wrote
    2. each rank opens it on its device (zerolite.runtime.opening)
    3. the executor (zerolite.runtime.loader), after the draft where there is one
    """
    quiet_transformers()
    world = World.from_env() if world is None else world
    world.start()
    show_progress = show_progress and world.leads
    policy = world.run_on_all(spec.policy, "checking the arguments")

    started = time.perf_counter()
    converted = world.run_on_all(lambda: layout_folder(spec, show_progress) if world.local_rank == 0 else None,
                                 "converting the model")
    folder = world.run_on_all(lambda: converted or layout_folder(spec, show_progress), "opening the layout")
    convert_s = time.perf_counter() - started

    started = time.perf_counter()
    opened = world.run_on_all(lambda: open_on_rank(folder, spec.dtype, policy, world, spec.draft is not None),
                              "opening the layout")
    drafting = Drafting(spec, opened, policy, show_progress) if spec.draft is not None else None
    try:
        if drafting is not None:  # the node's first rank makes a self-draft's layout, as it converted the model's
            world.run_on_all(lambda: drafting.make_layout() if world.local_rank == 0 else None, "making the draft")
        executor = build_executor(opened.layout, policy, opened.device, world, show_progress, timeline or NO_TIMELINE,
                                  drafting.load if drafting is not None else None)
    except BaseException:
        if drafting is not None:
            drafting.close()
        raise
    parts = executor.parts
    if world.leads and parts.loaded_bytes >= FILL_RECORDED_BYTES:  # what filling memory costs here, for zerolite plan
        measurements.record_fill(parts.loaded_bytes, parts.loaded_bytes / parts.load_read_gbps / 1e9)
    draft_lm, step_s = (drafting.lm, drafting.step_s) if drafting is not None else (None, None)
    return OffloadedLM(executor, opened.tokenizer, time.perf_counter() - started, convert_s, draft_lm, step_s)


def layout_folder(spec: LoadSpec, show_progress: bool):
    """The layout spec's model runs from, converted first where need be."""
    return ensure_layout(spec.model, spec.path, spec.dtype, spec.allow_pickle, show_progress, spec.weights)


class Drafting:
    """The draft of speculative decoding for one load: held whole on the model's device, loaded
    before the budgets so that they see what it left, with a ring deep enough to read on while it
    guesses."""

    def __init__(self, spec: LoadSpec, target: Opened, policy: Policy, show_progress: bool):
        self.name, self.group_size = str(spec.draft), spec.draft_group_size
        self.target, self.policy, self.show_progress = target, policy, show_progress
        self.lm: OffloadedLM | None = None
        self.step_s: float | None = None  # one guess, timed

    def make_layout(self) -> None:
        """A self-draft's layout, converted from the target's source (once per node)."""
        draft_layout(self.name, self.target.layout, self.group_size, self.show_progress)

    def load(self) -> Policy:
        """Loads the draft, and gives the policy to plan the model with."""
        self.lm = load_draft(self.name, self.group_size, self.target, self.show_progress)
        self.step_s = draft_step_s(self.lm)
        depth = ring_depth(self.policy, self.target.layout, self.lm, self.step_s)
        return dataclasses.replace(self.policy, prefetch_depth=depth)

    def close(self) -> None:
        if self.lm is not None:
            self.lm.close()


def load_draft(name: str, group_size: int | None, target: Opened, show_progress: bool) -> OffloadedLM:
    """The draft of speculative decoding, held whole on the target's device (zerolite.speculative.draft)."""
    folder = checked_draft_layout(name, target.layout, group_size, target.tokenizer, target.device, show_progress)
    spec = LoadSpec(model=folder, offload="none", device=target.device)
    draft = load_spec(spec, show_progress, world=SINGLE)  # each rank its own
    if name in SELF_DRAFTS and not target.device.separate_memory:  # a GPU would dequantise it at every guess
        quantize_head(draft)
    return draft
