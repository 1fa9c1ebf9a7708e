"""The Python API: load a model for streamed inference, then generate as with transformers.

    lm = zerolite.load("/nvme/bloom", offload="nvme")
    batch = lm.tokenizer(prompts, return_tensors="pt", padding=True)
    out = lm.generate(**batch, max_new_tokens=100)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import time

import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS

from zerolite.convert.resolve import ensure_layout
from zerolite.distributed.world import SINGLE, World
from zerolite.errors import ZeroliteError
from zerolite.hf import cache_keyword, load_tokenizer, quiet_transformers
from zerolite.io.device import Device
from zerolite.io.engine import IoEngine
from zerolite.layout.folder import Layout
from zerolite.moe.counts import ExpertCounts
from zerolite.planner import measurements
from zerolite.runtime.executor import Executor
from zerolite.runtime.kv_cache import PartialOffloadCache
from zerolite.runtime.loader import build_executor, open_layout, rank_device
from zerolite.runtime.plan import Plan
from zerolite.runtime.policy import Policy, parse_size
from zerolite.runtime.timeline import NO_TIMELINE, Timeline
from zerolite.speculative.decoding import Speculator, speculative_decoding
from zerolite.speculative.draft import (
    SELF_DRAFTS,
    check_draft_fits,
    check_same_vocabulary,
    draft_layout,
    draft_step_s,
    quantize_head,
    ring_depth,
)
from zerolite.text import check_token_ids

# Up to 5.17 a sliding-window cache layer recording its past (for a rewind) hands attention every key
# it holds, not the window its mask was made for: speculative decoding's next pass fails in attention.
SLIDING_CACHE_REWINDS = Version(transformers.__version__) >= Version("5.18")
FILL_RECORDED_BYTES = 256 << 20  # a load that read this much (or more) records how fast memory filled


class OffloadedLM:
    """A transformers causal LM whose blocks stream from disk or host memory as it runs.

    .model is transformers' own model object, .tokenizer its tokenizer (None when the layout has
    none), .generate takes everything transformers' generate does. .plan, .layout, .policy,
    .device and .load_read_gbps are what the plan printer and the profiler read.
    """

    def __init__(self, executor: Executor, tokenizer, load_s: float, convert_s: float, draft: OffloadedLM | None = None,
                 draft_step_s: float | None = None, world: World = SINGLE):
        self.executor = executor
        self.world = world  # the ranks of a torchrun job, each with a model of its own
        self.model = executor.model
        self.tokenizer = tokenizer
        self.load_s = load_s
        self.convert_s = convert_s
        self.draft = draft  # held resident; generate drafts with it (zerolite.speculative.draft, zerolite.speculative.decoding)
        self.speculator = Speculator(draft.model, executor.timeline, draft_step_s) if draft is not None else None

    @property
    def device(self) -> Device:
        """The zerolite Device the model runs on (its streams, memory and events)."""
        return self.executor.device

    @property
    def torch_device(self) -> torch.device:
        return self.executor.device.torch_device

    @property
    def config(self):
        return self.model.config

    @property
    def generation_config(self):
        return self.model.generation_config

    @property
    def bytes_read(self) -> int:
        return self.executor.bytes_read

    def expert_counts(self) -> ExpertCounts:
        """Running totals of a mixture streamed per expert (zerolite.moe.counts)."""
        return self.executor.expert_counts()

    @property
    def plan(self) -> Plan:
        return self.executor.plan

    @property
    def layout(self) -> Layout:
        return self.executor.layout

    @property
    def policy(self) -> Policy:
        return self.executor.policy

    @property
    def engine(self) -> IoEngine:
        return self.executor.engine

    @property
    def load_read_gbps(self) -> float:
        """How fast the disk read while loading: the plan's bound uses it."""
        return self.executor.load_read_gbps

    @property
    def per_expert(self) -> frozenset[str]:
        """The streamed layers whose experts are read apart, only those the router picks."""
        return self.executor.per_expert

    @property
    def host_experts(self) -> frozenset[str]:
        """Of those, the layers whose routed experts the host computes (`experts` cpu on a GPU)."""
        return self.executor.host_experts

    def new_cache(self, tokens: int = 0):
        """The cache generate would make: with kv_offload, that share of the layers' K/V in host memory,
        its buffers made for tokens (where the job's length is known) from the pool all caches share."""
        fraction = self.policy.kv_offload
        if fraction > 0:
            return PartialOffloadCache(self.model.config, fraction, self.device, self.executor.kv_streams,
                                       self.executor.kv_buffers, tokens)
        return DynamicCache(config=self.model.config.get_text_config(decoder=True))

    def recover(self) -> None:
        """After a forward that raised half-way: what was running unbound and its slots freed, so
        that the next forward starts clean."""
        self.executor.recover()

    def settle(self) -> None:
        """Waits for the reads ahead still in flight (a profile puts them on its timeline too)."""
        self.executor.slots.drain()

    def generate(self, *args, **kwargs):
        """transformers' generate, with tensor arguments moved to the model's device and, with
        kv_offload set, a cache that keeps that fraction of the layers' K/V in host memory."""
        input_ids = args[0] if args else kwargs.get("input_ids")
        check_token_ids(self.model.config, input_ids)
        kwargs = cache_renamed(kwargs)
        refuse_static_cache(self.model, kwargs)
        if self.draft is not None:
            if isinstance(input_ids, torch.Tensor) and input_ids.shape[0] > 1:
                raise ZeroliteError(f"speculative decoding runs at batch 1, and this batch has {input_ids.shape[0]} "
                                    "prompts: give them one at a time, or leave out `draft` to batch them")
            asked = kwargs.get("generation_config") or self.model.generation_config
            beams = kwargs.get("num_beams", asked.num_beams) or 1  # transformers 5 leaves unset fields None
            if beams > 1 or kwargs.get("return_dict_in_generate", asked.return_dict_in_generate):
                raise ZeroliteError("speculative decoding decodes greedily or by sampling and returns token ids: "
                                    "leave out num_beams and return_dict_in_generate, or load without a draft")
            # transformers hands a callable custom_generate its own new keywords only, not the streamer
            kwargs["custom_generate"] = functools.partial(speculative_decoding, speculator=self.speculator,
                                                          streamer=kwargs.get("streamer"))
        args = tuple(a.to(self.torch_device) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.to(self.torch_device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        config = kwargs.get("generation_config") or self.model.generation_config
        fraction = self.executor.policy.kv_offload
        offload_kv = fraction > 0 and given_cache(kwargs) is None
        if not config.disable_compile or (offload_kv and config.cache_implementation is not None):
            # compiling would capture one forward's weight addresses; and generate refuses a cache
            # passed in beside a configured one
            config = kwargs["generation_config"] = copy.copy(config)
            config.disable_compile = True
            if offload_kv:
                config.cache_implementation = None
        cache = self.new_cache(job_length(input_ids, kwargs, config)) if offload_kv else None
        if cache is not None:
            kwargs[cache_keyword()] = cache
        output = None
        try:
            output = self.model.generate(*args, **kwargs)
            return output
        except BaseException:
            self.recover()
            raise
        finally:
            if cache is not None:
                if getattr(output, cache_keyword(), None) is cache:
                    cache.settle()  # the caller has it
                else:
                    cache.release()  # its host buffers serve the next generate

    def close(self) -> None:
        self.executor.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> OffloadedLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def cache_renamed(kwargs: dict) -> dict:
    """generate's arguments with a cache given under either name put under the one the installed
    transformers takes (zerolite.hf.cache_keyword): code written for either release runs on both."""
    other = "past_key_values" if cache_keyword() == "cache" else "cache"
    if other not in kwargs:
        return kwargs
    renamed = dict(kwargs)
    renamed[cache_keyword()] = renamed.pop(other)
    return renamed


def given_cache(kwargs: dict):
    """The cache a caller passed to generate (after cache_renamed)."""
    return kwargs.get(cache_keyword())


def refuse_static_cache(model, kwargs: dict) -> None:
    """zerolite rebinds each layer's weights to a slot's bytes at every forward; a static cache is
    there to capture the forward in CUDA graphs or torch.compile, which would keep the addresses
    of one forward's slots."""
    config = kwargs.get("generation_config") or model.generation_config
    asked = kwargs.get("cache_implementation") or getattr(config, "cache_implementation", None)
    cache = given_cache(kwargs)
    if asked in ALL_STATIC_CACHE_IMPLEMENTATIONS or (cache is not None and getattr(cache, "is_compileable", False)):
        raise ZeroliteError(
            f"a static cache ({asked or type(cache).__name__}) cannot run with streamed weights: zerolite rebinds "
            "each layer's weights at every forward, which CUDA graphs and torch.compile do not allow; use the default "
            "dynamic cache"
        )


def load(
    model: str | os.PathLike | None = None,
    offload: str = "nvme",
    path: str | os.PathLike | None = None,
    device: str | Device = "auto",
    dtype: str | None = None,
    allow_pickle: bool = False,
    show_progress: bool = True,
    timeline: Timeline | None = None,
    draft: str | os.PathLike | None = None,
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
    quiet_transformers()
    world = World.from_env() if world is None else world
    world.start()
    show_progress = show_progress and world.leads
    for budget in ("gpu_memory", "cpu_memory"):
        if isinstance(policy.get(budget), str):
            policy[budget] = parse_size(policy[budget], f"`{budget}`")
    policy = world.run_on_all(lambda: Policy(offload=offload, device=device, **policy), "checking the arguments")
    started = time.perf_counter()
    # The node's first rank converts (if need be) before the others open what it wrote.
    converted = world.run_on_all(lambda: ensure_layout(model, path, dtype, allow_pickle, show_progress, weights) if world.local_rank == 0
                           else None, "converting the model")
    layout_folder = world.run_on_all(lambda: converted or ensure_layout(model, path, dtype, allow_pickle, show_progress, weights),
                               "opening the layout")
    convert_s = time.perf_counter() - started

    started = time.perf_counter()
    draft_lm, guess_s, layout, target, tokenizer = None, None, None, None, None
    try:
        def prepare() -> None:
            nonlocal layout, target, tokenizer
            layout = open_layout(layout_folder, dtype)
            if policy.kv_offload > 0 or draft is not None:
                refuse_what_its_cache_cannot_do(AutoConfig.from_pretrained(layout.side_folder), policy.kv_offload > 0,
                                                draft is not None)
            target = rank_device(policy, world)
            target.adopt_thread()  # what transformers allocates on "cuda" lands on the model's GPU, not GPU 0
            tokenizer = load_tokenizer(layout.side_folder)

        def draft_first() -> Policy:
            """The draft is held whole: loaded before the budgets, with a ring deep enough to read
            on while it guesses."""
            nonlocal draft_lm, guess_s
            draft_lm = load_draft(str(draft), draft_group_size, layout, tokenizer, target, show_progress)
            guess_s = draft_step_s(draft_lm)
            return dataclasses.replace(policy, prefetch_depth=ring_depth(policy, layout, draft_lm, guess_s))

        world.run_on_all(prepare, "opening the layout")
        if draft is not None:  # the node's first rank makes a self-draft's layout, as it converted the model's
            world.run_on_all(lambda: draft_layout(str(draft), layout, draft_group_size, show_progress)
                       if world.local_rank == 0 else None, "making the draft")
        executor = build_executor(layout, policy, target, world, show_progress, timeline or NO_TIMELINE,
                                  draft_first if draft is not None else None)
    except BaseException:
        if draft_lm is not None:
            draft_lm.close()
        raise
    if world.leads and executor.loaded_bytes >= FILL_RECORDED_BYTES:  # what filling memory costs here, for zerolite plan
        measurements.record_fill(executor.loaded_bytes, executor.loaded_bytes / executor.load_read_gbps / 1e9)
    return OffloadedLM(executor, tokenizer, time.perf_counter() - started, convert_s, draft_lm, guess_s, world)


def refuse_what_its_cache_cannot_do(config, kv_offload: bool, draft: bool) -> None:
    """Said before anything loads, not as a forward's error (or, rewinding a state, wrong tokens):

    - a model whose forward makes a cache class of its own (MiniMax's, RWKV's state) refuses any
      other, and kv_offload's cache and a draft's are DynamicCaches (transformers' own test for such
      models: _supports_default_dynamic_cache);
    - speculative decoding rewinds the target's cache past the guesses it rejects, which crop cannot
      do to a recurrent state (state-space, linear-attention and recurrent layers: transformers'
      LinearAttention cache layers, which are not is_croppable once they hold one), nor, before
      transformers 5.18, a sliding window's (SLIDING_CACHE_REWINDS)."""
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    name = model_class.__name__ if model_class is not None else type(config).__name__
    if model_class is not None and not model_class._supports_default_dynamic_cache():
        if kv_offload:
            raise ZeroliteError(f"{name} keeps its cache in a class of its own, which `kv_offload` cannot split between "
                                "device and host memory: leave out `kv_offload`")
        raise ZeroliteError(f"{name} keeps its cache in a class of its own, which speculative decoding cannot rewind: "
                            "leave out `draft`")
    if draft:
        layers = DynamicCache(config=config.get_text_config(decoder=True)).layers
        if any(hasattr(layer, "recurrent_states") for layer in layers):  # LinearAttentionCacheLayerMixin's
            raise ZeroliteError(f"{name} has layers that carry a recurrent state, which speculative decoding cannot "
                                "rewind past the guesses it rejects: leave out `draft`")
        if not SLIDING_CACHE_REWINDS and any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ZeroliteError(f"{name} has sliding-window layers, whose cache transformers {transformers.__version__} "
                                "cannot rewind past rejected guesses: upgrade it (pip install 'transformers>=5.18'), "
                                "or leave out `draft`")


def load_draft(spec: str, group_size: int | None, target: Layout, tokenizer, device: Device,
               show_progress: bool) -> OffloadedLM:
    """The draft of speculative decoding, held whole on the model's device (zerolite.speculative.draft)."""
    folder = draft_layout(spec, target, group_size, show_progress)
    check_same_vocabulary(tokenizer, AutoConfig.from_pretrained(target.side_folder), folder)
    check_draft_fits(Layout.open(folder), device)
    draft = load(folder, offload="none", device=device, show_progress=show_progress, world=SINGLE)  # each rank its own
    if spec in SELF_DRAFTS and not device.separate_memory:  # a GPU would dequantise it at every guess
        quantize_head(draft)
    return draft


def job_length(input_ids, kwargs: dict, config) -> int:
    """How many tokens a generate call's sequences reach at most (0 where that is not known)."""
    new = kwargs.get("max_new_tokens", config.max_new_tokens)
    if new is not None and isinstance(input_ids, torch.Tensor):
        return input_ids.shape[-1] + new
    return kwargs.get("max_length", config.max_length) or 0
